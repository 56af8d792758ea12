"""What llm-d's endpoint picker (the Gateway API Inference Extension's EPP) reads of a model
server, in the shape of its model server protocol: the queued and running requests,
a cache-use gauge, and which models the server holds in `lora_requests_info`'s shape, so that
its stock LoRA-affinity scorer prefers the host holding a request's model (1.0 where it is
resident, 0.8 where there is room, 0.6 where it is waiting to load, 0 where it is full).

Each figure is read from `/api/status` at scrape time (never stale). Under Corral's own names
always (`corral_requests_waiting`, `corral_requests_running`, `corral_kv_cache_usage_perc`,
`corral_lora_requests_info`), and under vLLM's too with `server.vllm_metric_names`, the names
the EPP maps by default."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Residency:
    """The models a host holds, by the names clients send: `running` (ready), `waiting`
    (loading or waking, or with queued work and not ready), and `max_models`: how many models
    it can hold at once now, as the scheduler packs them (the resident ones and those of the
    rest that fit in the free room, smallest first), so that fewer running than `max_models`
    means a model can load without evicting one."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_models: int


def _names(name: str, m: dict[str, Any]) -> list[str]:
    return [name, *m.get("aliases", [])]


def residency(status: dict[str, Any]) -> Residency:
    """`/api/status`'s models and devices as the protocol's residency lists."""
    models: dict[str, dict[str, Any]] = status["models"]
    running = [n for name, m in models.items() if m["state"] == "ready" for n in _names(name, m)]
    waiting = [
        n
        for name, m in models.items()
        if m["state"] in ("loading", "waking") or (m["state"] != "ready" and m["queued"])
        for n in _names(name, m)
    ]
    resident = sum(1 for m in models.values() if m["state"] in ("ready", "loading", "waking"))
    return Residency(tuple(running), tuple(waiting), resident + _fit_more(status))


def _fit_more(status: dict[str, Any]) -> int:
    """How many of the models not resident fit in the devices' free room together, smallest
    first, each on the first device with room (a model or device without a size: one model to
    an empty device)."""
    devices = [
        [d["memory_gb"] - d["used_gb"] if d["memory_gb"] is not None else None, not d["resident"]]
        for d in status.get("devices", [])
    ]
    rest = [
        m.get("memory_gb")
        for m in status["models"].values()
        if m["state"] not in ("ready", "loading", "waking")
    ]
    count = 0
    for size in sorted(rest, key=lambda s: float("inf") if s is None else s):
        for d in devices:
            free, empty = d
            if free is None or size is None:
                if empty:
                    d[0], d[1] = (0.0 if free is not None else None), False
                    count += 1
                    break
            elif size <= free + _EPS:
                d[0], d[1] = free - size, False
                count += 1
                break
    return count


def slot_use(status: dict[str, Any]) -> float:
    """The share of the resident models' request slots (their `concurrency`) in use: the
    closest honest figure to a KV cache's use that a host of several servers has (a slot
    holds one sequence's cache); 0 with nothing resident."""
    models = status["models"].values()
    slots = sum(m.get("concurrency", 1) for m in models if m["state"] == "ready")
    running = sum(m["in_flight"] for m in models)
    return min(1.0, running / slots) if slots else 0.0


class ProtocolMetrics(Collector):
    """The protocol's gauges, under Corral's names and, if `vllm`, vLLM's."""

    def __init__(self, status: Callable[[], dict[str, Any]], vllm: bool = False) -> None:
        self._status = status
        self._prefixes = ("corral_", "vllm:") if vllm else ("corral_",)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._status()
        models = status["models"].values()
        held = residency(status)
        lists = {
            "max_lora": str(held.max_models),
            "running_lora_adapters": ",".join(held.running),
            "waiting_lora_adapters": ",".join(held.waiting),
        }
        for p in self._prefixes:
            yield GaugeMetricFamily(
                f"{p}num_requests_waiting" if p == "vllm:" else f"{p}requests_waiting",
                "Requests queued for a model (every model of this host).",
                value=sum(m["queued"] for m in models),
            )
            yield GaugeMetricFamily(
                f"{p}num_requests_running" if p == "vllm:" else f"{p}requests_running",
                "Requests a model's server is answering (every model of this host).",
                value=sum(m["in_flight"] for m in models),
            )
            yield GaugeMetricFamily(
                f"{p}kv_cache_usage_perc",
                "The share of the resident models' request slots in use, 0 to 1 (each slot "
                "holds one sequence's KV cache).",
                value=slot_use(status),
            )
            info = GaugeMetricFamily(
                f"{p}lora_requests_info",
                "The models this host holds, by the names clients send (running: ready; "
                "waiting: loading, or queued and not ready; max_lora: how many it can hold at "
                "once now); the value is when it was read.",
                labels=list(lists),
            )
            info.add_metric(list(lists.values()), time.time())
            yield info
