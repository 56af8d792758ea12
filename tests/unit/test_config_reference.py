"""docs/reference/config.md is written from the configuration's schema (field descriptions
included) and stays current: a key added, renamed or described anew without regenerating the
page fails here. The page's own example is a valid configuration."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from corral.config import Config, parse_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "config.md"


def test_the_reference_is_what_the_schema_says_now() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_every_key_of_the_file_is_on_the_page_with_a_description() -> None:
    text = PAGE.read_text()
    for name, field in Config.model_fields.items():
        row = re.search(rf"^\| `{name}` \|.*\| (.+) \|$", text, re.MULTILINE)
        assert row is not None, name
        assert row.group(1).strip(), name  # described
        assert field.description


def test_the_pages_example_is_a_valid_configuration() -> None:
    example = re.search(r"```yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert example is not None
    config = parse_config(example.group(1))
    assert sorted(config.models) == ["chat", "embed"]
