"""The worker: drains a `Store` in the order the scheduler core decides.

It runs the real `Scheduler` and implements its `Effects`. Every `poll_s` (or when woken) it
reports what waits to the scheduler (`Scheduler.on_backlog`): per model, the slots of tasks the
store could hand out now and the worker holds, per level (service class and priority); a slot is
one task, a batched kind's batch, or a run of short tasks. The scheduler keeps a request of its
own per slot and decides when a model is idle (core/backlog.py). When it grants requests, the
worker claims their tasks of that model in one call (several workers may share a database: the
claim is the atomic step, and a slot that finds nothing left simply ends): `worker/claims.py`.
`worker/execute.py` runs and commits them. Loads and unloads run the models' in-process hooks.

One asyncio task owns the scheduler. Effects only schedule work, and outcomes come back as
scheduler events from the same loop, so nothing re-enters and no lock is needed. Store calls run
in threads so a busy database never stalls the loop.

Execution is at least once, commit exactly once (the store's fencing): a handler may run again
after a crash, so make handlers idempotent or tolerant of a repeat.
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
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from corral.background import Background
from corral.config import Config
from corral.core import Request, Scheduler
from corral.errors import CorralError
from corral.store import Level, Store, Task, TaskStatus
from corral.worker import batching
from corral.worker.affinity import ModelView
from corral.worker.buffer import ClaimBuffer
from corral.worker.claims import ClaimHooks, Claims
from corral.worker.execute import TRANSIENT, Executor, Hooks, plain
from corral.worker.heartbeats import Heartbeats
from corral.worker.last_words import LastWords, hear_the_dead
from corral.worker.loads import Loads
from corral.worker.moves import Moves
from corral.worker.node import Node
from corral.worker.presence import Presence
from corral.worker.registry import Registry
from corral.worker.residency import Holdings
from corral.worker.settings import WorkerSettings

__all__ = ["Worker", "WorkerSettings"]

log = logging.getLogger("corral.worker")


class Worker:
    """Run with `await worker.run()` (until `stop()`), or `run(until_idle=True)` to drain."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        config: Config,
        settings: WorkerSettings | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.config = config
        self.settings = settings or WorkerSettings()
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        missing = sorted({h.model for h in registry.handlers.values()} - set(config.models))
        if missing:
            uses = ", ".join(
                f"{h.kind!r} -> {h.model!r}"
                for h in registry.handlers.values()
                if h.model in missing
            )
            raise CorralError(
                f"the configuration defines no model {', '.join(map(repr, missing))}, which "
                f"handlers use ({uses}); add it under `models:` or fix the handler's model"
            )
        self.models = [m for m in config.models if m in set(registry.model_names())]
        # Tasks per scheduling slot and how long a slot waits to fill (batched handlers): the
        # scheduler sees one request per slot, so its service estimate is a batch's cost.
        self._slot = {m: registry.batch_of(m) for m in self.models}
        # Models whose handlers are all plain sync functions run their tasks in *runs*: a slot
        # of several tasks run one after another in one thread hop and committed together
        # (group commit), about `prefetch_s` of work each, so that short tasks cost a fraction
        # of a round trip. The run length follows each model's measured task time.
        self._groupable: dict[str, bool] = {}
        for m in self.models:
            specs = [h for h in registry.handlers.values() if h.model == m]
            self._groupable[m] = bool(specs) and all(plain(h) for h in specs)
        self._waiting: dict[str, int] = {}  # tasks waiting per model, at the last reconcile
        self._arrived = asyncio.Event()  # the store says tasks may have arrived
        self.loads: list[tuple[str, tuple[str, ...]]] = []  # (model, evicted), in order
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._unclaimed: dict[str, int] = defaultdict(int)  # granted, claim not back yet
        self._to_claim: dict[str, list[Request]] = defaultdict(list)
        self._buffer = ClaimBuffer()  # claimed, not yet run
        # Tasks in motion between the store and this worker (worker/moves.py).
        self._moves = Moves(
            self.models, lambda model: self._sched().on_backlog_moved(model), self._wake
        )
        self._claims = Claims(
            self.store,
            self.settings,
            self.worker_id,
            self._buffer,
            self._stop,
            self._arrived,
            self._slot,
            self._groupable,
            self._waiting,
            ClaimHooks(self._sched, self._moves.move),
        )
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cooldown_until: dict[str, float] = {}
        self._busy = Background("worker", log)  # claims, commits, swaps: held until they end
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scheduler: Scheduler | None = None
        self._attached = False
        self._beats: Heartbeats  # set by `run`
        self._executor: Executor  # set by `run`
        # Model affinity (worker/affinity.py): what this worker holds, (device, state) per
        # model; the live workers and the models each serves (each lease/2); the table's rows.
        self.residency = Holdings(self.store.members, self.settings, self.worker_id, self.models)
        # What this node holds, told as it swaps (worker/node.py); the gateway tells it too.
        self.node = Node(self.residency, self._claims.release_ahead, self._spawn)
        self._loads = Loads(registry, self.node, self._sched)  # the model hooks (worker/loads.py)
        # Its presence in the store, and the models no live worker serves (worker/presence.py).
        self.presence = Presence(store, self.worker_id, self.models, self.settings, self.residency)

    # --- sharing a scheduler ------------------------------------------------------------------
    def attach(self, scheduler: Scheduler) -> None:
        """Drain the store through `scheduler`, which another adapter owns (`corral serve`: its
        interactive requests and the batch lines share one scheduler and one device). That
        adapter does the loads; it passes the outcome of this worker's requests to their grant
        (this worker: `granted`, `refused`) and tells what it loads and unloads to `node`."""
        self.scheduler = scheduler
        self._attached = True

    def _shown(self, ready: dict[str, dict[Level, int]]) -> set[str]:
        """The models whose waiting tasks this worker's scheduler sees (worker/affinity.py)."""
        sched = self._sched()
        views = {}
        for m in self.models:
            rec = sched.models[m]
            views[m] = ModelView(
                waiting=sum(ready.get(m, {}).values()),
                load_s=rec.est.load_s,
                task_s=rec.est.service_s / max(1, self._claims.per(m)) / max(1, rec.concurrency),
            )
        return self.residency.shown(views)

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
        evict = [*evict, *sleep]  # in-process handlers cannot sleep: they stop
        self.loads.append((model, tuple(evict)))
        self.node.loading(model, device, evict)
        self._spawn(self._loads.swap(model, device, tuple(evict)))

    def unload(self, model: str, device: str) -> None:
        self.node.gone(model)
        self._spawn(self._loads.unload(model, device))

    def abort(self, model: str, device: str) -> None:
        self._loads.abort(model, device)
        self.node.gone(model)
        self._spawn(self._loads.unload(model, device))

    def dispatch(self, request: Request) -> None:
        self.granted(request)

    def reject(self, request: Request, reason: str) -> None:
        self.refused(request, reason)

    def set_timer(self, at_s: float, key: str) -> None:
        loop = self._loop_()
        sched = self._sched()
        loop.call_at(at_s, sched.on_timer, key)

    # --- Grant (the scheduler's requests for this worker's slots, whoever does the effects) ----
    def granted(self, request: Request) -> None:
        self._unclaimed[request.model] += 1
        batch = self._to_claim[request.model]
        batch.append(request)
        if len(batch) == 1:  # claim every request granted in this turn of the loop at once
            self._loop_().call_soon(self._flush_claims, request.model)

    def refused(self, request: Request, reason: str) -> None:
        # Refused when their model failed to load: the tasks stay queued; the model rests
        # before the next try so a broken model cannot spin.
        self._cooldown_until[request.model] = time.monotonic() + self.settings.load_retry_s
        log.warning("model %s: %s", request.model, reason)

    # --- running ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop claiming; running tasks get `shutdown_timeout_s` to finish, then go back."""
        self._stop.set()
        self._wake.set()

    async def run(self, until_idle: bool = False) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if not self._attached:
            # One copy of a model per worker: a worker is a device (in-process load hooks know
            # of no device); a hot model's second copy is another worker's (worker/affinity.py).
            self.scheduler = Scheduler(self.config, self, self._loop.time, replicas=False)

        def wake() -> None:  # called from the store's threads
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to wake
                loop.call_soon_threadsafe(self._woken)

        unsubscribe = self.store.subscribe(wake)
        self._beats = Heartbeats(self.store, self.settings.lease_s, loop)
        self._words = LastWords(self.store, self.worker_id)
        self._executor = Executor(
            self.store,
            self.worker_id,
            self.registry,
            self.settings,
            self._beats,
            self._words,
            self._buffer,
            self._running,
            self._groupable,
            self._stop,
            self._wake,
            Hooks(self._finished, self._loop_, self._claims.per, self._claims.measured),
        )
        poll_s = (
            self.settings.idle_poll_s if self.store.wakes_other_processes else self.settings.poll_s
        )
        next_reclaim = 0.0
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the scan: a wake-up during it is not lost
                now = time.monotonic()
                try:
                    if now >= next_reclaim:
                        # Dead workers' last words first: they say how to count their leases.
                        await asyncio.to_thread(hear_the_dead, self.store)
                        await asyncio.to_thread(self.store.reclaim_expired)
                        if self.settings.retention_s is not None:
                            await asyncio.to_thread(
                                self.store.purge, time.time() - self.settings.retention_s
                            )
                        self.presence.report(await asyncio.to_thread(self.presence.look))
                        if next_reclaim == 0.0 and self.settings.affinity:
                            # Workers started together see each other before the first load.
                            await asyncio.sleep(0.3)
                        next_reclaim = now + self.settings.lease_s / 2
                    scan_started = time.monotonic()
                    seen = self._moves.seen()
                    ready, scan_s = await asyncio.to_thread(self._timed_ready_counts)
                    self._report(ready, seen)
                    if until_idle and self._idle(ready) and await self._drained():
                        self.presence.report(await asyncio.to_thread(self.presence.look))
                        return
                except TRANSIENT as exc:  # the store said so, once; wait and look again
                    log.warning("worker %s waits for the database: %s", self.worker_id, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), poll_s)
                    continue
                # In a cluster, other workers' loads change what this one should do, and
                # nothing announces them: look at the normal poll rate.
                wait_s = self.settings.poll_s if self.residency.clustered() else poll_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(wait_s, next_reclaim - now))
                # The scan is O(queued tasks): however often wake-ups come, it never takes more
                # than a tenth of the time.
                await asyncio.sleep(max(0.0, 9 * scan_s - (time.monotonic() - scan_started)))
        finally:
            unsubscribe()
            try:
                await self._shutdown()
            finally:
                self._beats.stop()
                with contextlib.suppress(Exception):  # a store already gone: it ages out
                    await asyncio.to_thread(self.store.members.worker_gone, self.worker_id)
                self._words.close()

    def _woken(self) -> None:
        self._wake.set()
        self._arrived.set()

    def _timed_ready_counts(self) -> tuple[dict[str, dict[Level, int]], float]:
        """The store's ready counts and the seconds the store took: timed inside the thread, so
        the wait for a free thread on a busy machine does not count as the scan's cost."""
        started = time.monotonic()
        ready = self.store.ready_counts()
        self.residency.read(started)
        return ready, time.monotonic() - started

    def _idle(self, ready: dict[str, dict[Level, int]]) -> bool:
        mine = sum(
            sum(ready.get(m, {}).values())
            for m in self.models
            if time.monotonic() >= self._cooldown_until.get(m, 0.0)
        )
        return (
            mine == 0
            and not self._running
            and not any(self._unclaimed.values())
            and self._buffer.empty()
            and not self._busy.running()
        )

    async def _drained(self) -> bool:
        """Nothing of my models is queued (due or not, e.g. a retry) or running anywhere."""
        counts = await asyncio.to_thread(self.store.counts)
        live = (TaskStatus.QUEUED, TaskStatus.RUNNING)
        return not any(counts.get(m, {}).get(s, 0) for m in self.models for s in live)

    def _report(self, ready: dict[str, dict[Level, int]], seen: dict[str, int | None]) -> None:
        """Tell the scheduler what waits, per model (`Scheduler.on_backlog`): slots per level,
        exactly; or, for a model whose tasks moved while the store was read (its count may be
        off either way), only a bound far above its work."""
        slots: dict[str, Mapping[Level, int] | int] = {}
        shown = self._shown(ready) if self.residency.clustered() else None
        for model in self.models:
            if time.monotonic() < self._cooldown_until.get(model, 0.0):
                continue
            if shown is not None and model not in shown:
                ready = {**ready, model: {}}  # another worker's, or not worth a second copy
            # Tasks waiting for a slot: queued in the store, plus tasks claimed ahead into the
            # buffer, less what claims in flight will take (best first).
            waiting = dict(ready.get(model, {}))
            for level, n in self._buffer.levels(model).items():
                waiting[level] = waiting.get(level, 0) + n
            self._waiting[model] = sum(waiting.values())  # `_per` follows it
            per = self._claims.per(model)  # one slot of up to `per` tasks
            if self._moves.off(model, seen):
                concurrency = self.config.models[model].concurrency
                slots[model] = -(-sum(waiting.values()) // per) + concurrency + 1
                continue
            in_flight = self._unclaimed[model] * per
            targets: dict[Level, int] = {}
            for level in sorted(waiting, reverse=True):
                targets[level] = -(-max(0, waiting[level] - in_flight) // per)
                in_flight = max(0, in_flight - waiting[level])
            slots[model] = targets
        if self._sched().on_backlog(self, slots):
            self._wake.set()  # taken in part, so as not to hold the loop: the rest at once

    def _flush_claims(self, model: str) -> None:
        requests, self._to_claim[model] = self._to_claim[model], []
        if requests:
            self._spawn(self._claim_and_run(model, requests))

    async def _claim_and_run(self, model: str, requests: list[Request]) -> None:
        tasks: list[Task] = []
        per, fill_s = self._claims.per(model), self._slot[model][1]
        want = len(requests) * per
        async with self._moves.move(model):
            try:
                try:
                    tasks = await self._claims.take(model, want)
                except TRANSIENT as exc:  # claimed nothing (a claim is never half-taken)
                    log.warning("model %s: claim failed, will try again: %s", model, exc)
                # Short, yet tasks are held here: a concurrent claim took them into the buffer
                # (or is taking them: claims run side by side on a pooled store), or a commit
                # is writing one's start mark. They are this model's work and the requests
                # stand for them: take them, or the requests would end empty and the model look
                # idle with tasks left (and be swapped out, and back).
                deadline = time.monotonic() + 1.0
                while len(tasks) < want and (
                    self._buffer.holding(model) or self._moves.moving(model) > 1
                ):
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.001)
                    tasks += await self._claims.take(
                        model, want - len(tasks), claim=False, joins=bool(tasks)
                    )
                if tasks and len(tasks) < want and fill_s > 0:
                    with contextlib.suppress(*TRANSIENT):  # run those it has
                        tasks = await self._claims.fill(model, tasks, want - len(tasks), fill_s)
            finally:
                self._unclaimed[model] -= len(requests)
        # Handler calls (each kind's tasks in batches), dealt out to the slots in turn; a model
        # without batched kinds runs each task alone, in claim order (the common, hot path).
        all_calls = (
            batching.calls(tasks, self.registry.handlers)
            if self._slot[model][0] > 1
            else [[t] for t in tasks]
        )
        slots = [all_calls[i :: len(requests)] for i in range(min(len(requests), len(all_calls)))]
        for slot, request in zip(slots, requests, strict=False):
            run = self._spawn(self._executor.run_slot(slot, request))
            for call in slot:
                for task in call:
                    self._running[task.id] = run
        for request in requests[len(slots) :]:
            self._finished(request)  # another worker was faster: nothing to do

    def _finished(self, request: Request) -> None:
        """A slot ended. If the scheduler keeps it taken (its model's count may be off), the
        next report comes now rather than at the next poll."""
        if self._sched().on_request_finished(request):
            self._wake.set()

    async def _shutdown(self) -> None:
        running = [t for t in self._running.values() if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=self.settings.shutdown_timeout_s)
            for t in late:
                t.cancel()
        for model in self._buffer.models():  # after the running ones: their commits start these
            await self._claims.release_ahead(model)
        busy = self._busy.running()
        if busy:
            await asyncio.wait(busy, timeout=5)

    # --- helpers ------------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._busy.spawn(coro)

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the worker is not running"
        return self._loop

    def _sched(self) -> Scheduler:
        assert self.scheduler is not None, "the worker is not running"
        return self.scheduler
