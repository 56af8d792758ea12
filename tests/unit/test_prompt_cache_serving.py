"""Which models keep their prompt caches across swaps and how their servers are started
(`prompt_cache.caches.serving`), the `prompt_cache:` configuration, and the conversation keys
a request body gives (`prompt_cache.server.conversation_keys`)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from corral.config import Config, ModelConfig, PromptCacheConfig, parse_config
from corral.config.server import runs_llama_server
from corral.errors import ConfigError
from corral.prompt_cache.caches import folder_of, serving
from corral.prompt_cache.server import conversation_keys, model_file

ON = PromptCacheConfig()
HERE = Path("/var/states")


def plan(cmd: str, settings: PromptCacheConfig = ON, **kw: object) -> tuple[list[str], bool, str]:
    s = serving(ModelConfig(cmd=cmd, **kw), settings, HERE)
    return shlex.split(s.cmd or ""), s.on, s.why


def test_llama_server_gets_the_save_path_and_exact_restores() -> None:
    argv, on, why = plan("/opt/bin/llama-server -m /m/a.gguf --port ${PORT}")
    assert on
    assert why == ""
    assert argv[-3:] == ["--slot-save-path", "/var/states", "--swa-full"]


def test_the_llama_extras_wrapper_gets_them_after_its_separator() -> None:
    argv, on, _ = plan("llama-cpp-server -m a.gguf --port ${PORT}")
    assert on
    assert argv[argv.index("--") + 1 :] == ["--slot-save-path", "/var/states", "--swa-full"]
    argv, on, _ = plan("llama-cpp-server -m a.gguf -- --parallel 2 --swa-full")
    assert on
    assert argv.count("--") == 1
    assert argv.count("--swa-full") == 1
    assert argv[-2:] == ["--slot-save-path", "/var/states"]


def test_other_servers_and_switched_off_models_are_left_as_they_are() -> None:
    for cmd in ("vllm serve m --port ${PORT}", "python -m sglang.launch_server"):
        argv, on, why = plan(cmd)
        assert (argv, on, why) == (shlex.split(cmd), False, "")
    cmd = "llama-server -m a.gguf"
    assert plan(cmd, prompt_cache=False)[:2] == (shlex.split(cmd), False)
    assert plan(cmd, PromptCacheConfig(enabled=False))[:2] == (shlex.split(cmd), False)
    # Said to: a server that takes llama-server's flags under another name.
    argv, on, _ = plan("/opt/my-llama --port ${PORT}", prompt_cache=True)
    assert on
    assert "--slot-save-path" in argv


def test_a_command_with_its_own_save_path_or_no_slot_api_is_left_with_a_reason() -> None:
    argv, on, why = plan("llama-server -m a.gguf --slot-save-path /mine")
    assert not on
    assert "own --slot-save-path" in why
    assert argv.count("--slot-save-path") == 1
    argv, on, why = plan("llama-server -m a.gguf --no-slots")
    assert not on
    assert "--no-slots" in why


def test_a_folder_with_macros_or_spaces_is_passed_as_data() -> None:
    s = serving(ModelConfig(cmd="llama-server -m a.gguf"), ON, Path("/tmp/my ${env.HOME} states"))
    assert s.on
    assert s.cmd is not None
    assert "$${env.HOME}" in s.cmd  # escaped: never expanded (process.substitute reads `$${`)
    assert shlex.split(s.cmd)[-3] == "--slot-save-path"


def test_runs_llama_server_reads_the_program_name_only() -> None:
    assert runs_llama_server("/usr/local/bin/llama-server -m x")
    assert not runs_llama_server("echo llama-server")
    assert not runs_llama_server("llama-server 'unclosed")
    assert not runs_llama_server("")


def test_the_configuration_switch_and_section() -> None:
    base = "models:\n  a:\n    cmd: llama-server -m a.gguf\n"
    assert parse_config(base).prompt_cache == PromptCacheConfig()
    assert not parse_config(base + "prompt_cache: false\n").prompt_cache.enabled
    assert parse_config(base + "prompt_cache: true\n").prompt_cache.enabled
    c = parse_config(base + "prompt_cache:\n  dir: /s\n  max_gb: 2\n  min_tokens: 10\n")
    assert (c.prompt_cache.dir, c.prompt_cache.max_gb, c.prompt_cache.min_tokens) == ("/s", 2, 10)
    with pytest.raises(ConfigError, match="max_gb"):
        parse_config(base + "prompt_cache:\n  max_gb: -1\n")
    with pytest.raises(ConfigError, match="prompt_cache"):
        parse_config(base + "prompt_cache:\n  max_bytes: 3\n")
    assert folder_of(PromptCacheConfig(), Path("/logs")) == Path("/logs/prompt-cache")
    assert isinstance(Config.model_validate({"models": {"a": {}}}), Config)


def test_conversation_keys_lead_with_what_is_rendered_before_the_messages() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    chat = conversation_keys({"messages": msgs})
    assert len(chat) == 2  # the head (system, tools), then each message
    longer = conversation_keys({"messages": [*msgs, {"role": "assistant", "content": "yo"}]})
    assert longer[:2] == chat
    other_system = conversation_keys({"messages": msgs, "system": "be brief"})
    assert other_system[0] != chat[0]
    with_tools = conversation_keys({"messages": msgs, "tools": [{"type": "function"}]})
    assert with_tools[0] != chat[0]
    assert conversation_keys({"prompt": "x" * 3000}) != []
    nothing: list[dict[str, object]] = [
        {}, {"messages": []}, {"messages": "no"}, {"prompt": ""}, {"input": "e"}
    ]  # fmt: skip
    for body in nothing:
        assert conversation_keys(body) == []
    # Whatever a client sends hashes: odd shapes are keys, never errors.
    assert len(conversation_keys({"messages": [1, None, [2], {"role": {"x": 1}}]})) == 5


def test_model_file_is_read_from_the_command_line() -> None:
    assert model_file(["llama-server", "-m", "/a.gguf"]) == Path("/a.gguf")
    assert model_file(["llama-server", "--model=/b.gguf"]) == Path("/b.gguf")
    assert model_file(["llama-server", "-m"]) is None
    assert model_file(["llama-server", "-hf", "x/y"]) is None
