"""Running handlers and committing their outcomes, for the worker (`Worker` mixes this in): a
task alone, or a batched kind's batch, one scheduling slot at a time. A sync handler and its
commit share one thread hop; an async one runs on the loop, then one hop commits. Each commit
also starts the model's next task claimed ahead, in the same transaction."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from typing import Any

from corral.core import Request, RequestState, Scheduler
from corral.store import Store, Task
from corral.worker import batching, isolate
from corral.worker.heartbeats import Heartbeats
from corral.worker.registry import Fail, Handler, HandlerSpec, Registry, TaskContext, _current
from corral.worker.settings import WorkerSettings
from corral.worker.split import run_split, run_split_async

log = logging.getLogger("corral.worker")


class Ahead:
    """A task claimed ahead. `state`: reserved -> starting (a commit is writing its start
    mark) -> started; only reserved and started ones may be taken to run."""

    __slots__ = ("claimed_at", "drop", "state", "task")

    def __init__(self, task: Task, claimed_at: float) -> None:
        self.task = task
        self.claimed_at = claimed_at
        self.state = "reserved"
        self.drop = False  # evicted while starting: the commit releases it once started


class Execution:
    """The handler-running half of `Worker`; the attributes below are the worker's."""

    store: Store
    registry: Registry
    settings: WorkerSettings
    _beats: Heartbeats
    _running: dict[str, asyncio.Task[None]]
    _ahead_lock: threading.Lock
    _wake: asyncio.Event

    def _sched(self) -> Scheduler:
        raise NotImplementedError

    def _loop_(self) -> asyncio.AbstractEventLoop:
        raise NotImplementedError

    def _next_to_start(self, model: str) -> Ahead | None:
        raise NotImplementedError

    async def _run_slot(self, calls: list[list[Task]], proxy: Request) -> None:
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
                error = timed_out(spec) if limit.expired() else exc
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
                error = timed_out(spec) if limit.expired() else exc
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
                    retry_in_s, message = self._backoff(task), describe(error)
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
                nxt.task = counted(nxt.task)
                nxt.state = "started"
            if nxt.drop:
                store.release(nxt.task.id, nxt.task.lease_token or "")

    def _backoff(self, task: Task) -> float | None:
        if task.attempts >= task.max_attempts:
            return None
        return float(
            min(self.settings.retry_base_s * 2 ** (task.attempts - 1), self.settings.retry_max_s)
        )


def counted(task: Task) -> Task:
    """A task claimed ahead, as its start mark left it: the start counted its attempt, which the
    copy read at the claim does not show (the handler's `attempt`, backoff, `last_attempt`)."""
    return dataclasses.replace(task, attempts=task.attempts + 1)


def timed_out(spec: HandlerSpec) -> isolate.HandlerTimeout:
    return isolate.HandlerTimeout(f"the handler ran past its timeout_s of {spec.timeout_s:g} s")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
