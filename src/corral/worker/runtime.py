"""The worker: drains a `Store` in the order the scheduler core decides.

It runs the real `Scheduler` and implements its `Effects`. Every task the store could hand out
now is mirrored into the scheduler as a proxy `Request` of its model and level (service class and
priority), refreshed
every `poll_s`. When the scheduler dispatches proxies, the worker claims that many tasks of that
model in one call (several workers may share a database: the claim is the atomic step, and a
proxy that finds nothing left simply ends). Loads and unloads run the models' in-process hooks.

One asyncio task owns the scheduler. Effects only schedule work, and outcomes come back as
scheduler events from the same loop, so nothing re-enters and no lock is needed. Store calls run
in threads so a busy database never stalls the loop.

Execution is at least once, commit exactly once (the store's fencing): a handler may run again
after a crash, so make handlers idempotent or tolerant of a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from corral.config import Config
from corral.core import Request, RequestState, Scheduler
from corral.errors import CorralError
from corral.limits import PRESENCE_S
from corral.store import Level, Store, Task, TaskStatus
from corral.worker import batching, isolate
from corral.worker.heartbeats import Heartbeats
from corral.worker.registry import Fail, Handler, HandlerSpec, Registry, TaskContext, _current
from corral.worker.split import run_split, run_split_async

log = logging.getLogger("corral.worker")


@dataclass(frozen=True)
class WorkerSettings:
    lease_s: float = 30.0  # a claimed task is reclaimable this long after the last heartbeat
    poll_s: float = 0.2  # how often the worker looks for new work ...
    # ... where the store wakes it on work from other processes (PostgreSQL's LISTEN/NOTIFY):
    # then polling is only the safety net (and its own retries set a timer for when they are due)
    idle_poll_s: float = 2.0
    retry_base_s: float = 1.0  # backoff after the n-th failed attempt: base * 2**(n-1) ...
    retry_max_s: float = 300.0  # ... capped here
    shutdown_timeout_s: float = 30.0  # on stop, running tasks get this long, then go back
    load_retry_s: float = 30.0  # a model whose load failed is not tried again for this long
    # Claim up to `prefetch` more of the resident model's tasks per claim, enough for about
    # `prefetch_s` of work at the scheduler's measured service time: fewer round trips for short
    # tasks, none for long ones (so a new higher-priority task never waits behind a long buffer).
    # Tasks claimed ahead are reserved, not started: a killed worker burns no attempts on them.
    prefetch: int = 32
    prefetch_s: float = 0.1


class _Proxy(Request):
    """A scheduler request standing for 'one claimable task of this model and level'."""

    __slots__ = ()

    @property
    def key(self) -> tuple[str, Level]:
        return (self.model, (not self.batch, self.priority))


class _Ahead:
    """A task claimed ahead. `state`: reserved -> starting (a commit is writing its start
    mark) -> started; only reserved and started ones may be taken to run."""

    __slots__ = ("claimed_at", "drop", "state", "task")

    def __init__(self, task: Task, claimed_at: float) -> None:
        self.task = task
        self.claimed_at = claimed_at
        self.state = "reserved"
        self.drop = False  # evicted while starting: the commit releases it once started


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
        # scheduler sees one proxy per slot, so its service estimate is a batch's cost.
        self._slot = {m: registry.batch_of(m) for m in self.models}
        self._arrived = asyncio.Event()  # the store says tasks may have arrived
        self.loads: list[tuple[str, tuple[str, ...]]] = []  # (model, evicted), in order
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._pending: dict[tuple[str, Level], list[_Proxy]] = defaultdict(list)
        self._unclaimed: dict[str, int] = defaultdict(int)  # dispatched, claim not back yet
        self._to_claim: dict[str, list[_Proxy]] = defaultdict(list)
        self._ahead: dict[str, deque[_Ahead]] = defaultdict(deque)  # claimed, not yet run
        self._ahead_lock = threading.Lock()  # commits (in threads) mark the next one started
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cooldown_until: dict[str, float] = {}
        self._busy: set[asyncio.Task[None]] = set()
        self._device_lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._moving: dict[str, int] = defaultdict(int)  # claims/releases under way
        self._moved: dict[str, int] = defaultdict(int)  # ... and finished
        self._stale: set[str] = set()  # models whose last reconcile was skipped
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scheduler: Scheduler | None = None
        self._attached = False
        self._beats: Heartbeats  # set by `run`
        # Models with queued tasks no live worker serves, with how many (updated each lease/2).
        self.unserved: dict[str, int] = {}

    # --- sharing a scheduler ------------------------------------------------------------------
    def attach(self, scheduler: Scheduler) -> None:
        """Drain the store through `scheduler`, which another adapter owns (`corral serve`: its
        interactive requests and the batch lines share one scheduler and one device). That
        adapter does the loads; it passes on the effects for this worker's requests (`owns`):
        `dispatch` and `reject`, and calls `evicted` for each model it evicts or unloads."""
        self.scheduler = scheduler
        self._attached = True

    @staticmethod
    def owns(request: Request) -> bool:
        return isinstance(request, _Proxy)

    def evicted(self, model: str) -> None:
        """`model` left the device: tasks claimed ahead for it go back to the queue."""
        self._spawn(self._release_ahead(model))

    # --- Effects ------------------------------------------------------------------------------
    def load(self, model: str, device: str, evict: Sequence[str]) -> None:
        self.loads.append((model, tuple(evict)))
        for name in evict:
            self.evicted(name)
        self._spawn(self._swap(model, device, tuple(evict)))

    def unload(self, model: str, device: str) -> None:
        self.evicted(model)
        self._spawn(self._unload(model, device))

    def dispatch(self, request: Request) -> None:
        assert isinstance(request, _Proxy)
        self._pending[request.key].remove(request)
        self._unclaimed[request.model] += 1
        batch = self._to_claim[request.model]
        batch.append(request)
        if len(batch) == 1:  # claim every proxy dispatched in this turn of the loop at once
            self._loop_().call_soon(self._flush_claims, request.model)

    def reject(self, request: Request, reason: str) -> None:
        # Proxies are rejected when their model failed to load: the tasks stay queued; the
        # model rests before the next try so a broken model cannot spin.
        if isinstance(request, _Proxy):
            key = request.key
            if request in self._pending[key]:
                self._pending[key].remove(request)
            self._cooldown_until[request.model] = time.monotonic() + self.settings.load_retry_s
            log.warning("model %s: %s", request.model, reason)

    def set_timer(self, at_s: float, key: str) -> None:
        loop = self._loop_()
        sched = self._sched()
        loop.call_at(at_s, sched.on_timer, key)

    # --- running ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop claiming; running tasks get `shutdown_timeout_s` to finish, then go back."""
        self._stop.set()
        self._wake.set()

    async def run(self, until_idle: bool = False) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if not self._attached:
            self.scheduler = Scheduler(self.config, self, self._loop.time)

        def wake() -> None:  # called from the store's threads
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to wake
                loop.call_soon_threadsafe(self._woken)

        unsubscribe = self.store.subscribe(wake)
        self._beats = Heartbeats(self.store, self.settings.lease_s, loop)
        poll_s = (
            self.settings.idle_poll_s if self.store.wakes_other_processes else self.settings.poll_s
        )
        next_reclaim = 0.0
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the scan: a wake-up during it is not lost
                now = time.monotonic()
                if now >= next_reclaim:
                    await asyncio.to_thread(self.store.reclaim_expired)
                    self._report_unserved(await asyncio.to_thread(self._presence))
                    next_reclaim = now + self.settings.lease_s / 2
                scan_started = time.monotonic()
                seen = self._moves_seen()
                ready, scan_s = await asyncio.to_thread(self._timed_ready_counts)
                self._reconcile(ready, seen)
                if until_idle and self._idle(ready) and await self._drained():
                    self._report_unserved(await asyncio.to_thread(self._presence))
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(poll_s, next_reclaim - now))
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
                    await asyncio.to_thread(self.store.worker_gone, self.worker_id)

    def _woken(self) -> None:
        self._wake.set()
        self._arrived.set()

    def _presence(self) -> dict[str, int]:
        """Say this worker is alive (in a thread); returns the models with queued tasks that no
        live worker serves, with how many."""
        self.store.worker_seen(self.worker_id, self.models)
        window_s = max(PRESENCE_S, 2 * self.settings.lease_s)
        live = self.store.workers(time.time() - window_s)
        served = set(self.models).union(*live.values())
        counts = self.store.counts()
        return {
            m: c[TaskStatus.QUEUED]
            for m, c in sorted(counts.items())
            if c.get(TaskStatus.QUEUED) and m not in served
        }

    def _report_unserved(self, unserved: dict[str, int]) -> None:
        """Log each model that nobody serves once (again if it was served meanwhile)."""
        for model, n in unserved.items():
            if model not in self.unserved:
                log.warning(
                    "%d task(s) queued for model %r, which no running worker serves (this one "
                    "serves %s): they wait until a worker with a handler for %r runs",
                    n,
                    model,
                    ", ".join(self.models) or "nothing",
                    model,
                )
        self.unserved = unserved

    def _timed_ready_counts(self) -> tuple[dict[str, dict[Level, int]], float]:
        """The store's ready counts and the seconds the store took: timed inside the thread, so
        the wait for a free thread on a busy machine does not count as the scan's cost."""
        started = time.monotonic()
        ready = self.store.ready_counts()
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
            and not any(self._ahead.values())
            and not (any(not t.done() for t in self._busy))
        )

    async def _drained(self) -> bool:
        """Nothing of my models is queued (due or not, e.g. a retry) or running anywhere."""
        counts = await asyncio.to_thread(self.store.counts)
        live = (TaskStatus.QUEUED, TaskStatus.RUNNING)
        return not any(counts.get(m, {}).get(s, 0) for m in self.models for s in live)

    def _moves_seen(self) -> dict[str, int | None]:
        """Per model, the count of finished task moves (claims, releases), or None while one is
        under way: taken before reading the store, compared after (see `_reconcile`)."""
        return {m: None if self._moving[m] else self._moved[m] for m in self.models}

    @contextlib.asynccontextmanager
    async def _move(self, model: str) -> AsyncIterator[None]:
        """Around a claim or release: tasks of `model` move between the store's queue and this
        worker, so a store read taken meanwhile would count them twice or not at all."""
        self._moving[model] += 1
        try:
            yield
        finally:
            self._moving[model] -= 1
            self._moved[model] += 1
            if model in self._stale:
                self._stale.discard(model)
                self._wake.set()  # its reconcile was skipped: do it now

    def _reconcile(self, ready: dict[str, dict[Level, int]], seen: dict[str, int | None]) -> None:
        """Make the scheduler's pending proxies match the store's claimable tasks. A model
        whose tasks moved while the store was read is left as it is until the next round (a
        wrong count would make it look idle and swap it out with work left)."""
        sched = self._sched()
        now = time.monotonic()
        wanted: list[tuple[Level, str, int]] = []
        for model in self.models:
            if now < self._cooldown_until.get(model, 0.0):
                continue
            if seen.get(model) is None or seen[model] != self._moved[model] or self._moving[model]:
                self._stale.add(model)
                continue
            # Proxies wanted = tasks waiting for one: queued in the store, plus tasks claimed
            # ahead into the buffer, minus what claims in flight will take (best first).
            waiting = dict(ready.get(model, {}))
            for a in self._ahead[model]:
                waiting[a.task.level] = waiting.get(a.task.level, 0) + 1
            per = self._slot[model][0]  # one proxy per slot of up to `per` tasks
            in_flight = self._unclaimed[model] * per
            for level in sorted(
                set(waiting) | {lv for (m, lv) in self._pending if m == model}, reverse=True
            ):
                target = -(-max(0, waiting.get(level, 0) - in_flight) // per)
                in_flight = max(0, in_flight - waiting.get(level, 0))
                have = self._pending[(model, level)]
                while len(have) > target:
                    sched.on_cancel(have.pop())
                wanted.append((level, model, target))
        # New proxies in level order across models: the scheduler sees every model's
        # interactive work before any batch work (an arrival can start a load at once).
        for level, model, target in sorted(wanted, key=lambda x: x[0], reverse=True):
            have = self._pending[(model, level)]
            while len(have) < target:
                p = _Proxy(None, model, level[1], not level[0])
                have.append(p)
                sched.on_request(p)

    def _flush_claims(self, model: str) -> None:
        proxies, self._to_claim[model] = self._to_claim[model], []
        if proxies:
            self._spawn(self._claim_and_run(model, proxies))

    async def _claim_and_run(self, model: str, proxies: list[_Proxy]) -> None:
        sched = self._sched()
        tasks: list[Task] = []
        per, fill_s = self._slot[model]
        want = len(proxies) * per
        async with self._move(model):
            try:
                tasks = await self._take(model, want)
                # Short, yet tasks are held here: a concurrent claim took them into the buffer,
                # or a commit is writing one's start mark. They are this model's work and the
                # proxies stand for them: take them, or the proxies would end empty and the
                # model look idle with tasks left (and be swapped out, and back).
                deadline = time.monotonic() + 1.0
                while len(tasks) < want and self._holding(model):
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.001)
                    tasks += await self._take(model, want - len(tasks), claim=False)
                if tasks and len(tasks) < want and fill_s > 0:
                    tasks += await self._fill(model, want - len(tasks), fill_s)
            finally:
                self._unclaimed[model] -= len(proxies)
        # Handler calls (each kind's tasks in batches), dealt out to the slots in turn.
        all_calls = batching.calls(tasks, self.registry.handlers)
        slots = [all_calls[i :: len(proxies)] for i in range(min(len(proxies), len(all_calls)))]
        for slot, proxy in zip(slots, proxies, strict=False):
            run = self._spawn(self._run_slot(slot, proxy))
            for call in slot:
                for task in call:
                    self._running[task.id] = run
        for proxy in proxies[len(slots) :]:
            sched.on_request_finished(proxy)  # another worker was faster: nothing to do

    async def _fill(self, model: str, n: int, fill_s: float) -> list[Task]:
        """A batch waits up to `fill_s` after its first task for `n` more: claimed as the store
        announces arrivals (and every 5 ms, for arrivals it does not announce)."""
        got: list[Task] = []
        deadline = time.monotonic() + fill_s
        while len(got) < n and not self._stop.is_set():
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(left_s, 0.005))
            got += await self._take(model, n - len(got))
        return got

    async def _take(self, model: str, n: int, claim: bool = True) -> list[Task]:
        """Up to `n` started tasks of `model`: claimed ahead first, then (if `claim`) claimed
        now, with the next few reserved."""
        if self._stop.is_set():
            return []  # shutting down: start nothing new
        taken: list[_Ahead] = []
        stale: list[_Ahead] = []
        # Run a task claimed ahead only while its lease has plenty left (it gets no heartbeats
        # until it runs); older ones go back.
        fresh_after = time.monotonic() - self.settings.lease_s / 4
        with self._ahead_lock:
            keep: deque[_Ahead] = deque()
            for a in self._ahead[model]:
                if a.state == "starting" or (len(taken) >= n and a.claimed_at >= fresh_after):
                    keep.append(a)
                elif a.claimed_at < fresh_after:
                    stale.append(a)
                else:
                    taken.append(a)
            self._ahead[model] = keep
        for a in stale:
            self._spawn(asyncio.to_thread(self.store.release, a.task.id, a.task.lease_token or ""))
        tasks = [a.task for a in taken if a.state == "started"]
        reserved = [(a.task.id, a.task.lease_token or "") for a in taken if a.state == "reserved"]
        if reserved:
            started = set(await asyncio.to_thread(self.store.start, reserved))
            tasks += [
                _counted(a.task) for a in taken if a.state == "reserved" and a.task.id in started
            ]
        need = n - len(tasks)
        if need and claim:
            got = await asyncio.to_thread(
                self.store.claim,
                model,
                self.worker_id,
                need + self._ahead_wanted(model),
                self.settings.lease_s,
                need,
            )
            tasks += got[:need]
            now = time.monotonic()
            with self._ahead_lock:
                self._ahead[model].extend(_Ahead(t, now) for t in got[need:])
        return tasks

    def _holding(self, model: str) -> bool:
        with self._ahead_lock:
            return bool(self._ahead[model])

    def _ahead_wanted(self, model: str) -> int:
        """How many tasks to claim ahead: about `prefetch_s` of work, at most `prefetch`."""
        record = self._sched().models[model]
        per_s = record.concurrency * self._slot[model][0] / max(record.service_est, 1e-6)
        return max(0, min(self.settings.prefetch, int(self.settings.prefetch_s * per_s)))

    def _next_to_start(self, model: str) -> _Ahead | None:
        """Claim the next reserved task of `model` for a commit to start (called in a thread)."""
        with self._ahead_lock:
            for a in self._ahead[model]:
                if a.state == "reserved":
                    a.state = "starting"
                    return a
        return None

    async def _run_slot(self, calls: list[list[Task]], proxy: _Proxy) -> None:
        """Run one scheduling slot's handler calls in turn (a task, or a batched kind's batch),
        then end its proxy. Tasks waiting behind the first call keep their leases meanwhile."""
        tasks = [t for call in calls for t in call]
        calls = list(calls)
        try:
            if len(calls) > 1:
                me = asyncio.current_task()
                assert me is not None
                for t in tasks:
                    self._beats.add(t, t.lease_token or "", TaskContext(t.id, 0), me, False)
            while calls:
                call = calls.pop(0)
                spec = self.registry.handlers.get(call[0].kind)
                if spec is not None and spec.batch_size > 1:
                    await self._run_batch(spec, call)
                else:
                    await self._run(call[0])
        except asyncio.CancelledError:
            left = [t for call in calls for t in call]  # shutdown: those never began
            await asyncio.shield(asyncio.to_thread(self._release_all, left))
            raise
        finally:
            for t in tasks:
                self._running.pop(t.id, None)
                self._beats.remove(t.id)
            if proxy.state is RequestState.RUNNING:
                self._sched().on_request_finished(proxy)

    def _release_all(self, tasks: list[Task]) -> None:
        for t in tasks:
            self.store.release(t.id, t.lease_token or "")

    async def _run_batch(self, spec: HandlerSpec, tasks: list[Task]) -> None:
        ctxs = [TaskContext(t.id, t.attempts, t.max_attempts, t.model) for t in tasks]
        work = asyncio.ensure_future(self._execute_batch(spec, tasks, ctxs))
        for t, ctx in zip(tasks, ctxs, strict=True):
            # Not "async" for the heartbeats: cancelling one task must not cancel the batch
            # (its result is dropped at the commit instead).
            self._beats.add(t, t.lease_token or "", ctx, work, False)
        try:
            await work
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.to_thread(self._release_all, tasks))
            raise
        finally:
            for t in tasks:
                self._beats.remove(t.id)

    async def _execute_batch(
        self, spec: HandlerSpec, tasks: list[Task], ctxs: list[TaskContext]
    ) -> None:
        payloads = [t.payload for t in tasks]
        reset = _current.set(ctxs[0])
        try:
            if not spec.is_async:
                await asyncio.to_thread(self._execute_batch_sync, spec, tasks, ctxs, payloads)
                return
            try:
                async with asyncio.timeout(spec.timeout_s) as limit:
                    results = await spec.fn(payloads)
                outs = batching.outcomes(results, len(tasks), spec.kind)
            except TimeoutError as exc:
                error = _timed_out(spec) if limit.expired() else exc
                outs = [(None, error)] * len(tasks)
            except Exception as exc:  # the call failed: every task records it, maybe retries
                outs = [(None, exc)] * len(tasks)
        finally:
            _current.reset(reset)
        await asyncio.to_thread(self._commit_all, tasks, ctxs, outs)

    def _execute_batch_sync(
        self, spec: HandlerSpec, tasks: list[Task], ctxs: list[TaskContext], payloads: list[Any]
    ) -> None:
        outs: list[batching.Outcome]
        try:
            if spec.timeout_s is None:
                results = spec.fn(payloads)
            else:  # a context of its own: one task's cancellation must not stop the batch
                first = ctxs[0]
                own = TaskContext(first.task_id, first.attempt, first.max_attempts, first.model)
                results = isolate.run(spec.fn, payloads, own, spec.timeout_s)
            outs = batching.outcomes(results, len(tasks), spec.kind)
        except Exception as exc:  # the call failed: every task records it, maybe retries
            outs = [(None, exc)] * len(tasks)
        self._commit_all(tasks, ctxs, outs)

    def _commit_all(
        self, tasks: list[Task], ctxs: list[TaskContext], outs: list[batching.Outcome]
    ) -> None:
        for task, ctx, (result, error) in zip(tasks, ctxs, outs, strict=True):
            self._commit(task, task.lease_token or "", ctx, result, error)

    async def _run(self, task: Task) -> None:
        ctx = TaskContext(task.id, task.attempts, task.max_attempts, task.model)
        token = task.lease_token or ""
        spec = self.registry.handlers.get(task.kind)
        try:
            if spec is None:
                await asyncio.to_thread(
                    self.store.fail,
                    task.id,
                    token,
                    f"no handler for task kind {task.kind!r} (registered: "
                    f"{', '.join(sorted(self.registry.handlers)) or 'none'})",
                    None,
                )
                return
            fn: Handler = spec.fn
            if spec.split_on_failure:
                inner = spec.fn
                if spec.is_async:

                    async def fn(items: Any) -> Any:
                        return await run_split_async(inner, items)
                else:
                    fn = functools.partial(run_split, inner)  # picklable, for `isolate`

            work = asyncio.ensure_future(self._execute(fn, spec, task, token, ctx))
            self._beats.add(task, token, ctx, work, spec.is_async)
            try:
                await work
            except asyncio.CancelledError:
                # Shutdown ran out of time: give the task back now rather than at lease expiry.
                await asyncio.shield(asyncio.to_thread(self.store.release, task.id, token))
                raise
            finally:
                self._beats.remove(task.id)
        finally:
            self._running.pop(task.id, None)

    async def _execute(
        self, fn: Handler, spec: HandlerSpec, task: Task, token: str, ctx: TaskContext
    ) -> None:
        """Run the handler and commit its outcome: one thread hop for a sync handler (it and
        the commit run in the same thread), the loop then one hop for an async one."""
        reset = _current.set(ctx)  # to_thread copies the context: sync handlers see it too
        try:
            if not spec.is_async:
                await asyncio.to_thread(self._execute_sync, fn, spec, task, token, ctx)
                return
            result: Any = None
            error: BaseException | None = None
            try:
                async with asyncio.timeout(spec.timeout_s) as limit:
                    result = await fn(task.payload)
            except asyncio.CancelledError:
                if not ctx.cancelled:
                    raise  # shutdown, not a cancellation of this task
            except TimeoutError as exc:
                error = _timed_out(spec) if limit.expired() else exc
            except Exception as exc:  # the handler failed: record it, maybe retry
                error = exc
        finally:
            _current.reset(reset)
        await asyncio.to_thread(self._commit, task, token, ctx, result, error)

    def _execute_sync(
        self, fn: Handler, spec: HandlerSpec, task: Task, token: str, ctx: TaskContext
    ) -> None:
        try:
            if spec.timeout_s is None:
                result = fn(task.payload)
            else:  # in a child process, so that it can be stopped
                result = isolate.run(fn, task.payload, ctx, spec.timeout_s)
        except isolate.HandlerCancelled:
            self._commit(task, token, ctx, None, None)  # ctx.cancelled: acknowledged
            return
        except Exception as exc:  # the handler failed: record it, maybe retry
            self._commit(task, token, ctx, None, exc)
            return
        self._commit(task, token, ctx, result, None)

    def _commit(
        self, task: Task, token: str, ctx: TaskContext, result: Any, error: BaseException | None
    ) -> None:
        """Write the outcome (in a worker thread). Fencing makes a lost lease write nothing. The
        same transaction starts the model's next task claimed ahead, so a buffered task's
        attempt counts before its handler runs without a write of its own."""
        store = self.store
        self._beats.remove(task.id)  # before the commit ends the lease (see `remove`)
        nxt = self._next_to_start(task.model)
        then_start = [(nxt.task.id, nxt.task.lease_token or "")] if nxt is not None else []
        try:
            if ctx.cancelled:
                store.acknowledge_cancel(task.id, token, then_start)
            elif error is not None:
                if isinstance(error, Fail):  # the handler says a retry cannot help
                    retry_in_s, message = None, str(error)
                else:
                    retry_in_s, message = self._backoff(task), _describe(error)
                store.fail(task.id, token, message, retry_in_s, then_start)
                if retry_in_s is not None:  # look again when it is due, whatever the poll
                    loop = self._loop_()
                    loop.call_soon_threadsafe(loop.call_later, retry_in_s, self._wake.set)
            else:
                try:
                    committed = store.finish(task.id, token, result, then_start)
                except (TypeError, ValueError) as exc:
                    store.fail(
                        task.id,
                        token,
                        f"the handler's result is not JSON-serialisable: {exc}",
                        None,
                        then_start,
                    )
                    committed = True
                if not committed:
                    log.warning(
                        "task %s: lease lost before commit; its result was dropped", task.id
                    )
        except BaseException:
            if nxt is not None:
                with self._ahead_lock:
                    nxt.state = "reserved"
            raise
        if nxt is not None:
            with self._ahead_lock:
                nxt.task = _counted(nxt.task)
                nxt.state = "started"
            if nxt.drop:
                store.release(nxt.task.id, nxt.task.lease_token or "")

    def _backoff(self, task: Task) -> float | None:
        if task.attempts >= task.max_attempts:
            return None
        return float(
            min(self.settings.retry_base_s * 2 ** (task.attempts - 1), self.settings.retry_max_s)
        )

    async def _swap(self, model: str, device: str, evict: tuple[str, ...]) -> None:
        sched = self._sched()
        async with self._device_lock[device]:  # after an unload issued before it
            started = time.monotonic()
            try:
                for name in evict:
                    hooks = self.registry.models.get(name)
                    if hooks is not None and hooks.unload is not None:
                        await _maybe_await(hooks.unload)
                unloaded = time.monotonic()
                hooks = self.registry.models.get(model)
                if hooks is not None and hooks.load is not None:
                    await _maybe_await(hooks.load)
            except Exception as exc:
                sched.on_load_failed(model, _describe(exc))
                return
        sched.on_load_finished(
            model,
            load_s=time.monotonic() - unloaded,
            unload_s=(unloaded - started) if evict else None,
        )

    async def _unload(self, model: str, device: str) -> None:
        async with self._device_lock[device]:
            hooks = self.registry.models.get(model)
            if hooks is not None and hooks.unload is not None:
                try:
                    await _maybe_await(hooks.unload)
                except Exception as exc:  # the model is gone from the schedule either way
                    log.warning("model %s: unload hook failed: %s", model, _describe(exc))

    async def _release_ahead(self, model: str) -> None:
        async with self._move(model):
            with self._ahead_lock:
                gone = [a for a in self._ahead[model] if a.state != "starting"]
                for a in self._ahead[model]:
                    a.drop = a.state == "starting"  # its commit releases it once the mark lands
                self._ahead[model] = deque()
            for a in gone:
                await asyncio.to_thread(self.store.release, a.task.id, a.task.lease_token or "")

    async def _shutdown(self) -> None:
        running = [t for t in self._running.values() if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=self.settings.shutdown_timeout_s)
            for t in late:
                t.cancel()
        for model in list(self._ahead):  # after the running ones: their commits start these
            await self._release_ahead(model)
        busy = [t for t in self._busy if not t.done()]
        if busy:
            await asyncio.wait(busy, timeout=5)

    # --- helpers ------------------------------------------------------------------------------
    def _spawn(self, coro: object) -> asyncio.Task[None]:
        t: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._busy.add(t)
        t.add_done_callback(self._busy.discard)
        return t

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the worker is not running"
        return self._loop

    def _sched(self) -> Scheduler:
        assert self.scheduler is not None, "the worker is not running"
        return self.scheduler


async def _maybe_await(hook: object) -> None:
    import inspect

    if inspect.iscoroutinefunction(hook):
        await hook()
    else:
        await asyncio.to_thread(hook)  # type: ignore[arg-type]


def _counted(task: Task) -> Task:
    """A task claimed ahead, as its start mark left it: the start counted its attempt, which the
    copy read at the claim does not show (the handler's `attempt`, backoff, `last_attempt`)."""
    return dataclasses.replace(task, attempts=task.attempts + 1)


def _timed_out(spec: HandlerSpec) -> isolate.HandlerTimeout:
    return isolate.HandlerTimeout(f"the handler ran past its timeout_s of {spec.timeout_s:g} s")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
