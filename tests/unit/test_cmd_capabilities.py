"""A `cmd:` model's capabilities read from its command: the chat template
llama-server will use decides whether it takes tools, as llama-server decides it."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.compose import with_capabilities
from corral.config import parse_config
from corral.modelfiles.capabilities import capabilities_of, takes_tools
from corral.modelfiles.folder import builtin_template
from corral.zoo import make


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cmd-caps")
    own = make("qwen3", folder / "own", weights=False).path  # its template renders tools
    bare = make("qwen3", folder / "bare", weights=False, template=False).path
    return {"own": own, "bare": bare}


def test_the_template_llama_server_will_use_decides(files: dict[str, Path]) -> None:
    own, bare = str(files["own"]), str(files["bare"])
    assert takes_tools(["llama-server", "-m", own, "--port", "1"]) is True
    assert takes_tools(["llama-server", "--model=" + own, "--jinja"]) is True
    assert takes_tools(["llama-server", "-m", own, "--no-jinja"]) is False
    assert takes_tools(["llama-server", "-m", bare]) is False  # the generic one: no tools
    assert takes_tools(["llama-server", "-m", bare, "--chat-template", "chatml"]) is False
    gemma = str(builtin_template("gemma3"))
    assert takes_tools(["llama-server", "-m", bare, "--chat-template-file", gemma]) is True
    assert takes_tools(["llama-cpp-server", "-m", own, "--", "--no-jinja"]) is False


def test_what_cannot_be_told_is_left_unsaid(tmp_path: Path) -> None:
    assert takes_tools(["vllm", "serve", "Qwen/Qwen3-8B"]) is None
    assert takes_tools(["llama-server", "-m", str(tmp_path / "missing.gguf")]) is None
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert takes_tools(["llama-server", "-m", str(tmp_path / "bad.gguf")]) is None
    assert capabilities_of("llama-server -m 'unclosed") is None  # not even a command line


def test_a_config_gets_them_unless_it_says_its_own(files: dict[str, Path]) -> None:
    text = f"""
models:
  told:
    cmd: llama-server -m {files["bare"]} --port ${{PORT}}
    capabilities: {{tools: true}}
  bare:
    cmd: llama-server -m {files["bare"]} --port ${{PORT}}
  sim:
    cmd: corral sim-backend --model ${{MODEL_ID}} --port ${{PORT}}
  other:
    cmd: some-server --port ${{PORT}}
"""
    models = with_capabilities(parse_config(text, "t.yaml")).models
    assert models["told"].capabilities is not None
    assert models["told"].capabilities.tools is True  # the config's word wins
    assert models["bare"].capabilities is not None
    assert models["bare"].capabilities.tools is False
    assert models["sim"].capabilities is not None
    assert models["sim"].capabilities.tools is True
    assert models["other"].capabilities is None
