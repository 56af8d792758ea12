"""llama-swap's config format mapped onto Corral's (pure: no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from corral.config import Config
from corral.core import Request, Scheduler
from corral.errors import ConfigError
from corral.llamaswap import Mapping, convert, load_any, load_config_file, looks_like_llama_swap
from tests.helpers import Clock, RecordedEffects

FIXTURES = Path(__file__).parent.parent / "fixtures" / "llama-swap"


def test_groups_macros_hooks_and_api_keys() -> None:
    config, mapping = load_config_file(FIXTURES / "groups-and-macros.yaml")
    assert mapping is not None
    coder = config.models["qwen-coder-7b"]
    assert coder.cmd == (
        "/app/llama-server --port ${PORT} --ctx-size 8192 "
        "-m /models/qwen2.5-coder-7b-q4_k_m.gguf --parallel 2"
    )
    assert coder.aliases == ["coder", "gpt-4o-mini"]
    assert coder.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert coder.concurrency == 4  # llama-swap's in-flight limit
    assert config.models["llama-3.1-8b"].concurrency == 10  # its default
    assert coder.health_timeout_s == 90
    assert coder.proxy == "http://127.0.0.1:${PORT}"
    llama = config.models["llama-3.1-8b"]
    assert llama.cmd_stop == "docker stop llama-${MODEL_ID}"  # filled in when it stops
    assert config.server.api_keys == ["sk-local-1"]
    assert config.resolve("gpt-4o-mini") == "qwen-coder-7b"
    ignored = dict(mapping.ignored)
    assert "Corral gives each ${PORT}" in ignored["startPort"]
    assert coder.ttl_s == 300
    assert config.models["nomic-embed"].unlisted
    assert config.server.preload == ["nomic-embed"]
    # The persistent group stays up beside the chat group: a device of its own.
    assert [d.name for d in config.devices] == ["shared", "group-always-on"]
    assert coder.devices == llama.devices == ["shared"]
    assert config.models["nomic-embed"].devices == ["group-always-on"]
    embed_filters = config.models["nomic-embed"].filters
    assert embed_filters is not None
    assert embed_filters.strip_params == ["temperature", "top_p"]
    assert dict(mapping.mapped)["models.qwen-coder-7b.concurrencyLimit"].startswith(
        "concurrency: in flight"
    )


def test_vllm_in_docker_with_stop_commands_and_no_health_check() -> None:
    config, mapping = load_config_file(FIXTURES / "vllm-docker.yaml")
    assert mapping is not None
    qwen, mistral = config.models["qwen-32b-awq"], config.models["mistral-7b"]
    assert qwen.cmd is not None
    assert qwen.cmd.startswith("docker run --rm --gpus all --name vllm-${MODEL_ID} -p ${PORT}")
    assert qwen.check_endpoint == "/v1/models"
    assert qwen.health_timeout_s == 300
    assert mistral.check_endpoint == "none"
    assert mistral.cmd_stop == "docker stop $(docker ps -q --filter publish=${PORT})"


def test_corral_files_are_not_mistaken_for_llama_swap() -> None:
    assert not looks_like_llama_swap({"models": {"a": {"cmd": "x", "load_s": 3}}})
    config, mapping = load_any("models:\n  a: {cmd: run-a, load_s: 3}\n", "c.yaml")
    assert mapping is None
    assert config.models["a"].load_s == 3


def test_an_unknown_macro_is_named() -> None:
    text = "healthCheckTimeout: 5\nmodels:\n  m:\n    cmd: ${nope} --port ${PORT}\n"
    with pytest.raises(ConfigError, match=r"models\.m\.cmd: unknown macro \$\{nope\}"):
        load_any(text, "ls.yaml")


def test_groups_side_by_side_and_exclusive_share_one_device_by_slots() -> None:
    text = """
models:
  a: {cmd: run-a}
  b: {cmd: run-b}
  c: {cmd: run-c}
  d: {cmd: run-d, ttl: 0}
groups:
  pair: {swap: false, members: [a, b]}
  big: {members: [c]}
  side: {exclusive: false, members: [d]}
globalTTL: 60
"""
    config, mapping = load_any(text, "ls.yaml")
    assert mapping is not None
    shared = next(d for d in config.devices if d.name == "shared")
    a, b, c, d = (config.models[n] for n in "abcd")
    # a and b fit together (two slots); c, in a swap group, fills the device.
    assert shared.memory_gb == 2
    assert (a.memory_gb, b.memory_gb, c.memory_gb) == (1, 1, 2)
    assert d.devices == ["group-side"]
    assert (a.ttl_s, d.ttl_s) == (60, None)  # globalTTL, and ttl 0 = never


def test_group_members_must_be_models_in_one_group() -> None:
    text = "models:\n  a: {cmd: x}\ngroups:\n  g: {members: [a, zz]}\n  h: {members: [a]}\n"
    with pytest.raises(ConfigError) as err:
        load_any(text, "ls.yaml")
    assert "member 'zz' is no model" in str(err.value)
    assert "'a' is also in group 'g'" in str(err.value)


def test_small_models_side_by_side_and_a_big_one_on_one_card() -> None:
    config, mapping = load_config_file(FIXTURES / "small-models-side-by-side.yaml")
    assert mapping is not None
    (card,) = config.devices
    assert (card.name, card.memory_gb) == ("shared", 3)
    small = [config.models[n] for n in ("qwen2.5-0.5b", "gemma-2b", "bge-small")]
    big = config.models["qwen2.5-32b"]
    assert [m.memory_gb for m in small] == [1, 1, 1]  # the three fit together
    assert big.memory_gb == 3  # the big one takes the card
    assert [m.ttl_s for m in small] == [300, None, 300]  # globalTTL; ttl 0 = never
    assert big.ttl_s == 60
    assert config.server.preload == ["qwen2.5-0.5b", "gemma-2b", "bge-small"]
    assert config.resolve("text-embedding-3-small") == "bge-small"
    assert not mapping.ignored


def test_the_mapped_groups_schedule_as_llama_swap_would() -> None:
    config, _ = load_config_file(FIXTURES / "small-models-side-by-side.yaml")
    fx = RecordedEffects()
    clock = Clock()
    s = Scheduler(config, fx, clock)
    for name in config.server.preload:  # one load at a time on the card, each into free room
        assert s.on_load_requested(name, evict=False) is None
        s.on_load_finished(name)
    assert sorted(m.name for m in s.board.residents()) == ["bge-small", "gemma-2b", "qwen2.5-0.5b"]
    assert [c[:2] for c in fx.take()] == [("load", n) for n in config.server.preload]
    s.on_request(Request("r1", "qwen2.5-32b"))
    assert fx.take() == [("load", "qwen2.5-32b", ("bge-small", "gemma-2b", "qwen2.5-0.5b"))]


EVERY = FIXTURES / "every-key.yaml"


def every_key(monkeypatch: pytest.MonkeyPatch) -> tuple[Config, Mapping]:
    monkeypatch.setenv("CORRAL_TEST_WEIGHTS", "/models")
    monkeypatch.setenv("CORRAL_TEST_KEY", "sk-from-env")
    config, mapping = load_config_file(EVERY)
    assert mapping is not None
    return config, mapping


def test_every_documented_key_is_mapped_or_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _, mapping = every_key(monkeypatch)
    said = {key for key, _ in mapping.mapped} | {key for key, _ in mapping.ignored}
    doc = yaml.safe_load(EVERY.read_text())
    keys = [str(k) for k in doc] + [
        f"models.{name}.{k}" for name, m in doc["models"].items() for k in m
    ]
    silent = [
        k for k in keys if k != "models" and not any(s == k or s.startswith(f"{k}.") for s in said)
    ]
    assert not silent, silent
    ignored = dict(mapping.ignored)
    assert "forwarded to http://192.0.2.10:8080" in dict(mapping.mapped)["peers.other-box"]
    assert "approximates" in dict(mapping.mapped)["matrix"]
    assert ignored["hooks.on_startup.preload.not-a-model"] == "no such model: not preloaded"


def test_env_comments_typed_macros_ttl_and_concurrency_as_llama_swap_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, _ = every_key(monkeypatch)
    # ${env.*} is expanded in apiKeys: the literal text is never a key
    assert config.server.api_keys == ["sk-literal", "sk-from-env"]
    big = config.models["big-thinker"]
    assert big.cmd == (
        "/opt/llama/llama-server --port ${PORT} --model /models/gguf/big.gguf "
        "--ctx-size 32768 --temp 0.6 --flash-attn true"  # comments gone; true, not True
    )
    assert config.models["small-fast"].cmd == (
        "/opt/llama/llama-server --port ${PORT} --model /models/gguf/small.gguf --ctx-size 8192"
    )
    assert big.check_endpoint == "/health?model=${MODEL_ID}"
    assert big.aliases == ["thinker-32768", "plain-alias", "big-thinker:fast"]
    assert big.upstream_model == "vendor/big-thinker"
    assert big.ttl_s == 120  # -1: globalTTL
    assert big.health_timeout_s == 15  # llama-swap's minimum
    assert big.concurrency == 10  # 0: llama-swap's default in-flight limit
    assert big.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    small = config.models["small-fast"]
    assert small.ttl_s is None  # 0: never unload
    assert small.concurrency == 3
    assert small.health_timeout_s == 200
    assert small.cmd_stop == "kill -TERM ${PID}"
    assert config.resolve("thinker-32768") == "big-thinker"
    assert big.filters is not None
    assert big.filters.strip_params == ["top_k"]
    assert big.filters.set_params == {"temperature": 0.6}
    assert big.filters.set_params_by_id == {"big-thinker:fast": {"reasoning_effort": "low"}}
    assert config.resolve("big-thinker:fast") == "big-thinker"  # each id is an alias
    assert (big.name, big.description) == ("Big thinker", "a reasoning model, 32768 tokens")
    # typed macros in metadata: a number stays a number; ${PORT} is known only at start
    assert big.metadata == {"port": "${PORT}", "temperature": 0.6, "note": "big-thinker at 32768"}
    assert config.server.list_aliases
    remote = config.models["other-box/remote-model"]  # a peer's model, with the peer's key
    assert config.resolve("remote-model") == "other-box/remote-model"  # one peer has it
    assert (remote.upstream, remote.upstream_model) == ("http://192.0.2.10:8080", "remote-model")
    assert remote.upstream_api_key == "sk-from-env"
    assert remote.devices == ["peer-other-box"]
    assert big.devices == small.devices == ["matrix"]  # the matrix's; never the peer's device
    assert (big.stop_grace_s, small.stop_grace_s) == (2, 4)  # unloadTimeout, per model or global
    assert config.server.preload == ["small-fast"]  # an unknown name is reported, not fatal


def test_an_unset_environment_variable_is_an_error_naming_it_and_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CORRAL_TEST_WEIGHTS", "/models")
    monkeypatch.delenv("CORRAL_TEST_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        load_config_file(EVERY)
    text = str(err.value)
    assert "apiKeys.1: environment variable CORRAL_TEST_KEY is not set" in text
    assert "every-key.yaml:26: apiKeys.1:" in text  # the line of that key
    assert "${env.CORRAL_TEST_KEY}" not in str(  # never kept as a working key
        [p for p in err.value.problems if "apiKeys" in p.where]
    ).replace("(${env.CORRAL_TEST_KEY})", "")


def test_routing_groups_and_scheduler_priorities_map_as_the_legacy_groups_do() -> None:
    text = """
models:
  chat: {cmd: "server --port ${PORT}"}
  coder: {cmd: "server --port ${PORT}"}
  embed: {cmd: "server --port ${PORT}"}
routing:
  router:
    use: group
    settings:
      groups:
        swapping: {swap: true, members: [chat, coder, ghost]}
        always: {persistent: true, swap: false, exclusive: false, members: [embed]}
      matrix: {sets: {all: "chat & coder"}}
  scheduler:
    use: fifo
    settings: {fifo: {priority: {coder: 10, nobody: 3}}}
"""
    config, mapping = load_any(text, "routing.yaml")
    assert mapping is not None
    assert [d.name for d in config.devices] == ["shared", "group-always"]
    assert config.models["chat"].devices == config.models["coder"].devices == ["shared"]
    assert config.models["embed"].devices == ["group-always"]
    assert (config.models["coder"].priority, config.models["chat"].priority) == (10, 0)
    ignored = dict(mapping.ignored)
    assert ignored["routing.router.settings.groups.swapping.members.ghost"] == "no such model"
    assert "unused" in ignored["routing.router.settings.matrix"]
    assert ignored["routing.scheduler.settings.fifo.priority.nobody"] == "no such model"


def test_peers_models_by_qualified_name_and_by_bare_name_when_unambiguous() -> None:
    text = """
models:
  local: {cmd: "server --port ${PORT}"}
peers:
  one: {proxy: "http://127.0.0.1:1", models: [shared-name, only-one, local]}
  two: {proxy: "http://127.0.0.1:2", apiKey: k, models: [shared-name]}
"""
    config, _ = load_any(text, "peers.yaml")
    assert config.resolve("only-one") == "one/only-one"
    assert config.resolve("shared-name") is None  # two peers have it: qualify it
    assert config.resolve("two/shared-name") == "two/shared-name"
    assert config.resolve("local") == "local"  # the local model wins
    assert config.resolve("one/local") == "one/local"
    assert config.models["two/shared-name"].upstream_api_key == "k"


def test_the_matrix_router_expands_its_sets_and_shares_one_device() -> None:
    text = """
models:
  gemma: {cmd: "server --port ${PORT}"}
  qwen: {cmd: "server --port ${PORT}"}
  voice: {cmd: "server --port ${PORT}"}
  rerank: {cmd: "server --port ${PORT}"}
  big: {cmd: "server --port ${PORT}"}
routing:
  router:
    use: matrix
    settings:
      matrix:
        vars: {g: gemma, q: qwen, v: voice, e: rerank}
        evict_costs: {v: 50}
        sets:
          llms: "g | q"
          standard: "+llms & v"
          with_rerank: "(g | q) & v & e"
          full: "big"
"""
    config, mapping = load_any(text, "matrix.yaml")
    assert mapping is not None
    assert [(d.name, d.memory_gb) for d in config.devices] == [("matrix", 3.0)]
    # gemma, qwen, voice and rerank may run three at a time; big is in no multi-model set
    sizes = {name: m.memory_gb for name, m in config.models.items()}
    assert sizes == {"gemma": 1.0, "qwen": 1.0, "voice": 1.0, "rerank": 1.0, "big": 1.0}
    assert "approximates" in dict(mapping.mapped)["routing.router.settings.matrix"]
    assert "evict_costs" in str(mapping.ignored)
    with pytest.raises(ConfigError, match=r"unbalanced parentheses"):
        load_any(text.replace('"big"', '"(big"'), "matrix.yaml")


def test_a_minimal_llama_swap_file_is_read_as_one() -> None:
    text = """
models:
  tiny:
    cmd: |
      # comment lines are dropped
      llama-server --port ${PORT} -m tiny.gguf
    proxy: http://127.0.0.1:${PORT}
    env: ["OMP_NUM_THREADS=2"]
    aliases: [t]
"""
    config, mapping = load_any(text, "minimal.yaml")
    assert mapping is not None
    tiny = config.models["tiny"]
    assert tiny.cmd == "llama-server --port ${PORT} -m tiny.gguf"
    assert tiny.env == {"OMP_NUM_THREADS": "2"}
    assert config.resolve("t") == "tiny"
    assert tiny.concurrency == 10


DOCS = Path(__file__).parents[2] / "docs" / "llama-swap.md"


def _table_keys(section: str) -> dict[str, str]:
    text = DOCS.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| `")]
    return {key.strip().strip("`"): what.strip() for key, what in rows}


def test_the_docs_table_matches_the_converter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each documented key, alone in a file, comes out mapped or reported, as the table says."""
    monkeypatch.setenv("CORRAL_TEST_WEIGHTS", "/models")
    monkeypatch.setenv("CORRAL_TEST_KEY", "k")
    every = yaml.safe_load(EVERY.read_text())
    sample_model = every["models"]["big-thinker"]
    values: dict[str, object] = {
        **every,
        "routing": {"router": {"use": "group", "settings": {"groups": {"g": {"members": ["m"]}}}}},
        "groups": {"g": {"members": ["m"]}},
        "matrix": {"sets": {"alone": "m"}},
        "selectors": {},
        "profiles": {},
        "ui": {},
        "performance": {},
    }
    top = _table_keys("Top-level keys")
    assert len(top) >= 24
    for key, what in top.items():
        if key == "models":
            continue
        doc = {key: values.get(key, 1), "models": {"m": {"cmd": "server --port ${PORT}"}}}
        if key == "hooks":
            doc[key] = {"on_startup": {"preload": ["m"]}}
        _, mapping = convert(doc, "t.yaml")
        said = dict(mapping.mapped) if what.startswith("mapped") else dict(mapping.ignored)
        assert any(k == key or k.startswith(f"{key}.") for k in said), (key, mapping)
    model_keys = _table_keys("Model keys")
    assert len(model_keys) >= 21
    for key, what in model_keys.items():
        entry = {"cmd": "server --port ${PORT}", key: sample_model.get(key, 1)}
        simple: dict[str, object] = {
            "cmd": "server --port ${PORT}",
            "env": ["A=1"],
            "macros": {"x": 1},
            "aliases": ["x"],
            "metadata": {"a": 1},
            "filters": {"stripParams": "top_k"},
            "description": "d",
            "useModelName": "u",
        }
        if key in simple:
            entry[key] = simple[key]
        _, mapping = convert({"models": {"m": entry}}, "t.yaml")
        said = dict(mapping.mapped) if what.startswith("mapped") else dict(mapping.ignored)
        assert f"models.m.{key}" in said, (key, mapping)


def test_an_invalid_converted_value_is_named_by_the_users_key_and_line() -> None:
    text = """models:
  m:
    cmd: server --port ${PORT}
    capabilities:
      in: [text, video]
"""
    with pytest.raises(ConfigError) as err:
        load_any(text, "caps.yaml")
    (problem,) = err.value.problems
    assert problem.where == "models.m.capabilities.in.1"  # llama-swap's key, not `inputs`
    assert problem.line == 5
    assert "video" in problem.message
    with pytest.raises(ConfigError, match=r"healthCheckTimeout: 'soon' is not seconds"):
        load_any("healthCheckTimeout: soon\nmodels: {m: {cmd: x}}\n", "t.yaml")
