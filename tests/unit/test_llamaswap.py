"""llama-swap's config format mapped onto Corral's (pure: no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.core import Request, Scheduler
from corral.errors import ConfigError
from corral.llamaswap import load_any, load_config_file, looks_like_llama_swap
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
    assert coder.max_queue == 4
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
    assert "request rewriting" in ignored["models.nomic-embed.filters"]
    assert ("models.qwen-coder-7b.concurrencyLimit", "models.qwen-coder-7b.max_queue") in (
        mapping.mapped
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
    assert sorted(m.name for m in s.resident_models()) == ["bge-small", "gemma-2b", "qwen2.5-0.5b"]
    assert [c[:2] for c in fx.take()] == [("load", n) for n in config.server.preload]
    s.on_request(Request("r1", "qwen2.5-32b"))
    assert fx.take() == [("load", "qwen2.5-32b", ("bge-small", "gemma-2b", "qwen2.5-0.5b"))]
