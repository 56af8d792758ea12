"""Which models keep their prompt caches across swaps and how their servers are started
(`prompt_cache.caches.serving`), the `prompt_cache:` configuration, and the conversation keys
a request body gives (`prompt_cache.server.conversation_keys`)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from corral.cmdline import model_file
from corral.config import Config, ModelConfig, PromptCacheConfig, parse_config
from corral.config.server import runs_llama_server
from corral.errors import ConfigError
from corral.gateway.servers.activity import prefill
from corral.gateway.servers.fleet import process_spec
from corral.prompt_cache.caches import folder_of, serving
from corral.prompt_cache.server import conversation_id, conversation_keys

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


def test_idle_slots_stay_in_the_kv_cache_unless_the_model_says_otherwise() -> None:
    """llama-server clears idle slots of a unified KV cache on a new task (its RAM prompt
    cache's default): several restored conversations would lose all but the first
    (make bench-slot-restores). An environment variable, so an older server ignores it."""
    cmd = "/opt/bin/llama-server -m /m/a.gguf --port ${PORT}"
    assert serving(ModelConfig(cmd=cmd), ON, HERE).env == {"LLAMA_ARG_CACHE_IDLE_SLOTS": "false"}
    said = ModelConfig(cmd=cmd, env={"LLAMA_ARG_CACHE_IDLE_SLOTS": "true"})
    assert serving(said, ON, HERE).env == {}
    assert serving(ModelConfig(cmd=cmd + " --cache-idle-slots"), ON, HERE).env == {}
    assert serving(ModelConfig(cmd="vllm serve m"), ON, HERE).env == {}  # not kept: nothing
    spec = process_spec("a", said, cmd, {"LLAMA_ARG_CACHE_IDLE_SLOTS": "false"})
    assert spec.env["LLAMA_ARG_CACHE_IDLE_SLOTS"] == "true"  # the model's own env wins


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
    assert len(chat) == 1  # each message; nothing is rendered before them
    longer = conversation_keys({"messages": [*msgs, {"role": "assistant", "content": "yo"}]})
    assert longer[:1] == chat
    # Two conversations with nothing before their messages share no key for it.
    assert conversation_keys({"messages": [{"role": "user", "content": "ho"}]})[0] != chat[0]
    other_system = conversation_keys({"messages": msgs, "system": "be brief"})
    assert len(other_system) == 2  # the head (system, tools), then each message
    assert other_system[1] != chat[0]
    with_tools = conversation_keys({"messages": msgs, "tools": [{"type": "function"}]})
    assert with_tools[0] != other_system[0]
    assert conversation_keys({"prompt": "x" * 3000}) != []
    nothing: list[dict[str, object]] = [
        {}, {"messages": []}, {"messages": "no"}, {"prompt": ""}, {"input": "e"}
    ]  # fmt: skip
    for body in nothing:
        assert conversation_keys(body) == []
    # Whatever a client sends hashes: odd shapes are keys, never errors.
    assert len(conversation_keys({"messages": [1, None, [2], {"role": {"x": 1}}]})) == 4


def test_model_file_is_read_from_the_command_line() -> None:
    assert model_file(["llama-server", "-m", "/a.gguf"]) == Path("/a.gguf")
    assert model_file(["llama-server", "--model=/b.gguf"]) == Path("/b.gguf")
    assert model_file(["llama-server", "-m"]) is None
    assert model_file(["llama-server", "-hf", "x/y"]) is None


def test_an_answers_prefill_is_read_from_its_usage_and_timings() -> None:
    whole = (
        b'{"usage": {"completion_tokens": 4, "prompt_tokens": 812}, '
        b'"timings": {"cache_n": 700, "prompt_n": 112, "prompt_ms": 250.5}}'
    )
    assert prefill(whole) == (812, 112, 0.2505)
    anthropic = b'{"usage": {"cache_read_input_tokens": 0, "input_tokens": 100}}'
    assert prefill(anthropic) == (100, 0, 0.0)
    assert prefill(b"data: [DONE]\n\n") == (0, 0, 0.0)
    assert prefill(b'"prompt_n": 3, "prompt_ms": 1e400') == (0, 3, 0.0)  # odd: no figure


def test_a_sim_backend_speaks_the_slot_api_with_a_prompt_cache(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from corral.bundled.sim_server import SimSettings, build_app

    settings = SimSettings(
        "m", load_s=0, tokens_per_s=1e6, parallel=2, prefill_tok_s=1e6,
        state_tok_s=1e7, slot_save_path=str(tmp_path),
    )  # fmt: skip
    with TestClient(build_app(settings)) as c:
        prompt = " ".join(f"w{i}" for i in range(300))
        first = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "id_slot": 1})
        assert first.json()["timings"]["cache_n"] == 0
        assert first.json()["timings"]["prompt_n"] == 300
        slots = c.get("/slots").json()
        assert [s.get("n_prompt_tokens") for s in slots] == [None, 300]
        saved = c.post("/slots/1?action=save", json={"filename": "a.state"}).json()
        assert saved["n_saved"] == 300
        assert (tmp_path / "a.state").stat().st_size == saved["n_written"]
        assert c.post("/slots/0?action=restore", json={"filename": "a.state"}).status_code == 200
        again = c.post(
            "/v1/completions", json={"prompt": prompt + " more", "max_tokens": 1, "id_slot": 0}
        )
        assert again.json()["timings"]["cache_n"] == 300
        assert again.json()["timings"]["prompt_n"] == 1
        for bad in ("../x", "a/b", ""):
            r = c.post("/slots/0?action=save", json={"filename": bad})
            assert r.status_code == 400
        assert c.post("/slots/9?action=erase").status_code == 400
        missing = c.post("/slots/0?action=restore", json={"filename": "none.state"})
        assert missing.status_code == 400
        assert c.get("/slots").json()[0].get("n_prompt_tokens") is None  # left empty


def test_a_conversation_is_named_by_its_beginning() -> None:
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
    later = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert conversation_id({"messages": first}) == conversation_id({"messages": later})
    other = [{"role": "system", "content": "s"}, {"role": "user", "content": "z"}]
    assert conversation_id({"messages": first}) != conversation_id({"messages": other})
    assert conversation_id({"prompt": "short"}) is not None  # its first 1,024 characters
    assert conversation_id({"prompt": "x" * 2000}) == conversation_id({"prompt": "x" * 3000})
    assert conversation_id({}) is None
    assert conversation_id({"prompt": ""}) is None


def test_the_configuration_guides_prompt_cache_example_is_a_valid_configuration() -> None:
    import re

    readme = (Path(__file__).parents[2] / "docs" / "guides" / "configuration.md").read_text()
    (text,) = [
        b for b in re.findall(r"^```yaml\n(.*?)^```$", readme, flags=re.S | re.M)
        if "prompt_cache:" in b
    ]  # fmt: skip
    config = parse_config(text)
    assert config.prompt_cache.max_gb == 10
    assert config.keeps_prompt_cache("coder")  # said to
    assert not config.keeps_prompt_cache("chat")  # said not to
    coder = serving(config.models["coder"], config.prompt_cache, HERE)
    assert coder.cmd is not None
    assert "--slot-save-path" in coder.cmd


def test_llama_swaps_own_example_keeps_its_llama_servers_caches() -> None:
    """llama-swap's configurations whose `cmd` runs llama-server (its example file as
    shipped), on by default; its docker-run vLLM left as it is."""
    from corral.llamaswap import load_config_file

    fixtures = Path(__file__).parent.parent / "fixtures" / "llama-swap"
    config, _ = load_config_file(fixtures / "groups-and-macros.yaml")
    kept = {n for n in config.models if config.keeps_prompt_cache(n)}
    assert "qwen-coder-7b" in kept  # /app/llama-server ...
    for name in kept:
        cmd = serving(config.models[name], config.prompt_cache, HERE).cmd
        assert cmd is not None
        assert cmd.endswith("--slot-save-path /var/states --swa-full")
    for name in set(config.models) - kept:
        cmd = config.models[name].cmd or ""
        assert not runs_llama_server(cmd) or "--slot-save-path" in cmd, name


def test_a_folder_that_cannot_be_made_leaves_the_servers_as_they_are(tmp_path: Path) -> None:
    """llama-server refuses to start with a --slot-save-path that is not a folder: a states'
    folder Corral cannot make must never stop a model from serving."""
    from corral.backends.process import ProcessBackend
    from corral.gateway.servers.fleet import Servers
    from corral.prompt_cache.caches import PromptCaches

    (tmp_path / "a-file").write_text("not a folder")
    bad = PromptCacheConfig(dir=str(tmp_path / "a-file" / "states"))
    fine = PromptCacheConfig(dir=str(tmp_path / "states"))
    model = ModelConfig(cmd="llama-server -m a.gguf --port ${PORT}")
    for settings, kept in ((bad, False), (fine, True)):
        caches = PromptCaches(settings, Path(settings.dir or ""))
        servers = Servers(tmp_path / "logs", lambda *_: None, caches)
        servers.add("a", model)
        backend = servers.backends["a"]
        assert isinstance(backend, ProcessBackend)
        assert ("--slot-save-path" in backend.spec.cmd) is kept
        assert caches.usable() is kept
