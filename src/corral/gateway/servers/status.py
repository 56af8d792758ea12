"""What `/api/status`, the dashboard, `/metrics` and Ollama's `/api/ps` show of a gateway:
`Tally`, what the gateway did (a part it owns), and `StatusView`, which reads the scheduler, the
servers and the tally into one JSON object."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from corral.config import Config
from corral.core import Scheduler
from corral.core.state import ModelRecord
from corral.gateway.servers.activity import Activity
from corral.gateway.servers.file_cache import Files
from corral.gateway.servers.fleet import Servers
from corral.gateway.servers.swap_records import Swap
from corral.machine import GpuWatch
from corral.secrets import Redactor


class Tally:
    """What the gateway did: requests started per model and device, server crashes, swaps."""

    def __init__(self) -> None:
        self.dispatched: dict[str, int] = defaultdict(int)  # requests started, per model
        self.dispatched_on: dict[tuple[str, str], int] = defaultdict(int)  # ... and device
        self.crashes: dict[str, int] = {}
        self.swaps: deque[Swap] = deque(maxlen=100)
        self.swap_count = 0
        self.started_at = time.time()


class StatusView:
    """`view()`: the gateway's state as `/api/status` answers it (on the serving loop)."""

    def __init__(
        self,
        config: Config,
        scheduler: Callable[[], Scheduler],
        loop: Callable[[], asyncio.AbstractEventLoop],
        servers: Servers,
        tally: Tally,
        activity: Activity,
        gpus: GpuWatch | None,
        redact: Redactor,
        files: Files | None = None,
    ) -> None:
        self.config = config
        self._sched = scheduler
        self._loop = loop
        self.servers = servers
        self.tally = tally
        self.activity = activity
        self.gpus = gpus
        self.files = files
        self.redact = redact

    def __call__(self) -> dict[str, Any]:
        sched = self._sched()
        now = self._loop().time()
        epoch = time.time() - now  # loop time -> epoch seconds
        interactive = sum(m.asked for m in sched.models.values())
        stretch = sched.stretch
        return {
            "policy": self.config.scheduler.policy,
            "queued_by_class": {
                "interactive": interactive,
                "batch": sum(m.count for m in sched.models.values()) - interactive,
            },
            "devices": [
                {
                    "name": d.name,
                    "resident": [m.name for m in d.residents],
                    "memory_gb": d.memory_gb,
                    "used_gb": round(sum(d.size_of(m) for m in d.residents), 3),
                }
                for d in sched.devices
            ],
            "models": {name: self._model(name, m, now) for name, m in sched.models.items()},
            # What a models folder offered that is not served, and why (modelfiles/serving.py).
            "skipped": [{"model": n, "why": w} for n, w in sorted(self.config.skipped.items())],
            # Sleeping models' host memory (docs/design/sleep.md).
            "host": {
                "memory_gb": (
                    None if sched.sleepers.host_gb == float("inf") else sched.sleepers.host_gb
                ),
                "used_gb": round(sched.sleepers.used_gb(), 3),
                "sleeping": [m.name for m in sched.sleepers.all()],
            },
            # The wait bound kept now (core/stretch.py): the configured one, or longer while
            # the load leaves no room for the switches it would force.
            "wait_bound": {
                "configured_s": stretch.configured_s,
                "effective_s": stretch.bound_s if stretch.stretched else None,
                "stretched_since": (
                    round(epoch + stretch.since, 3) if stretch.since is not None else None
                ),
            },
            # The files read into the page cache ahead of their loads (servers/file_cache.py).
            "prepare": self.files.view() if self.files is not None else None,
            "swaps": self.tally.swap_count,
            "recent_swaps": [vars(s) for s in self.tally.swaps],
            "recent_decisions": [
                {
                    "at": round(epoch + d.at_s, 3),
                    "load": d.model,
                    "device": d.device,
                    "evict": list(d.evict),
                    "reason": d.reason,
                }
                for d in list(sched.decisions)[-20:]
            ],
            "uptime_s": round(time.time() - self.tally.started_at, 3),
            "gpus": [asdict(g) for g in self.gpus.read()] if self.gpus is not None else [],
            "activity": self.activity.recent(),
        }

    def _model(self, name: str, m: ModelRecord, now: float) -> dict[str, Any]:
        backend = (
            self.servers.backend_on(name, m.device.name)
            if m.device is not None
            else self.servers.backends.get(name)
        )
        up = backend is not None and backend.running
        ttl_s = m.ttl_s
        idle_since = m.idle_since if m.state.value == "ready" else None
        return {
            "state": m.state.value,
            "device": m.device.name if m.device is not None else None,
            "queued": m.count,
            "queued_by_class": {"interactive": m.asked, "batch": m.count - m.asked},
            "in_flight": m.in_flight,
            "queue": [  # the next requests in the order they will run (first 20)
                {
                    "position": i,
                    "class": "batch" if r.background else "interactive",
                    "priority": r.priority,
                    "principal": r.principal,
                    "waited_s": round(now - r.arrived_at, 3),
                }
                for i, r in enumerate(m.pending(limit=20), 1)
            ],
            "load_s_estimate": round(m.est.load_s, 3),  # now, at the fraction cached
            # Its file in the page cache: the fraction as last measured, and its
            # loads learned apart (warm: cached; cold: read from the disk; None: not yet).
            "file_cached": m.est.cached,
            "warm_load_s_estimate": round(m.est.warm_load_s, 3),
            "cold_load_s_estimate": (
                None if m.est.cold_load_s is None else round(m.est.cold_load_s, 3)
            ),
            "wake_s_estimate": round(m.est.wake_s, 3) if m.sleeps else None,
            "pinned": m.spec.pin or m.soft_pin,
            # The room it is packed by now: after a load, what its server reported, where it
            # is measured (`memory_from_server`).
            "memory_gb": m.memory_gb,
            "concurrency": m.concurrency,
            "unload_s_estimate": round(m.est.unload_s, 3),
            "service_s_estimate": round(m.est.service_s, 3),
            "proxy": self.redact(backend.proxy_url) if up and backend is not None else None,
            "pid": backend.pid if up and backend is not None else None,
            "replicas": [  # its second copies, on other devices
                self._copy(name, c.device.name, c.state.value, c.in_flight)
                for c in m.copies
                if c.device is not None
            ],
            "aliases": m.spec.aliases,
            "crashes": self.tally.crashes.get(name, 0),
            # Saved states and what they saved (prompt_cache/); None: it keeps none.
            "prompt_cache": self.servers.prompt_cache_view(name),
            "dispatched": self.tally.dispatched[name],
            "ttl_s": ttl_s,
            "idle_s": None if idle_since is None else round(now - idle_since, 3),
            "unloads_in_s": (
                None
                if idle_since is None or ttl_s is None
                else round(max(0.0, idle_since + ttl_s - now), 3)
            ),
        }

    def _copy(self, model: str, device: str, state: str, in_flight: int) -> dict[str, Any]:
        b = self.servers.on.get((model, device))
        up = b is not None and b.running
        return {
            "device": device,
            "state": state,
            "in_flight": in_flight,
            "dispatched": self.tally.dispatched_on[model, device],
            "proxy": self.redact(b.proxy_url) if up and b is not None else None,
            "pid": b.pid if up and b is not None else None,
        }


def own_view(status: dict[str, Any], principal: str) -> dict[str, Any]:
    """`status` as a user (`principal`) sees it: the machine's state whole (devices, models,
    counts, swaps and decisions), and of the requests and batches, its own only."""
    out = dict(status)
    out["models"] = {
        name: {**m, "queue": [q for q in m["queue"] if q["principal"] == principal]}
        for name, m in status["models"].items()
    }
    out["activity"] = [a for a in status["activity"] if a["principal"] == principal]
    if "batches" in status:
        out["batches"] = [b for b in status["batches"] if b.get("owner") == principal]
    return out
