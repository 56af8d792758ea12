"""Prometheus metrics for `corral serve` (`GET /metrics`), in a registry of the app's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corral.access.usage import Usage
from corral.gateway.errors import GatewayError
from corral.gateway.servers.epp import ProtocolMetrics
from corral.machine import GpuWatch
from corral.prompt_cache.blame import CAUSES

# Waits and latencies span milliseconds (a resident model) to minutes (behind a long swap).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _Live(Collector):
    """Gauges read from the scheduler at scrape time, so they are never stale."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._status()
        models = status["models"]
        bound = status.get("wait_bound") or {}
        effective = bound.get("effective_s") or bound.get("configured_s")
        if effective is not None:
            yield GaugeMetricFamily(
                "corral_wait_bound_seconds",
                "The wait bound kept now: max_wait_s, or longer while the load leaves no room "
                "for the switches it would force (stretched).",
                value=effective,
            )
            yield GaugeMetricFamily(
                "corral_wait_bound_stretched",
                "1 while max_wait_s is stretched.",
                value=1 if bound.get("effective_s") is not None else 0,
            )
        queued = GaugeMetricFamily(
            "corral_queue_depth", "Requests waiting for the model.", labels=["model"]
        )
        in_flight = GaugeMetricFamily(
            "corral_in_flight", "Requests the model's server is answering.", labels=["model"]
        )
        loaded = GaugeMetricFamily(
            "corral_model_loaded", "1 while the model is loaded or loading.", labels=["model"]
        )
        asleep = GaugeMetricFamily(
            "corral_model_sleeping", "1 while the model's server sleeps.", labels=["model"]
        )
        for name, m in models.items():
            queued.add_metric([name], m["queued"])
            in_flight.add_metric([name], m["in_flight"])
            loaded.add_metric([name], 0 if m["state"] in ("unloaded", "sleeping") else 1)
            asleep.add_metric([name], 1 if m["state"] == "sleeping" else 0)
        yield queued
        yield in_flight
        yield loaded
        yield asleep
        yield from _prompt_caches(models)
        host = status.get("host") or {}
        if host.get("memory_gb") is not None:
            yield GaugeMetricFamily(
                "corral_host_memory_sleeping_gb",
                "Host memory sleeping models hold.",
                value=host["used_gb"],
            )


# (status key, metric, help, counter?) for each prompt-cache figure of /api/status.
_PROMPT_CACHE = (
    ("states", "corral_prompt_cache_states", "Saved prompt caches on disk.", False),
    ("bytes", "corral_prompt_cache_bytes", "Bytes of saved prompt caches on disk.", False),
    ("saves", "corral_prompt_cache_saves", "Conversations saved before a stop.", True),
    ("restores", "corral_prompt_cache_restores", "Saved conversations restored.", True),
    (
        "restored_tokens",
        "corral_prompt_cache_restored_tokens",
        "Tokens restored instead of processed again.",
        True,
    ),
    ("save_failures", "corral_prompt_cache_save_failures", "Saves that failed.", True),
    ("restore_failures", "corral_prompt_cache_restore_failures", "Restores that failed.", True),
    (
        "no_room",
        "corral_prompt_cache_restores_no_room",
        "Restores put off: the server's KV cache had no room beside its busy slots.",
        True,
    ),
    (
        "not_honoured",
        "corral_prompt_cache_restores_not_honoured",
        "Restores the server reported and then processed the prompt again.",
        True,
    ),
)


def _prompt_caches(models: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The prompt caches' figures, per model that keeps them."""
    keeping = {n: m["prompt_cache"] for n, m in models.items() if m.get("prompt_cache")}
    for key, metric, text, counter in _PROMPT_CACHE:
        family: GaugeMetricFamily | CounterMetricFamily = (
            CounterMetricFamily(metric, text, labels=["model"])
            if counter
            else GaugeMetricFamily(metric, text, labels=["model"])
        )
        for name, figures in keeping.items():
            family.add_metric([name], figures[key])
        yield family
    by_cause = CounterMetricFamily(
        "corral_prompt_cache_restores_not_honoured_by_cause",
        "Restores not reused, by what caused it (other_slot, conversation_changed, "
        "model_state, dropped): only model_state is the model's own.",
        labels=["model", "cause"],
    )
    for name, figures in keeping.items():
        for cause in CAUSES:
            by_cause.add_metric([name, cause], figures.get(f"not_honoured_{cause}", 0))
    yield by_cause


class _Gpus(Collector):
    """Each GPU's memory and utilisation, read through NVML at scrape time."""

    def __init__(self, gpus: GpuWatch) -> None:
        self._gpus = gpus

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["device", "name"]
        total = GaugeMetricFamily(
            "corral_gpu_memory_total_bytes", "The GPU's memory.", labels=labels
        )
        used = GaugeMetricFamily(
            "corral_gpu_memory_used_bytes",
            "The GPU's memory in use (by any process).",
            labels=labels,
        )
        busy = GaugeMetricFamily(
            "corral_gpu_utilization_ratio",
            "The share of NVML's last sample period a kernel ran on the GPU.",
            labels=labels,
        )
        for g in self._gpus.read():
            total.add_metric([g.device, g.model], g.total_bytes)
            used.add_metric([g.device, g.model], g.used_bytes)
            busy.add_metric([g.device, g.model], g.utilization)
        yield total
        yield used
        yield busy


class Metrics:
    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        gpus: GpuWatch | None = None,
        vllm_names: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.swaps = Counter("corral_swaps", "Model loads started.", ["model"], registry=r)
        self.load_seconds = Histogram(
            "corral_load_seconds", "Measured load times.", ["model"], buckets=_SECONDS, registry=r
        )
        self.wakes = Counter(
            "corral_wakes",
            "Loads that woke a sleeping server (of corral_swaps).",
            ["model"],
            registry=r,
        )
        self.aborts = Counter(
            "corral_load_aborts",
            "Loads and wakes stopped because no waiting request needed them any more.",
            ["model"],
            registry=r,
        )
        self.unloads = Counter(
            "corral_unloads",
            "Models unloaded with nothing loaded in their place (ttl_s, the unload API).",
            ["model"],
            registry=r,
        )
        self.crashes = Counter(
            "corral_backend_crashes", "Loaded servers that died.", ["model"], registry=r
        )
        self.wait_seconds = Histogram(
            "corral_request_wait_seconds",
            "Time a request waited for its model (queue and load).",
            ["model"],
            buckets=_SECONDS,
            registry=r,
        )
        self.latency_seconds = Histogram(
            "corral_request_latency_seconds",
            "Time from arrival to the last byte sent.",
            ["model"],
            buckets=_SECONDS,
            registry=r,
        )
        self.retries = Counter(
            "corral_upstream_retries",
            "Requests sent again because the server closed the connection before answering.",
            ["model"],
            registry=r,
        )
        self.stream_errors = Counter(
            "corral_stream_errors",
            "Streamed answers cut short by their server (the client got an error event).",
            ["model"],
            registry=r,
        )
        self.batch_inputs = Histogram(
            "corral_batch_inputs",
            "Inputs per coalesced upstream request (models with `batch:`).",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
            registry=r,
        )
        self.forwarded = Counter(
            "corral_forwarded",
            "Requests sent on to the cluster node that holds their model.",
            ["model"],
            registry=r,
        )
        self.requests = Counter(
            "corral_requests", "Requests by model and HTTP status.", ["model", "status"], registry=r
        )
        self.relay_lost, self.relay_restarts = _relay_counters(r)
        r.register(_Live(status))
        r.register(ProtocolMetrics(status, vllm_names))  # llm-d's endpoint picker reads these
        if gpus is not None:
            r.register(_Gpus(gpus))

    def refused(self, exc: GatewayError) -> None:
        """Count a model request the gateway refused, once, where its refusal is answered: by
        its model where known (a name no model has is not a label: "" instead)."""
        self.requests.labels(exc.model or "", str(exc.status)).inc()


def _relay_counters(r: CollectorRegistry) -> tuple[Counter, Counter]:
    """The relay processes' counters (`corral serve --workers N`): grants lost, restarts."""
    lost = Counter(
        "corral_relay_lost",
        "Granted calls whose relay process ended without reporting their end (it died).",
        ["relay"],
        registry=r,
    )
    restarts = Counter(
        "corral_relay_restarts", "Relay processes started again after one exited.", registry=r
    )
    return lost, restarts


class UsageMetrics(Collector):
    """`/metrics`: the counters of `Usage`, with `principal` and `model` labels."""

    def __init__(self, usage: Usage, principal: str | None = None) -> None:
        """`principal`: its counters only (None: everyone's)."""
        self._usage = usage
        self._principal = principal

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["principal", "model"]
        calls = CounterMetricFamily(
            "corral_principal_requests", "Model calls answered, per principal.", labels=labels
        )
        tokens_in = CounterMetricFamily(
            "corral_principal_input_tokens", "Prompt tokens, per principal.", labels=labels
        )
        tokens_out = CounterMetricFamily(
            "corral_principal_output_tokens", "Generated tokens, per principal.", labels=labels
        )
        waits = CounterMetricFamily(
            "corral_principal_wait_seconds",
            "Seconds its calls waited for their model.",
            labels=labels,
        )
        device = CounterMetricFamily(
            "corral_principal_device_seconds",
            "Device-seconds charged to it by fair shares: its service and the loads it caused.",
            labels=[*labels, "kind"],
        )
        for r in self._usage.totals():
            if self._principal is not None and r.principal != self._principal:
                continue
            who = [r.principal, r.model]
            calls.add_metric(who, r.requests)
            tokens_in.add_metric(who, r.input_tokens)
            tokens_out.add_metric(who, r.output_tokens)
            waits.add_metric(who, r.wait_s)
            device.add_metric([*who, "service"], r.service_s)
            device.add_metric([*who, "load"], r.load_s)
        yield from (calls, tokens_in, tokens_out, waits, device)


def usage_exposition(usage: Usage, principal: str | None) -> bytes:
    """`/metrics`' usage counters in the text format: `principal`'s only (None: everyone's, for
    an admin), so a scrape with a user's key, or none, shows nobody else's use."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(UsageMetrics(usage, principal))
    return generate_latest(registry)
