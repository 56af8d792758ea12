"""Secrets found in a configuration, and masked in text."""

from __future__ import annotations

import os
from pathlib import Path

from corral.config import parse_config
from corral.secrets import Redactor, flag_values, mask, secrets_of, warn_if_exposed

CONFIG = """
models:
  a: {cmd: "llama-server --port ${PORT} --api-key sk-aaaaaaaaaaaaaaaa1111 -m x.gguf"}
  b: {cmd: "vllm serve m --api-key=sk-bbbbbbbbbbbbbbbb2222 --hf-token hf_cccccccccccc3333"}
  c: {upstream: "http://u:up-dddddddddddddddd4444@10.0.0.2:9000", upstream_api_key: short}
server:
  api_keys: [sk-eeeeeeeeeeeeeeee5555]
  principals:
    team:
      keys:
        - team-hhhhhhhhhhhhhhhh8888
        - "sha256:0000000000000000000000000000000000000000000000000000000000000000"
  store: postgresql://app:pg-ffffffffffffffff6666@db/corral
batch:
  webhook_secret: whsec_gggggggggggggggg7777
"""


def test_masks_show_the_ends_of_long_secrets_only() -> None:
    assert mask("sk-0123456789abcdef4f2a") == "sk-...4f2a"
    assert mask("short-key") == "***"


def test_secret_flags_in_commands_are_found_in_every_form() -> None:
    assert flag_values("srv --api-key A --token=B --hf-token 'C D' --port 1") == ["A", "B", "C D"]
    assert flag_values("srv --api-key 'unterminated") == ["'unterminated"]


def test_every_secret_of_a_config_is_found_and_masked_in_text() -> None:
    c = parse_config(CONFIG)
    found = secrets_of(c)
    assert set(found) == {
        "sk-aaaaaaaaaaaaaaaa1111",
        "sk-bbbbbbbbbbbbbbbb2222",
        "hf_cccccccccccc3333",
        "up-dddddddddddddddd4444",
        "short",
        "sk-eeeeeeeeeeeeeeee5555",
        "pg-ffffffffffffffff6666",
        "whsec_gggggggggggggggg7777",
        "team-hhhhhhhhhhhhhhhh8888",  # a digest is no secret
    }
    text = CONFIG + " and a log line saying short and sk-eeeeeeeeeeeeeeee5555"
    shown = Redactor.of(c)(text)
    assert not any(s in shown for s in found)
    assert "sk-...5555" in shown
    assert "***" in shown


def test_a_config_others_can_read_warns_only_while_it_holds_keys(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)
    c = parse_config(CONFIG)
    f.chmod(0o644)
    assert "can be read (it holds API keys)" in (warn_if_exposed(f, c) or "")
    f.chmod(0o600)
    assert warn_if_exposed(f, c) is None
    f.chmod(0o666)
    assert "written (a changed `cmd` runs as you) and read" in (warn_if_exposed(f, c) or "")
    os.environ["CORRAL_T_KEY"] = "sk-eeeeeeeeeeeeeeee5555"
    try:
        from_env = "models: {a: {load_s: 1}}\nserver: {api_keys: ['${env.CORRAL_T_KEY}']}\n"
        f.write_text(from_env)
        f.chmod(0o644)
        assert warn_if_exposed(f, parse_config(from_env)) is None  # the key is not in the file
    finally:
        del os.environ["CORRAL_T_KEY"]


def test_a_reloaded_config_adds_its_secrets_and_keeps_the_old_ones() -> None:
    """`corral serve --watch`: a model added with a key in its command is masked at once; the
    removed model's key stays masked (its server's log is still shown)."""
    before = parse_config("models:\n  a: {cmd: 'srv --api-key sk-old-aaaaaaaaaaaa1111'}\n")
    after = parse_config("models:\n  b: {cmd: 'srv --api-key sk-new-bbbbbbbbbbbb2222'}\n")
    shown = Redactor.of(before).with_config(after)(
        "sk-old-aaaaaaaaaaaa1111 sk-new-bbbbbbbbbbbb2222"
    )
    assert "aaaaaaaa" not in shown
    assert "bbbbbbbb" not in shown
    assert shown.count("sk-...") == 2
