"""The core stays pure: no I/O, no asyncio, no clocks of its own (style guide, principle 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import corral
import corral.core

CORE = Path(corral.core.__file__).parent
FORBIDDEN = {
    "asyncio",
    "socket",
    "subprocess",
    "threading",
    "time",
    "os",
    "io",
    "httpx",
    "sqlite3",
    "psycopg",
    "random",
    "datetime",
    "logging",
    "pathlib",
    "matplotlib",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_nothing_that_does_io_or_keeps_time() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 6
    for f in files:
        bad = imported_modules(f) & FORBIDDEN
        assert not bad, f"{f.name} imports {sorted(bad)}"


def test_core_depends_only_on_config_and_itself() -> None:
    for f in CORE.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("corral")
            ):
                assert node.module.startswith(("corral.core", "corral.config")), (
                    f.name,
                    node.module,
                )


def test_public_surface() -> None:
    assert set(corral.core.__all__) >= {
        "Scheduler",
        "Effects",
        "Request",
        "make_policy",
        "plan_placement",
    }
    assert set(corral.__all__) >= {"Config", "load_config", "ConfigError", "CorralError"}


def test_the_package_loads_its_public_names_on_first_use() -> None:
    for name in corral.__all__:
        assert getattr(corral, name) is not None, name
    assert corral.Queue.__module__ == "corral.queue"
    assert "Queue" in dir(corral)
    with pytest.raises(AttributeError, match="NoSuchThing"):
        corral.NoSuchThing  # noqa: B018
