"""A router of the tests' own that picks a Corral host per request as llm-d's endpoint picker
(EPP) does, from the EPP configuration the recipe ships (deploy/epp/epp-config.yaml): it scrapes
each host's /metrics, reads the figures the `core-metrics-extractor` reads (by the names in the
config's `engineConfigs`), scores each host with the documented scorers at the config's weights
and takes the best (`max-score-picker`: ties broken at random). The EPP is a Go program that
cannot be built here; this applies its documented rules, in llm-d-router's
pkg/epp/framework/plugins/scheduling/scorer: `lora-affinity-scorer` (1.0 where the model is
active, 0.8 where active plus waiting models are fewer than `max_lora`, 0.6 where it waits, else
0), `queue-scorer` (waiting requests, min-max normalized: the shortest queue 1, the longest 0,
all equal 1) and `kv-cache-utilization-scorer` (1 - KV use). Round-robin is the baseline."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.netns import Hosts
from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL

EPP_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "epp" / "epp-config.yaml"
SCRAPE_S = 0.05  # the EPP's default metrics refresh interval: its figures are this stale
PORT = 8080


@dataclass(frozen=True)
class Names:
    """The metric names an engine config maps (core-metrics-extractor's engineConfigs)."""

    queued: str
    running: str
    kv_usage: str
    lora: str


@dataclass(frozen=True)
class HostMetrics:
    """What the extractor keeps of one scrape: the endpoint's attributes the scorers read."""

    waiting: int
    running: int
    kv_usage: float
    active: frozenset[str]
    waiting_models: frozenset[str]
    max_models: int


@dataclass(frozen=True)
class PickerConfig:
    weights: dict[str, float]  # scorer type: weight, in the default scheduling profile
    names: Names

    @classmethod
    def load(cls, path: Path = EPP_CONFIG) -> PickerConfig:
        """The default profile's scorers and weights and the default engine's metric names;
        a scorer this router does not know is an error (the recipe and the router must move
        together)."""
        doc = yaml.safe_load(path.read_text())
        types = {p.get("name", p["type"]): p["type"] for p in doc["plugins"]}
        (profile,) = [p for p in doc["schedulingProfiles"] if p["name"] == "default"]
        weights: dict[str, float] = {}
        for ref in profile["plugins"]:
            kind = types[ref["pluginRef"]]
            if kind.endswith("-picker"):
                assert kind == "max-score-picker", f"{path}: picker {kind} is not modelled"
                continue
            assert kind in SCORERS, f"{path}: scorer {kind} is not modelled here"
            weights[kind] = float(ref.get("weight", 1))
        (extractor,) = [p for p in doc["plugins"] if p["type"] == "core-metrics-extractor"]
        params = extractor["parameters"]
        (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
        names = Names(
            engine["queuedRequestsSpec"],
            engine["runningRequestsSpec"],
            engine["kvUsageSpec"],
            engine["loraSpec"],
        )
        return cls(weights, names)


def _models(value: str) -> frozenset[str]:
    """A comma-separated adapter list, as the extractor splits it (spaces trimmed)."""
    return frozenset(s.strip() for s in value.split(",") if s.strip())


def read_metrics(text: str, names: Names) -> HostMetrics:
    """One host's exposition, parsed by prometheus-client's parser; a missing gauge is an
    error (the extractor counts it as one)."""
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    lora = samples[names.lora].labels
    return HostMetrics(
        waiting=int(samples[names.queued].value),
        running=int(samples[names.running].value),
        kv_usage=float(samples[names.kv_usage].value),
        active=_models(lora["running_lora_adapters"]),
        waiting_models=_models(lora["waiting_lora_adapters"]),
        max_models=int(lora["max_lora"]),
    )


def lora_affinity(model: str, hosts: list[HostMetrics]) -> list[float]:
    out = []
    for m in hosts:
        if model in m.active:
            out.append(1.0)
        elif len(m.active) + len(m.waiting_models) < m.max_models:
            out.append(0.8)
        elif model in m.waiting_models:
            out.append(0.6)
        else:
            out.append(0.0)
    return out


def queue(_: str, hosts: list[HostMetrics]) -> list[float]:
    lo, hi = min(m.waiting for m in hosts), max(m.waiting for m in hosts)
    return [1.0 if hi == lo else (hi - m.waiting) / (hi - lo) for m in hosts]


def kv_cache(_: str, hosts: list[HostMetrics]) -> list[float]:
    return [1.0 - m.kv_usage for m in hosts]


SCORERS: dict[str, Callable[[str, list[HostMetrics]], list[float]]] = {
    "lora-affinity-scorer": lora_affinity,
    "queue-scorer": queue,
    "kv-cache-utilization-scorer": kv_cache,
}


def pick(
    model: str, hosts: list[HostMetrics], weights: dict[str, float], rng: random.Random
) -> int:
    """The index of the host the EPP sends a request for `model` to."""
    total = [0.0] * len(hosts)
    for kind, w in weights.items():
        for i, s in enumerate(SCORERS[kind](model, hosts)):
            total[i] += w * s
    best = max(total)
    return rng.choice([i for i, t in enumerate(total) if abs(t - best) < 1e-9])


@dataclass
class Routed:
    """One request: its model, the host it went to, its latency (arrival to answer), error."""

    model: str
    host: int
    latency_s: float
    error: str | None = None


@dataclass
class Router:
    """Sends each request to the host `mode` picks: "epp" (the config's scorers, on figures at
    most `SCRAPE_S` old) or "round-robin"."""

    urls: list[str]
    mode: str
    config: PickerConfig = field(default_factory=PickerConfig.load)
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next = 0
        self._scraped_at = -1.0
        self._metrics: list[HostMetrics] = []

    async def _scrape(self, client: httpx.AsyncClient) -> list[HostMetrics]:
        if time.monotonic() - self._scraped_at > SCRAPE_S:
            texts = await asyncio.gather(*(client.get(f"{u}/metrics") for u in self.urls))
            self._metrics = [read_metrics(r.text, self.config.names) for r in texts]
            self._scraped_at = time.monotonic()
        return self._metrics

    async def choose(self, client: httpx.AsyncClient, model: str) -> int:
        if self.mode == "round-robin":
            self._next = (self._next + 1) % len(self.urls)
            return self._next
        return pick(model, await self._scrape(client), self.config.weights, self._rng)

    async def send(self, client: httpx.AsyncClient, model: str, max_tokens: int) -> Routed:
        start = time.monotonic()
        host = await self.choose(client, model)
        body = {"model": model, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
        try:
            r = await client.post(f"{self.urls[host]}/v1/chat/completions", json=body)
            error = None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            error = repr(exc)
        return Routed(model, host, time.monotonic() - start, error)


def trace(models: list[str], n: int, rate_per_s: float, seed: int) -> list[tuple[float, str]]:
    """`n` requests, Poisson arrivals at `rate_per_s`, each for one of `models` at random."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append((t, rng.choice(models)))
    return out


async def replay(router: Router, lines: list[tuple[float, str]], max_tokens: int) -> list[Routed]:
    """Each line sent at its time through `router`; the answers in the lines' order. A new
    connection per request: a kept one that a host closes as idle just as a request is sent
    on it fails that request (a `ReadError`, on a busy machine), which a client that retries
    (as the official ones do) rides out and this one would count as the host's error."""
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=no_reuse) as client:
        t0 = time.monotonic()

        async def at(t: float, model: str) -> Routed:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            return await router.send(client, model, max_tokens)

        return list(await asyncio.gather(*(at(t, m) for t, m in lines)))


def host_config(models: list[str], load_s: float, tokens_per_s: float) -> str:
    """One Corral host: `models`, sim backends, one device that holds one model at a time."""
    sim = f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}}"
    return (
        "models:\n"
        + "".join(
            f"  {m}:\n    load_s: {load_s}\n    concurrency: 4\n    memory_gb: 20\n"
            f"    cmd: {sim} --load-s {load_s} --tokens-per-s {tokens_per_s} --parallel 4\n"
            for m in models
        )
        + "devices:\n  - {name: gpu0, memory_gb: 24}\n"
    )


@contextlib.contextmanager
def corral_hosts(folder: Path, config: str, n: int) -> Iterator[tuple[Hosts, list[str]]]:
    """`n` standalone `corral serve` hosts (each its own SQLite store, as pods behind the EPP
    are), one per network namespace; their URLs."""
    hosts = Hosts(n)
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for i in range(n):
            home = folder / f"host{i}"
            home.mkdir(parents=True)
            (home / "corral.yaml").write_text(
                config + f"server:\n  log_dir: {home / 'logs'}\n  data_dir: {home / 'data'}\n"
            )
            listen = f"{hosts.address(i)}:{PORT}"
            procs.append(
                hosts.popen(
                    i,
                    [CORRAL, "serve", "--config", str(home / "corral.yaml"), "--listen", listen],
                    stderr=(home / "stderr.log").open("w"),
                )
            )
            urls.append(f"http://{listen}")
        for url in urls:
            wait_http_ok(f"{url}/health", timeout_s=60)
        yield hosts, urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        hosts.close()


def loads(urls: list[str]) -> list[int]:
    """Loads started on each host (its `corral_swaps_total`, every model)."""
    out = []
    for u in urls:
        text = httpx.get(f"{u}/metrics", timeout=10).text
        out.append(
            round(
                sum(
                    s.value
                    for fam in text_string_to_metric_families(text)
                    for s in fam.samples
                    if s.name == "corral_swaps_total"
                )
            )
        )
    return out


def run(
    folder: Path, mode: str, lines: list[tuple[float, str]], *, load_s: float,
    tokens_per_s: float, max_tokens: int, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Three fresh hosts, the trace through the router in `mode`: loads, latencies, where
    each request went."""
    models = sorted({m for _, m in lines})
    with corral_hosts(folder / mode, host_config(models, load_s, tokens_per_s), 3) as (_, urls):
        routed = asyncio.run(replay(Router(urls, mode, seed=seed), lines, max_tokens))
        per_host = loads(urls)
    ok = [r for r in routed if r.error is None]
    lat = sorted(r.latency_s for r in ok)
    return {
        "mode": mode,
        "requests": len(routed),
        "errors": [r.error for r in routed if r.error is not None],
        "loads": sum(per_host),
        "loads_per_host": per_host,
        "mean_latency_s": sum(lat) / len(lat) if lat else float("nan"),
        "p95_latency_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan"),
        "hosts_per_model": {m: sorted({r.host for r in routed if r.model == m}) for m in models},
        "routed": routed,
    }
