"""The model server protocol's figures, read from `/api/status`: which models a host
holds in `lora_requests_info`'s lists, how many it can hold at once as the scheduler packs
them, and the slot use standing for a KV cache's."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from corral.gateway.servers.epp import ProtocolMetrics, Residency, residency, slot_use

pytestmark = pytest.mark.unit


def model(
    state: str,
    memory_gb: float | None = None,
    queued: int = 0,
    in_flight: int = 0,
    concurrency: int = 1,
    aliases: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "state": state, "memory_gb": memory_gb, "queued": queued, "in_flight": in_flight,
        "concurrency": concurrency, "aliases": aliases or [],
    }  # fmt: skip


def device(memory_gb: float | None, used_gb: float, resident: list[str]) -> dict[str, Any]:
    return {"name": "g", "memory_gb": memory_gb, "used_gb": used_gb, "resident": resident}


def test_running_is_ready_waiting_is_loading_or_queued_and_max_counts_the_room() -> None:
    status = {
        "models": {
            "coder": model("ready", 10, in_flight=1, concurrency=4, aliases=["coder:latest"]),
            "explorer": model("loading", 6),
            "chat": model("unloaded", 4, queued=3),
            "big": model("unloaded", 20),
            "idle": model("unloaded", 2),
        },
        "devices": [device(24, 16, ["coder", "explorer"])],
    }
    held = residency(status)
    assert held.running == ("coder", "coder:latest")
    assert held.waiting == ("explorer", "chat")
    # Resident: coder and explorer; free 8 GB: idle (2) and chat (4) fit, big (20) does not.
    assert held.max_models == 4
    assert slot_use(status) == 0.25


def test_devices_without_a_size_hold_one_model_each() -> None:
    status = {
        "models": {"a": model("ready"), "b": model("unloaded"), "c": model("unloaded")},
        "devices": [device(None, 1, ["a"]), device(None, 0, [])],
    }
    assert residency(status) == Residency(("a",), (), 2)


def test_nothing_resident_is_no_slot_in_use_and_a_full_host_has_no_room() -> None:
    status = {
        "models": {"a": model("ready", 24, in_flight=3, concurrency=2), "b": model("unloaded", 8)},
        "devices": [device(24, 24, ["a"])],
    }
    assert residency(status).max_models == 1  # running == max: the scorer's "full"
    assert slot_use(status) == 1.0  # at most 1
    idle = {"models": {"a": model("unloaded", 8)}, "devices": [device(24, 0, [])]}
    assert slot_use(idle) == 0.0


@pytest.mark.parametrize("vllm", [False, True])
def test_the_exposition_has_the_protocols_names_types_and_comma_lists(vllm: bool) -> None:
    status = {
        "models": {"a": model("ready", 8), "b": model("ready", 8), "c": model("loading", 8)},
        "devices": [device(24, 24, ["a", "b", "c"])],
    }
    registry = CollectorRegistry()
    registry.register(ProtocolMetrics(lambda: status, vllm=vllm))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = {"corral_requests_waiting", "corral_requests_running",
             "corral_kv_cache_usage_perc", "corral_lora_requests_info"}  # fmt: skip
    if vllm:
        names |= {"vllm:num_requests_waiting", "vllm:num_requests_running",
                  "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"}  # fmt: skip
    assert set(families) == names
    assert all(f.type == "gauge" for f in families.values())
    (info,) = families["corral_lora_requests_info"].samples
    # As the EPP's extractor reads them: split on commas, spaces trimmed.
    assert [x.strip() for x in info.labels["running_lora_adapters"].split(",")] == ["a", "b"]
    assert info.labels["waiting_lora_adapters"] == "c"
    assert info.labels["max_lora"] == "3"
    assert info.value > 1.7e9  # when it was read (epoch seconds): the EPP keeps the newest
