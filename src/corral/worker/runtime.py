"""The worker: drains a `Store` in the order the scheduler core decides.

It runs the real `Scheduler` and implements its `Effects`. Every task the store could hand out
now is mirrored into the scheduler as a proxy `Request` of its model and priority, refreshed
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
import logging
import os
import socket
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from corral.config import Config
from corral.core import Request, RequestState, Scheduler
from corral.errors import CorralError
from corral.store import Lease, Store, Task, TaskStatus
from corral.worker.registry import Handler, Registry, TaskContext, _current
from corral.worker.split import run_split, run_split_async

log = logging.getLogger("corral.worker")


@dataclass(frozen=True)
class WorkerSettings:
    lease_s: float = 30.0  # a claimed task is reclaimable this long after the last heartbeat
    poll_s: float = 0.2  # how often the worker looks for new work
    retry_base_s: float = 1.0  # backoff after the n-th failed attempt: base * 2**(n-1) ...
    retry_max_s: float = 300.0  # ... capped here
    shutdown_timeout_s: float = 30.0  # on stop, running tasks get this long, then go back
    load_retry_s: float = 30.0  # a model whose load failed is not tried again for this long
    # Claim this many more of the resident model's tasks per claim (fewer round trips: on
    # PostgreSQL 757 -> 1,280 tasks/s). Off by default: a claim counts an attempt, so tasks claimed
    # ahead by a worker that is killed burn an attempt without running; a crash-looping worker
    # can fail them for good.
    prefetch: int = 0


class _Proxy(Request):
    """A scheduler request standing for 'one claimable task of this model and priority'."""

    __slots__ = ()


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
        self.loads: list[tuple[str, tuple[str, ...]]] = []  # (model, evicted), in order
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._pending: dict[tuple[str, int], list[_Proxy]] = defaultdict(list)
        self._unclaimed: dict[str, int] = defaultdict(int)  # dispatched, claim not back yet
        self._to_claim: dict[str, list[_Proxy]] = defaultdict(list)
        self._prefetched: dict[str, deque[Task]] = defaultdict(deque)  # claimed, not started
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cooldown_until: dict[str, float] = {}
        self._busy: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scheduler: Scheduler | None = None

    # --- Effects ------------------------------------------------------------------------------
    def load(self, model: str, device: str, evict: Sequence[str]) -> None:
        self.loads.append((model, tuple(evict)))
        for name in evict:  # tasks claimed ahead for an evicted model go back to the queue
            self._spawn(self._release_prefetched(name))
        self._spawn(self._swap(model, tuple(evict)))

    def dispatch(self, request: Request) -> None:
        assert isinstance(request, _Proxy)
        self._pending[(request.model, request.priority)].remove(request)
        self._unclaimed[request.model] += 1
        batch = self._to_claim[request.model]
        batch.append(request)
        if len(batch) == 1:  # claim every proxy dispatched in this turn of the loop at once
            self._loop_().call_soon(self._flush_claims, request.model)

    def reject(self, request: Request, reason: str) -> None:
        # Proxies are rejected when their model failed to load: the tasks stay queued; the
        # model rests before the next try so a broken model cannot spin.
        if isinstance(request, _Proxy):
            key = (request.model, request.priority)
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
        self._loop = asyncio.get_running_loop()
        self.scheduler = Scheduler(self.config, self, self._loop.time)
        next_reclaim = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_reclaim:
                    await asyncio.to_thread(self.store.reclaim_expired)
                    next_reclaim = now + self.settings.lease_s / 2
                scan_started = time.monotonic()
                ready = await asyncio.to_thread(self.store.ready_counts)
                # The scan is O(queued tasks): never let it take more than a tenth of the time.
                wait_s = max(self.settings.poll_s, 10 * (time.monotonic() - scan_started))
                self._reconcile(ready)
                if until_idle and self._idle(ready) and await self._drained():
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
        finally:
            await self._shutdown()

    def _idle(self, ready: dict[str, dict[int, int]]) -> bool:
        mine = sum(
            sum(ready.get(m, {}).values())
            for m in self.models
            if time.monotonic() >= self._cooldown_until.get(m, 0.0)
        )
        return (
            mine == 0
            and not self._running
            and not any(self._unclaimed.values())
            and not any(self._prefetched.values())
            and not (any(not t.done() for t in self._busy))
        )

    async def _drained(self) -> bool:
        """Nothing of my models is queued (due or not, e.g. a retry) or running anywhere."""
        counts = await asyncio.to_thread(self.store.counts)
        live = (TaskStatus.QUEUED, TaskStatus.RUNNING)
        return not any(counts.get(m, {}).get(s, 0) for m in self.models for s in live)

    def _reconcile(self, ready: dict[str, dict[int, int]]) -> None:
        """Make the scheduler's pending proxies match the store's claimable tasks."""
        sched = self._sched()
        now = time.monotonic()
        for model in self.models:
            if now < self._cooldown_until.get(model, 0.0):
                continue
            # Proxies wanted = tasks waiting for one: queued in the store, plus tasks claimed
            # ahead into the buffer, minus what claims in flight will take (best first).
            waiting = dict(ready.get(model, {}))
            for t in self._prefetched[model]:
                waiting[t.priority] = waiting.get(t.priority, 0) + 1
            in_flight = self._unclaimed[model]
            for prio in sorted(
                set(waiting) | {p for (m, p) in self._pending if m == model}, reverse=True
            ):
                have = self._pending[(model, prio)]
                target = max(0, waiting.get(prio, 0) - in_flight)
                in_flight = max(0, in_flight - waiting.get(prio, 0))
                while len(have) < target:
                    p = _Proxy(None, model, prio)
                    have.append(p)
                    sched.on_request(p)
                while len(have) > target:
                    sched.on_cancel(have.pop())

    def _flush_claims(self, model: str) -> None:
        proxies, self._to_claim[model] = self._to_claim[model], []
        if proxies:
            self._spawn(self._claim_and_run(model, proxies))

    async def _claim_and_run(self, model: str, proxies: list[_Proxy]) -> None:
        sched = self._sched()
        buf = self._prefetched[model]
        tasks: list[Task] = []
        try:
            while buf and len(tasks) < len(proxies):
                tasks.append(buf.popleft())
            need = len(proxies) - len(tasks)
            if need and not self._stop.is_set():
                # One claim for this turn's proxies and the next few: fewer round trips.
                got = await asyncio.to_thread(
                    self.store.claim,
                    model,
                    self.worker_id,
                    need + self.settings.prefetch,
                    self.settings.lease_s,
                )
                tasks.extend(got[:need])
                buf.extend(got[need:])
        finally:
            self._unclaimed[model] -= len(proxies)
        for task, proxy in zip(tasks, proxies, strict=False):
            self._running[task.id] = self._spawn(self._run(task, proxy))
        for proxy in proxies[len(tasks) :]:
            sched.on_request_finished(proxy)  # another worker was faster: nothing to do

    async def _run(self, task: Task, proxy: _Proxy) -> None:
        ctx = TaskContext(task.id, task.attempts)
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

                    def fn(items: Any) -> Any:
                        return run_split(inner, items)

            work = asyncio.ensure_future(self._execute(fn, spec.is_async, task, token, ctx))
            beat = asyncio.ensure_future(self._heartbeat(task, token, work, ctx))
            try:
                await work
            except asyncio.CancelledError:
                # Shutdown ran out of time: give the task back now rather than at lease expiry.
                await asyncio.shield(asyncio.to_thread(self.store.release, task.id, token))
                raise
            finally:
                beat.cancel()
        finally:
            self._running.pop(task.id, None)
            if proxy.state is RequestState.RUNNING:
                self._sched().on_request_finished(proxy)

    async def _execute(
        self, fn: Handler, is_async: bool, task: Task, token: str, ctx: TaskContext
    ) -> None:
        """Run the handler and commit its outcome: one thread hop for a sync handler (it and
        the commit run in the same thread), the loop then one hop for an async one."""
        reset = _current.set(ctx)  # to_thread copies the context: sync handlers see it too
        try:
            if not is_async:
                await asyncio.to_thread(self._execute_sync, fn, task, token, ctx)
                return
            result: Any = None
            error: BaseException | None = None
            try:
                result = await fn(task.payload)
            except asyncio.CancelledError:
                if not ctx.cancelled:
                    raise  # shutdown, not a cancellation of this task
            except Exception as exc:  # the handler failed: record it, maybe retry
                error = exc
        finally:
            _current.reset(reset)
        await asyncio.to_thread(self._commit, task, token, ctx, result, error)

    def _execute_sync(self, fn: Handler, task: Task, token: str, ctx: TaskContext) -> None:
        try:
            result = fn(task.payload)
        except Exception as exc:  # the handler failed: record it, maybe retry
            self._commit(task, token, ctx, None, exc)
            return
        self._commit(task, token, ctx, result, None)

    def _commit(
        self, task: Task, token: str, ctx: TaskContext, result: Any, error: BaseException | None
    ) -> None:
        """Write the outcome (in a worker thread). Fencing makes a lost lease write nothing."""
        store = self.store
        if ctx.cancelled:
            store.acknowledge_cancel(task.id, token)
        elif error is not None:
            store.fail(task.id, token, _describe(error), self._backoff(task))
        else:
            try:
                committed = store.finish(task.id, token, result)
            except (TypeError, ValueError) as exc:
                store.fail(
                    task.id, token, f"the handler's result is not JSON-serialisable: {exc}", None
                )
                return
            if not committed:
                log.warning("task %s: lease lost before commit; its result was dropped", task.id)

    async def _heartbeat(
        self, task: Task, token: str, work: asyncio.Future[Any], ctx: TaskContext
    ) -> None:
        # At most 1 s apart, so a cancellation reaches the handler within a second.
        every = min(self.settings.lease_s / 3, 1.0)
        while not work.done():
            await asyncio.sleep(every)
            state = await asyncio.to_thread(
                self.store.heartbeat, task.id, token, self.settings.lease_s
            )
            if state is Lease.CANCEL:
                ctx._cancel()  # sync handlers poll it; async ones are cancelled
                if (
                    task.kind in self.registry.handlers
                    and self.registry.handlers[task.kind].is_async
                ):
                    work.cancel()
            elif state is Lease.LOST:
                log.warning("task %s: lease lost (another worker may run it)", task.id)
                return

    def _backoff(self, task: Task) -> float | None:
        if task.attempts >= task.max_attempts:
            return None
        return float(
            min(self.settings.retry_base_s * 2 ** (task.attempts - 1), self.settings.retry_max_s)
        )

    async def _swap(self, model: str, evict: tuple[str, ...]) -> None:
        sched = self._sched()
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

    async def _release_prefetched(self, model: str) -> None:
        buf = self._prefetched[model]
        while buf:
            t = buf.popleft()
            await asyncio.to_thread(self.store.release, t.id, t.lease_token or "")

    async def _shutdown(self) -> None:
        for model in list(self._prefetched):
            await self._release_prefetched(model)
        running = [t for t in self._running.values() if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=self.settings.shutdown_timeout_s)
            for t in late:
                t.cancel()
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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
