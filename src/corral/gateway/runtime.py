"""The gateway's side of the scheduler: it implements the core's `Effects` over model server
processes and turns each HTTP request into a scheduler `Request` it can await.

One event loop owns the scheduler; effects only schedule work (a swap task, a future's result),
and outcomes come back as scheduler events on the same loop, so nothing re-enters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from corral.backends.base import Backend
from corral.backends.orphans import DirLock, ServerRecord
from corral.backends.process import BackendError, ProcessBackend, exit_reason
from corral.config import Config, HostConfig, ModelConfig
from corral.core import Request, Scheduler
from corral.gateway.activity import Activity
from corral.gateway.events import Events
from corral.gateway.intake import Intake
from corral.gateway.metrics import Metrics
from corral.gateway.naps import Naps, host_memory_gb
from corral.gateway.servers import process_spec, runs_once, upstream_backend
from corral.gateway.swaps import Holder, Load, Swap
from corral.machine import watch
from corral.secrets import Redactor

log = logging.getLogger("corral.gateway")


class Gateway:
    """Backends, the scheduler, and the requests waiting for a model. `start()` inside the
    serving loop, `close()` to stop every backend."""

    def __init__(self, config: Config, log_dir: Path) -> None:
        self.config = config
        # Masks the config's secrets in what the HTTP side shows (status, /running, logs).
        self.redact = Redactor.of(config)
        self.log_dir = log_dir
        # The model's server; a second copy (a replica on another device) gets a server of its
        # own (`_copy_backend`). `_on` maps (model, device) to the server running there.
        self.backends: dict[str, Backend] = {}
        self._on: dict[tuple[str, str], Backend] = {}
        self._spares: dict[tuple[str, str], ProcessBackend] = {}
        self._devices = {d.name: d for d in config.devices}
        self.naps = Naps()  # the servers asleep, and how each model sleeps (gateway/naps.py)
        # The servers this gateway runs, so the next one stops them if this one is killed.
        self.servers = ServerRecord(log_dir / "servers.pids")
        self.lock = DirLock(log_dir / "gateway.lock")
        for name, m in config.models.items():
            self.add_backend(name, m)
        self.crashes: dict[str, int] = {}
        self.activity = Activity()  # the recent requests (the dashboard's activity view)
        self.gpus = watch()  # NVML's GPUs, for /metrics and the dashboard (None without)
        self.metrics = Metrics(self.status, self.gpus)
        self.events = Events()  # GET /api/events (gateway/events.py)
        self.publish = self.events.publish
        self.scheduler: Scheduler | None = None
        self._stretch_seen: float | None = None  # the stretch last logged (its start)
        self._loop: asyncio.AbstractEventLoop | None = None
        # The clients' requests waiting for their turn (gateway/intake.py).
        self.intake = Intake(self._sched, self._loop_)
        self._busy: set[asyncio.Task[Any]] = set()
        self._device_lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._ops: dict[str, asyncio.Task[Any]] = {}  # the latest load or unload per model
        self._loads: dict[tuple[str, str], Load] = {}  # the loads under way, to abort
        # A model's own server whose stop waits for its device: it starts again after (`load`).
        self._stopping: dict[str, asyncio.Future[None]] = {}
        self._holder: Holder | None = None  # the batch worker: hears what this node holds
        self.dispatched: dict[str, int] = defaultdict(int)  # requests started, per model
        self.dispatched_on: dict[tuple[str, str], int] = defaultdict(int)  # ... and device
        self.swaps: deque[Swap] = deque(maxlen=100)
        self.swap_count = 0
        self.started_at = time.time()
        # This node's name in a cluster (gateway/cluster.py), and its batch worker's.
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    # --- lifecycle ----------------------------------------------------------------------------
    def claim(self) -> None:
        """Make the log folder this gateway's (idempotent). CorralError if another gateway
        runs on it: reaping its record would stop that gateway's live servers."""
        self.lock.acquire("corral serve")

    def start(self) -> None:
        self.claim()
        reaped = self.servers.reap()
        if reaped:
            log.warning(
                "stopped %d model server(s) a previous run left behind (pids %s)",
                len(reaped),
                ", ".join(map(str, reaped)),
            )
        self._loop = asyncio.get_running_loop()
        config = self.config
        if config.host.memory_gb is None and any(m.sleep for m in config.models.values()):
            # Sleeping models hold host memory: bounded by the machine's, less a margin.
            host = HostConfig(memory_gb=max(host_memory_gb(), 0.001))
            config = config.model_copy(update={"host": host})
            log.info("sleeping models may hold %.1f GB of host memory", host.memory_gb)
        self.scheduler = Scheduler(config, self, self._loop.time, replicas=self.copyable())

    def copyable(self) -> list[str]:
        """Models that may run twice at once (a replica): started servers whose port Corral
        picks (`${PORT}` in `proxy`). An upstream, or a server on a fixed port, runs once."""
        return [name for name, b in self.backends.items() if not runs_once(b)]

    async def close(self) -> None:
        for t in list(self._busy):
            t.cancel()
        every = [
            *self.backends.values(),
            *self._spares.values(),
            *self._on.values(),
            *self.naps.servers(),
        ]
        for b in dict.fromkeys(every):  # a server whose model changed runs until it unloads
            with contextlib.suppress(BackendError):
                await b.stop()
        await self.naps.close()
        self.lock.release()

    # --- servers ------------------------------------------------------------------------------
    def backend_on(self, model: str, device: str | None) -> Backend:
        """The server of `model`'s copy on `device` (a dispatched request's `device`)."""
        if device is not None:
            backend = self._on.get((model, device))
            if backend is not None:
                return backend
        return self.backends[model]

    def add_backend(self, name: str, m: ModelConfig) -> None:
        """The server of model `name` as `m` describes it, for its next load (none without
        `cmd` or `upstream`); a copy running now keeps its own until it unloads."""
        self.backends.pop(name, None)
        self.naps.configure(name, m)
        for key in [k for k in self._spares if k[0] == name]:
            del self._spares[key]  # spare copies of the old command
        if m.cmd is not None:
            backend = ProcessBackend(process_spec(name, m), self.log_dir, record=self.servers)
            backend.on_exit = functools.partial(self._exited, name, backend)
            self.backends[name] = backend
        elif m.upstream is not None:
            self.backends[name] = upstream_backend(name, m)

    def copies(self, model: str) -> list[str]:
        """The devices where `model` runs or loads."""
        return [d for (m, d) in self._on if m == model]

    def attach(self, holder: Holder) -> None:
        """`holder` (the batch worker, which shares this scheduler) hears what this node holds
        as it swaps; its requests' outcomes go to their own grant."""
        self._holder = holder

    # --- Effects ------------------------------------------------------------------------------
    def load(
        self,
        model: str,
        device: str,
        evict: Sequence[str],
        sleep: Sequence[str] = (),
        wake: bool = False,
        deep: Sequence[str] = (),
    ) -> None:
        replica = bool(self.copies(model))
        stop = [self._on.pop((name, device), None) for name in evict]
        for name, old in zip(evict, stop, strict=True):
            self._stop_pending(name, old)
        asleep = [self._on.pop((name, device), None) for name in sleep]
        naps = self.naps.fall_asleep(sleep, device, asleep, deep)
        backend, level = self.naps.waking(model, device) if wake else (None, None)
        if backend is None:
            backend = self._free_backend(model, device)
        if backend is not None:
            self._on[model, device] = backend
        if self._holder is not None:  # a model with another copy still runs on this node
            gone = [name for name in (*evict, *sleep) if not self.copies(name)]
            self._holder.loading(model, device, gone, replica=replica)
        load = Load(model, device, backend, tuple(evict), stop, naps, wake, level)
        self._loads[model, device] = load
        op = self._in_turn(device, self._swap_now(load))
        stopping = self._stopping.get(model)
        if stopping is not None and backend is self.backends.get(model):
            # Its one server (a fixed port) is still stopping on another device: start it
            # after. Waited for outside this device's lock, so two devices never wait in a ring.
            op = self._after(stopping, op)
        self._ops[model] = self._spawn(op)

    def unload(self, model: str, device: str) -> None:
        backend = self._on.pop((model, device), None) or self.naps.waking(model, device)[0]
        self._stop_pending(model, backend)
        if self._holder is not None:
            self._holder.gone(model, self.copies(model))
        self._ops[model] = self._spawn(self._unload(model, device, backend))

    def abort(self, model: str, device: str) -> None:
        """The scheduler no longer wants this load or wake: its server is stopped (a start
        under way is cancelled, which kills the process) before the device's next operation."""
        load = self._loads.pop((model, device), None)
        backend = self._on.pop((model, device), None)
        if load is not None:
            load.aborted = True
            if load.task is not None:
                load.task.cancel()
        self._stop_pending(model, backend)
        if self._holder is not None:
            self._holder.gone(model, self.copies(model))
        self.metrics.aborts.labels(model).inc()
        self.publish("load_aborted", model=model, device=device)
        log.info("load of %s on %s aborted: no request waits for it", model, device)

    def _free_backend(self, model: str, device: str) -> Backend | None:
        """A server object for `model` on `device`: the model's own, unless another copy uses
        it or it is still stopping elsewhere (an eviction whose stop waits for its device). A
        server that runs once (a fixed port) is always its own: `load` starts it after its stop."""
        own = self.backends.get(model)
        if (
            not isinstance(own, ProcessBackend)
            or runs_once(own)
            or (not own.running and own not in self._on.values())
        ):
            return own
        return self._copy_backend(model, device)

    def _stop_pending(self, model: str, backend: Backend | None) -> None:
        if backend is not None and backend is self.backends.get(model):
            self._stopping.setdefault(model, self._loop_().create_future())

    def _stopped(self, model: str, backend: Backend) -> None:
        if backend is self.backends.get(model):
            done = self._stopping.pop(model, None)
            if done is not None and not done.done():
                done.set_result(None)

    @staticmethod
    async def _after(first: asyncio.Future[None], op: Coroutine[Any, Any, None]) -> None:
        await asyncio.shield(first)
        await op

    def _copy_backend(self, model: str, device: str) -> ProcessBackend:
        """A server for `model`'s copy on `device` beside its own (kept for the next time)."""
        backend = self._spares.get((model, device))
        if backend is None:
            primary = self.backends[model]
            assert isinstance(primary, ProcessBackend), "only started servers have copies"
            backend = ProcessBackend(primary.spec, self.log_dir, record=self.servers, label=device)
            backend.on_exit = functools.partial(self._exited, model, backend)
            self._spares[model, device] = backend
        return backend

    def _note_stretch(self) -> None:
        """One log line when the wait bound starts stretching and one when it ends."""
        stretch = self._sched().stretch
        if stretch.since == self._stretch_seen:
            return
        self._stretch_seen = stretch.since
        if stretch.since is not None:
            log.warning(
                "max_wait_s %.0f s cannot be kept at this load (its switches would not fit): "
                "stretched to %.0f s until the queues shrink",
                stretch.configured_s,
                stretch.bound_s,
            )
        else:
            log.info("max_wait_s %.0f s holds again", stretch.configured_s)

    def dispatch(self, request: Request) -> None:
        self._note_stretch()
        self.dispatched[request.model] += 1
        self.dispatched_on[request.model, request.device or ""] += 1
        assert request.grant is not None, "a request of corral serve names who hears of it"
        request.grant.granted(request)

    def reject(self, request: Request, reason: str) -> None:
        assert request.grant is not None, "a request of corral serve names who hears of it"
        request.grant.refused(request, reason)

    def set_timer(self, at_s: float, key: str) -> None:
        self._loop_().call_at(at_s, self._sched().on_timer, key)

    # --- swaps --------------------------------------------------------------------------------
    async def settled(self, model: str) -> None:
        """Returns when `model`'s latest load or unload has finished (at once if none runs)."""
        op = self._ops.get(model)
        if op is not None:
            await asyncio.shield(op)

    async def preload(self, models: Sequence[str]) -> None:
        """Load `models` in order at start, each into free room (never evicting another)."""
        sched = self._sched()
        for model in models:
            while (reason := sched.on_load_requested(model, evict=False)) is not None:
                if not any(d.loading is not None for d in sched.devices):
                    log.warning("preload: %s skipped: %s", model, reason)
                    break
                await asyncio.sleep(0.05)  # a swap is under way: it ends soon, then try again
            await self.settled(model)

    async def _unload(self, model: str, device: str, backend: Backend | None) -> None:
        async with self._device_lock[device]:  # after the swaps issued before it
            started = time.monotonic()
            if backend is not None:
                try:
                    with contextlib.suppress(BackendError):
                        await backend.stop()
                finally:
                    self._stopped(model, backend)
            unload_s = time.monotonic() - started
        self.metrics.unloads.labels(model).inc()
        self.publish("unloaded", model=model, unload_s=unload_s)
        log.info("unloaded %s in %.2f s", model, unload_s)

    async def _in_turn(self, device: str, op: Coroutine[Any, Any, None]) -> None:
        """Run `op` once the operations issued before it on `device` have ended."""
        async with self._device_lock[device]:
            await op

    async def _swap_now(self, load: Load) -> None:
        sched = self._sched()
        model, device, backend, evict = load.model, load.device, load.backend, load.evict
        swap = Swap(model, evict, time.time(), slept=tuple(n for n, _, _ in load.naps))
        self.swaps.append(swap)
        self.swap_count += 1
        self.metrics.swaps.labels(model).inc()
        self.publish("load_started", model=model, device=device, evict=list(evict))
        started = time.monotonic()
        try:
            for name, old in zip(evict, load.stop, strict=True):
                if old is not None:
                    try:
                        await old.stop()
                    finally:
                        self._stopped(name, old)
            for name, b, level in load.naps:
                await self.naps.nap(name, b, level)
            swap.unload_s = time.monotonic() - started if evict or load.naps else None
            if load.aborted:
                swap.error = "aborted"
                if backend is not None:
                    self._stopped(model, backend)
                return
            if backend is None:
                raise BackendError(f"model {model}: neither `cmd` nor `upstream` is configured")
            if isinstance(backend, ProcessBackend):
                backend.device_env = self._devices[device].env
            bring_in = self.naps.bring_in(model, backend, load.wake, load.level)
            load.task = asyncio.ensure_future(bring_in)
            try:
                swap.load_s, woke = await load.task
            except asyncio.CancelledError:
                if not load.aborted:
                    raise  # the gateway is closing
            except BackendError:
                if not load.aborted:
                    raise
            if load.aborted:  # cancelled, or aborted between its end and this line
                swap.error = "aborted"
                with contextlib.suppress(BackendError):
                    await backend.stop()  # an upstream's unload, a woken server's stop
                self._stopped(model, backend)
                return
            swap.woke = woke
            if woke:
                self.metrics.wakes.labels(model).inc()
        except BackendError as exc:
            swap.error = str(exc)
            log.error("%s%s", exc, f"\n{exc.log_tail}" if exc.log_tail else "")
            self.publish("load_failed", model=model, device=device, error=str(exc))
            if self._on.get((model, device)) is backend:
                del self._on[model, device]
            if not self.copies(model):
                self._held(model, None)
            self._loads.pop((model, device), None)
            sched.on_load_failed(model, str(exc), device)
            return
        self._loads.pop((model, device), None)
        self.metrics.load_seconds.labels(model).observe(swap.load_s)
        self.publish(
            "loaded",
            model=model,
            device=device,
            load_s=swap.load_s,
            unload_s=swap.unload_s,
            woke=swap.woke,
        )
        how = "woke" if swap.woke else "loaded"
        log.info("%s %s in %.2f s (evicted %s)", how, model, swap.load_s, ", ".join(evict) or "-")
        if len(self.copies(model)) == 1:
            self._held(model, device)
        # A wake that fell back to a cold start measured a load, not a wake: not told.
        measured = swap.load_s if swap.woke == load.wake else None
        sched.on_load_finished(model, load_s=measured, unload_s=swap.unload_s, device=device)

    def _exited(self, model: str, backend: Backend, code: int) -> None:
        """A loaded server died: its in-flight requests fail (502, from the proxy), new ones
        wait, and the scheduler loads it again for them."""
        device = next((d for (m, d), b in self._on.items() if m == model and b is backend), None)
        if device is None:
            return  # not (or no longer) a loaded copy: a failed start says so itself
        self.crashes[model] = self.crashes.get(model, 0) + 1
        self.metrics.crashes.labels(model).inc()
        self.publish("crashed", model=model, device=device, exit_code=code)
        tail = backend.log_tail(8)
        log.error("model %s: its server on %s %s%s", model, device, exit_reason(code), f"\n{tail}")
        del self._on[model, device]
        if not self.copies(model):
            self._held(model, None)
        self._sched().on_model_lost(model, device)

    def _held(self, model: str, device: str | None) -> None:
        """Tell the cluster (through the attached worker) what this node holds."""
        if self._holder is not None:
            self._holder.held(model, device)

    # --- status -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        sched = self._sched()
        now = self._loop_().time()
        epoch = time.time() - now  # loop time -> epoch seconds
        models = {}
        for name, m in sched.models.items():
            backend = (
                self.backend_on(name, m.device.name)
                if m.device is not None
                else self.backends.get(name)
            )
            ttl_s = m.ttl_s
            idle_since = m.idle_since if m.state.value == "ready" else None
            models[name] = {
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
                        "waited_s": round(now - r.arrived_at, 3),
                    }
                    for i, r in enumerate(m.pending(limit=20), 1)
                ],
                "load_s_estimate": round(m.load_est, 3),
                "wake_s_estimate": round(m.wake_est, 3) if m.sleeps else None,
                "pinned": m.spec.pin or m.soft_pin,
                "unload_s_estimate": round(m.unload_est, 3),
                "service_s_estimate": round(m.service_est, 3),
                "proxy": (
                    self.redact(backend.proxy_url)
                    if backend is not None and backend.running
                    else None
                ),
                "pid": backend.pid if backend is not None and backend.running else None,
                "replicas": [  # its second copies, on other devices
                    self._copy_status(name, c.device.name, c.state.value, c.in_flight)
                    for c in m.copies
                    if c.device is not None
                ],
                "aliases": m.spec.aliases,
                "crashes": self.crashes.get(name, 0),
                "dispatched": self.dispatched[name],
                "ttl_s": ttl_s,
                "idle_s": None if idle_since is None else round(now - idle_since, 3),
                "unloads_in_s": (
                    None
                    if idle_since is None or ttl_s is None
                    else round(max(0.0, idle_since + ttl_s - now), 3)
                ),
            }
        interactive = sum(m.asked for m in sched.models.values())
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
            "models": models,
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
                "configured_s": sched.stretch.configured_s,
                "effective_s": sched.stretch.bound_s if sched.stretch.stretched else None,
                "stretched_since": (
                    round(epoch + sched.stretch.since, 3)
                    if sched.stretch.since is not None
                    else None
                ),
            },
            "swaps": self.swap_count,
            "recent_swaps": [vars(s) for s in self.swaps],
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
            "uptime_s": round(time.time() - self.started_at, 3),
            "gpus": [asdict(g) for g in self.gpus.read()] if self.gpus is not None else [],
            "activity": self.activity.recent(),
        }

    def _copy_status(self, model: str, device: str, state: str, in_flight: int) -> dict[str, Any]:
        b = self._on.get((model, device))
        up = b is not None and b.running
        return {
            "device": device,
            "state": state,
            "in_flight": in_flight,
            "dispatched": self.dispatched_on[model, device],
            "proxy": self.redact(b.proxy_url) if up and b is not None else None,
            "pid": b.pid if up and b is not None else None,
        }

    # --- helpers ------------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._busy.add(t)
        t.add_done_callback(self._busy.discard)
        t.add_done_callback(_log_failure)
        return t

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the gateway is not started"
        return self._loop

    def _sched(self) -> Scheduler:
        assert self.scheduler is not None, "the gateway is not started"
        return self.scheduler


def _log_failure(t: asyncio.Task[Any]) -> None:
    """A background operation that raised: a bug in Corral, said at once (not when the task
    is collected, or never)."""
    if not t.cancelled() and t.exception() is not None:
        log.error("gateway: a background operation failed", exc_info=t.exception())
