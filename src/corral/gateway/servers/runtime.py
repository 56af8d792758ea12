"""The gateway's side of the scheduler: it implements the core's `Effects` over model server
processes and turns each HTTP request into a scheduler `Request` it can await.

One event loop owns the scheduler; effects only schedule work (a swap task, a future's result),
and outcomes come back as scheduler events on the same loop, so nothing re-enters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from corral.access.usage import Usage
from corral.backends.base import Backend
from corral.backends.logs import LogLimits
from corral.backends.orphans import DirLock
from corral.backends.process import BackendError, ProcessBackend, exit_reason
from corral.background import Background
from corral.config import Config, HostConfig, ModelConfig
from corral.core import Request, Scheduler
from corral.gateway.servers.activity import Activity
from corral.gateway.servers.events import Events
from corral.gateway.servers.file_cache import LOAD_MODE_ENV, Files
from corral.gateway.servers.fleet import Servers
from corral.gateway.servers.intake import Intake
from corral.gateway.servers.loopwatch import LoopWatch
from corral.gateway.servers.metrics import Metrics
from corral.gateway.servers.naps import Naps, host_memory_gb
from corral.gateway.servers.status import StatusView, Tally
from corral.gateway.servers.swap_records import Holder, Load, Swap
from corral.machine import watch
from corral.modelfiles.engine_memory import EngineFigures, engine_figures_path
from corral.modelfiles.serving import read_state_facts
from corral.prompt_cache.caches import PromptCaches, folder_of
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
        # Which model server runs where (gateway/servers/fleet.py).
        # The prompt caches kept across swaps (prompt_cache/), in a folder Corral owns.
        pc = config.prompt_cache
        self.prompt_caches = PromptCaches(pc, folder_of(pc, log_dir), state_facts=read_state_facts)
        figures = EngineFigures(engine_figures_path(config))
        limits = LogLimits(int(config.server.log_max_mb * (1 << 20)), config.server.log_files)
        self.servers = Servers(log_dir, self._exited, self.prompt_caches, figures, limits)
        self.backends = self.servers.backends  # each model's own server, by name (read only)
        self._devices = {d.name: d for d in config.devices}
        self.naps = (
            Naps()
        )  # the servers asleep, and how each model sleeps (gateway/servers/naps.py)
        self.lock = DirLock(log_dir / "gateway.lock")
        for name, m in config.models.items():
            self.add_backend(name, m)
        self.tally = Tally()  # what it did: requests started, crashes, swaps
        self.activity = Activity()  # the recent requests (the dashboard's activity view)
        self.gpus = watch()  # NVML's GPUs, for /metrics and the dashboard (None without)
        # The models' files in the page cache, measured and prepared (servers/file_cache.py).
        self.files = Files(
            self.backends,
            lambda: self._sched().files,
            lambda: self._loop_().time(),
            config.scheduler.prepare,
        )
        self.status = StatusView(
            config,
            self._sched,
            self._loop_,
            self.servers,
            self.tally,
            self.activity,
            self.gpus,
            self.redact,
            self.files,
        )
        # Who used what: per principal, model and hour (access/usage.py), with the device
        # time the scheduler's fair shares charged each.
        self.usage = Usage(lambda: self.scheduler.shares.ledger if self.scheduler else {})
        self.metrics = Metrics(self.status, self.gpus, config.server.vllm_metric_names)
        self.events = Events()  # GET /api/events (gateway/servers/events.py)
        self.publish = self.events.publish
        self.scheduler: Scheduler | None = None
        self._stretch_seen: float | None = None  # the stretch last logged (its start)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loopwatch: LoopWatch | None = None  # from start(): the loop it watches runs
        # The clients' requests waiting for their turn (gateway/servers/intake.py).
        self.intake = Intake(self._sched, self._loop_)
        self._busy = Background("gateway", log)  # swaps, stops, timers: held until they end
        self._device_lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._ops: dict[str, asyncio.Task[Any]] = {}  # the latest load or unload per model
        self._loads: dict[tuple[str, str], Load] = {}  # the loads under way, to abort
        self._holder: Holder | None = None  # the batch worker: hears what this node holds
        # This node's name in a cluster (gateway/pipeline/cluster.py), and its batch worker's.
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    # --- lifecycle ----------------------------------------------------------------------------
    def claim(self) -> None:
        """Make the log folder this gateway's (idempotent). CorralError if another gateway
        runs on it: reaping its record would stop that gateway's live servers."""
        self.lock.acquire("corral serve")

    def start(self) -> None:
        self.claim()
        reaped = self.servers.record.reap()
        if reaped:
            log.warning(
                "stopped %d model server(s) a previous run left behind (pids %s)",
                len(reaped),
                ", ".join(map(str, reaped)),
            )
        self._loop = asyncio.get_running_loop()
        self.loopwatch = LoopWatch(self._loop, self.metrics.registry)
        self.loopwatch.start()
        config = self.config
        if config.host.memory_gb is None and any(m.sleep for m in config.models.values()):
            # Sleeping models hold host memory: bounded by the machine's, less a margin.
            host = HostConfig(memory_gb=max(host_memory_gb(), 0.001))
            config = config.model_copy(update={"host": host})
            log.info("sleeping models may hold %.1f GB of host memory", host.memory_gb)
        replicas = self.servers.copyable()
        self.scheduler = Scheduler(config, self, self._loop.time, replicas=replicas)
        # A model whose restores prove useless is priced as its whole prefill until a probe's
        # restore is reused.
        self.prompt_caches.on_lost = self.scheduler.conversations.lost
        self.prompt_caches.on_found = self.scheduler.conversations.found
        # Each load is priced by how much of its file the page cache holds.
        self._spawn(self.files.run())

    async def close(self) -> None:
        if self.loopwatch is not None:
            self.loopwatch.stop()
        await self._busy.cancel_and_wait()
        every = [*self.servers.every(), *self.naps.servers()]
        for b in dict.fromkeys(every):  # a server whose model changed runs until it unloads
            with contextlib.suppress(BackendError):
                await b.stop()
        await self.naps.close()
        # The states' index and verdicts on disk (written by a thread) before the folder is
        # free for the next gateway to read them.
        await asyncio.to_thread(self.prompt_caches.written, 10.0)
        self.lock.release()

    # --- servers ------------------------------------------------------------------------------
    def add_backend(self, name: str, m: ModelConfig) -> None:
        """The server of model `name` as `m` describes it, and how it sleeps, for its next
        load; a copy running now keeps its own until it unloads."""
        self.naps.configure(name, m)
        self.servers.add(name, m)

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
        replica = bool(self.servers.copies(model))
        on = self.servers.on
        stop = [on.pop((name, device), None) for name in evict]
        for name, old in zip(evict, stop, strict=True):
            self.servers.stop_pending(name, old)
        asleep = [on.pop((name, device), None) for name in sleep]
        naps = self.naps.fall_asleep(sleep, device, asleep, deep)
        backend, level = self.naps.waking(model, device) if wake else (None, None)
        if backend is None:
            backend = self.servers.free(model, device)
        if backend is not None:
            on[model, device] = backend
        if self._holder is not None:  # a model with another copy still runs on this node
            gone = [name for name in (*evict, *sleep) if not self.servers.copies(name)]
            self._holder.loading(model, device, gone, replica=replica)
        load = Load(model, device, backend, tuple(evict), stop, naps, wake, level)
        self._loads[model, device] = load
        op = self._in_turn(device, self._swap_now(load))
        stopping = self.servers.stopping(model, backend)
        if stopping is not None:
            # Its one server (a fixed port) is still stopping on another device: start it
            # after. Waited for outside this device's lock, so two devices never wait in a ring.
            op = _after(stopping, op)
        self._ops[model] = self._spawn(op)

    def unload(self, model: str, device: str) -> None:
        backend = self.servers.on.pop((model, device), None) or self.naps.waking(model, device)[0]
        self.servers.stop_pending(model, backend)
        if self._holder is not None:
            self._holder.gone(model, self.servers.copies(model))
        self._ops[model] = self._spawn(self._unload(model, device, backend))

    def abort(self, model: str, device: str) -> None:
        """The scheduler no longer wants this load or wake: its server is stopped (a start
        under way is cancelled, which kills the process) before the device's next operation."""
        load = self._loads.pop((model, device), None)
        backend = self.servers.on.pop((model, device), None)
        if load is not None:
            load.aborted = True
            if load.task is not None:
                load.task.cancel()
        self.servers.stop_pending(model, backend)
        if self._holder is not None:
            self._holder.gone(model, self.servers.copies(model))
        self.metrics.aborts.labels(model).inc()
        self.publish("load_aborted", model=model, device=device)
        log.info("load of %s on %s aborted: no request waits for it", model, device)

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
        self.tally.dispatched[request.model] += 1
        self.tally.dispatched_on[request.model, request.device or ""] += 1
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
                    self.servers.stopped(model, backend)
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
        swap.file_cached = self.files.fractions.get(model)  # as the scheduler priced it
        self.tally.swaps.append(swap)
        self.tally.swap_count += 1
        self.metrics.swaps.labels(model).inc()
        self.publish("load_started", model=model, device=device, evict=list(evict))
        started = time.monotonic()
        try:
            for name, old in zip(evict, load.stop, strict=True):
                if old is not None:
                    try:
                        await old.stop()
                    finally:
                        self.servers.stopped(name, old)
            for name, b, level in load.naps:
                await self.naps.nap(name, b, level)
            swap.unload_s = time.monotonic() - started if evict or load.naps else None
            if load.aborted:
                swap.error = "aborted"
                if backend is not None:
                    self.servers.stopped(model, backend)
                return
            if backend is None:
                raise BackendError(f"model {model}: neither `cmd` nor `upstream` is configured")
            if isinstance(backend, ProcessBackend):  # its device's env, and its load mode
                swap.load_mode = None if load.wake else self.files.load_mode(model)
                mode = {LOAD_MODE_ENV: swap.load_mode} if swap.load_mode else {}
                backend.device_env = {**self._devices[device].env, **mode}
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
                self.servers.stopped(model, backend)
                return
            swap.woke = woke
            if woke:
                self.metrics.wakes.labels(model).inc()
        except BackendError as exc:
            swap.error = str(exc)
            log.error("%s%s", exc, f"\n{exc.log_tail}" if exc.log_tail else "")
            self.publish("load_failed", model=model, device=device, error=str(exc))
            if self.servers.on.get((model, device)) is backend:
                del self.servers.on[model, device]
            if not self.servers.copies(model):
                self._held(model, None)
            self._loads.pop((model, device), None)
            sched.on_load_failed(model, str(exc), device)
            return
        self._loads.pop((model, device), None)
        self.metrics.load_seconds.labels(model).observe(swap.load_s)
        self.files.loaded(model)
        self.publish("loaded", model=model, device=device, **swap.figures())
        how = "woke" if swap.woke else "loaded"
        log.info("%s %s in %.2f s (evicted %s)", how, model, swap.load_s, ", ".join(evict) or "-")
        if len(self.servers.copies(model)) == 1:
            self._held(model, device)
        # A wake that fell back to a cold start measured a load, not a wake: not told.
        measured = swap.load_s if swap.woke == load.wake else None
        memory_gb = None if swap.woke else await self._allocated(model, backend)
        sched.on_load_finished(
            model, load_s=measured, unload_s=swap.unload_s, device=device, memory_gb=memory_gb
        )

    async def _allocated(self, model: str, backend: Backend) -> float | None:
        """What `model`'s server just reported it allocated (GB), if it is packed by that."""
        spec = self.config.models.get(model)
        if spec is None:
            return None
        gb = await self.servers.measured_gb(backend, spec)
        packed = spec.memory_gb
        if gb is not None and packed is not None and abs(gb - packed) > 0.05 * packed:
            log.info("model %s: its server allocated %.2f GB; it was packed by %.2f GB",
                     model, gb, packed)  # fmt: skip
        return gb

    def _exited(self, model: str, backend: Backend, code: int) -> None:
        """A loaded server died: its in-flight requests fail (502, from the proxy), new ones
        wait, and the scheduler loads it again for them."""
        on = self.servers.on
        device = next((d for (m, d), b in on.items() if m == model and b is backend), None)
        if device is None:
            return  # not (or no longer) a loaded copy: a failed start says so itself
        self.tally.crashes[model] = self.tally.crashes.get(model, 0) + 1
        self.metrics.crashes.labels(model).inc()
        self.publish("crashed", model=model, device=device, exit_code=code)
        tail = backend.log_tail(8)
        log.error("model %s: its server on %s %s%s", model, device, exit_reason(code), f"\n{tail}")
        del on[model, device]
        if not self.servers.copies(model):
            self._held(model, None)
        self._sched().on_model_lost(model, device)

    def _held(self, model: str, device: str | None) -> None:
        """Tell the cluster (through the attached worker) what this node holds."""
        if self._holder is not None:
            self._holder.held(model, device)

    # --- helpers ------------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._busy.spawn(coro)

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the gateway is not started"
        return self._loop

    def _sched(self) -> Scheduler:
        assert self.scheduler is not None, "the gateway is not started"
        return self.scheduler

    def state_of(self, name: str) -> str | None:
        """Model `name`'s state as listings say it (llama-swap's words in /v1/models, which
        Open WebUI shows; Ollama's /api/tags too): loaded, loading, sleeping, waking or
        unloaded; None before the gateway starts."""
        sched = self.scheduler
        if sched is None or name not in sched.models:
            return None
        state = sched.models[name].state.value
        return "loaded" if state == "ready" else state


async def _after(first: asyncio.Future[None], op: Coroutine[Any, Any, None]) -> None:
    """`op`, once `first` is done (a server's stop, waited for outside any device's lock)."""
    await asyncio.shield(first)
    await op
