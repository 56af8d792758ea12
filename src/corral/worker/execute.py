"""Running handlers and committing their outcomes, for the worker (its `Executor` part): a
task alone, a batched kind's batch, or a run of plain sync tasks, one scheduling slot at a time.
A run's tasks go in one thread hop and commit together (`Store.finish_many`: group commit); a
sync handler and its commit share one thread hop; an async one runs on the loop, then one hop
commits. Each commit also starts the model's next tasks claimed ahead, in the same
transaction."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from corral.core import Request, RequestState
from corral.store import (
    Finished,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    Task,
    TaskStatus,
)
from corral.store.roles import TaskWork
from corral.worker import batching, isolate
from corral.worker.buffer import Ahead, ClaimBuffer, counted, give_back
from corral.worker.heartbeats import Heartbeats
from corral.worker.last_words import LastWords
from corral.worker.registry import (
    Fail,
    Handler,
    HandlerSpec,
    Registry,
    TaskContext,
    _current,
    _device,
)
from corral.worker.settings import WorkerSettings
from corral.worker.split import run_split, run_split_async

log = logging.getLogger("corral.worker")
# Store errors a worker waits out: the database is unreachable (after the store's own retries)
# or locked by another process. Anything else is a bug or a misconfiguration: it stops the worker.
TRANSIENT = (StoreUnavailable, StoreBusy)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the executor asks of its worker."""

    finished: Callable[[Request], None]  # a slot's request ends (the worker tells the scheduler)
    loop: Callable[[], asyncio.AbstractEventLoop]
    per: Callable[[str], int]  # tasks per scheduling slot of a model
    measured: Callable[[str, float], None]  # a run measured its tasks' time


class Executor:
    """Runs the handlers of a worker's slots and commits their outcomes (`run_slot`). It shares
    the worker's running tasks, claim buffer, heartbeats, last words and events."""

    def __init__(
        self,
        store: TaskWork,
        worker_id: str,
        registry: Registry,
        settings: WorkerSettings,
        beats: Heartbeats,
        words: LastWords,
        buffer: ClaimBuffer,
        running: dict[str, asyncio.Task[None]],
        groupable: dict[str, bool],
        stop: asyncio.Event,
        wake: asyncio.Event,
        hooks: Hooks,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.registry = registry
        self.settings = settings
        self._beats = beats
        self._words = words
        self._buffer = buffer
        self._running = running
        self._groupable = groupable
        self._stop = stop
        self._wake = wake  # the worker's loop looks again (a retry is due)
        self._finished = hooks.finished
        self._loop_ = hooks.loop
        self._per = hooks.per
        self._measured = hooks.measured

    async def run_slot(self, calls: list[list[Task]], request: Request) -> None:
        """Run one scheduling slot's handler calls in turn (a task, a batched kind's batch, or
        consecutive plain sync tasks as one group run), then end its request. Tasks waiting behind
        the first call keep their leases meanwhile."""
        tasks = [t for call in calls for t in call]
        _device.set(request.device)  # this task's context only: the slot's copy of its model
        # Tasks that must run alone go last: they start only when their turn comes, so none
        # other of the slot waits, started, while one of them runs (it may kill the worker).
        calls = sorted(calls, key=lambda call: any(t.started_at is None for t in call))
        try:
            if len(calls) > 1:  # (a run registers its own tasks when it starts)
                me = asyncio.current_task()
                assert me is not None
                for call in calls:
                    if not self._in_run(call):
                        for t in call:
                            ctx = TaskContext(t.id, 0)
                            self._beats.add(t, t.lease_token or "", ctx, me, False)
            while calls:
                call = calls.pop(0)
                if self._in_run(call):
                    run = [call[0]]
                    while calls and self._in_run(calls[0]):
                        run.append(calls.pop(0)[0])
                    # A task started by itself commits as soon as it ran (see `_execute_group`),
                    # and goes first, so that no other task of the run can kill the worker
                    # while it waits, started: its attempt would count.
                    run.sort(key=lambda t: t.started_in_group)
                    # Its thread owns these tasks from here (a cancelled await leaves it running:
                    # it stops at the next task on shutdown, and releases what it did not run).
                    await self._run_group(run)
                    continue
                if any(t.started_at is None for t in call):  # it must run alone: start it now
                    call = await self._start_alone(call)
                    if not call:
                        continue
                spec = self.registry.handlers.get(call[0].kind)
                if spec is not None and spec.batch_size > 1:
                    await self._run_batch(spec, call)
                else:
                    await self._run(call[0])
        except asyncio.CancelledError:
            left = [t for call in calls for t in call]  # shutdown: those never began
            await asyncio.shield(asyncio.to_thread(self._release_all, left))
            raise
        except TRANSIENT as exc:  # a commit could not reach the database (the store retried)
            left = [t for call in calls for t in call]
            log.warning(
                "model %s: stopped a slot (%s); its uncommitted tasks run again once their "
                "leases expire",
                tasks[0].model,
                exc,
            )
            with contextlib.suppress(*TRANSIENT):
                await asyncio.to_thread(self._release_all, left)
        finally:
            for t in tasks:
                self._running.pop(t.id, None)
                self._beats.remove(t.id)
            if request.state is RequestState.RUNNING:
                self._finished(request)

    def _no_handler(self, task: Task) -> NoHandler:
        return NoHandler(
            f"no handler for task kind {task.kind!r} (registered: "
            f"{', '.join(sorted(self.registry.handlers)) or 'none'})"
        )

    def _in_run(self, call: list[Task]) -> bool:
        """Whether the call joins a group run: one started task of a plain sync kind (or of no
        kind: it fails there), on a model run in groups."""
        t = call[0]
        if len(call) > 1 or t.started_at is None or not self._groupable.get(t.model, False):
            return False
        spec = self.registry.handlers.get(t.kind)
        return spec is None or plain(spec)

    async def _start_alone(self, call: list[Task]) -> list[Task]:
        """Start reserved tasks that must run alone, each by itself, just before they run; the
        call keeps those started (a lost lease drops one)."""
        out = []
        for t in call:
            if t.started_at is None:
                started = await asyncio.to_thread(self.store.start, [(t.id, t.lease_token or "")])
                if not started:
                    self._running.pop(t.id, None)
                    continue
                t = counted(t, False)
            out.append(t)
        return out

    async def _run_group(self, tasks: list[Task]) -> None:
        """A run: the tasks one after another in one thread hop, committed together."""
        ctxs = [TaskContext(t.id, t.attempts, t.max_attempts, t.model) for t in tasks]
        me = asyncio.current_task()
        assert me is not None
        for t, ctx in zip(tasks, ctxs, strict=True):  # cancellations reach these contexts
            self._beats.add(t, t.lease_token or "", ctx, me, False)
        await asyncio.to_thread(self._execute_group, tasks, ctxs)

    def _execute_group(self, tasks: list[Task], ctxs: list[TaskContext]) -> None:
        """Run each task's handler in turn, then commit the successes in one transaction that
        also starts the next run's tasks; failures and cancellations commit one by one (as
        `_commit`). On shutdown it stops after the current task and gives the rest back."""
        done: list[tuple[Task, Finished]] = []
        ran = 0
        started_s = time.monotonic()
        try:
            for task, ctx in zip(tasks, ctxs, strict=True):
                if self._stop.is_set():
                    break
                ran += 1
                spec = self.registry.handlers.get(task.kind)
                token = task.lease_token or ""
                alone = not task.started_in_group  # its attempt counts if the worker dies
                if spec is None or ctx.cancelled:
                    error = None if spec else self._no_handler(task)
                    self._commit(task, token, ctx, None, error, start_next=False)
                    continue
                fn: Handler = spec.fn
                reset = _current.set(ctx)
                said = self._words.say((task,))
                result: Any
                try:
                    if spec.split_on_failure:
                        result = run_split(fn, task.payload)
                    else:
                        result = fn(task.payload)
                except Exception as exc:  # the handler failed: record it, maybe retry
                    self._words.unsay(said)
                    self._commit(task, token, ctx, None, exc, start_next=False)
                    continue
                finally:
                    _current.reset(reset)
                self._words.unsay(said)
                if not spec.keep_result:
                    result = None
                if ctx.cancelled or alone:
                    self._commit(task, token, ctx, result, None, start_next=False)
                    continue
                try:
                    text = "null" if result is None else json.dumps(result, allow_nan=False)
                except (TypeError, ValueError):  # `_commit` fails it, naming the reason
                    self._commit(task, token, ctx, result, None, start_next=False)
                    continue
                done.append((task, Finished(task.id, token, text)))
        finally:
            if ran:
                self._measured(tasks[0].model, (time.monotonic() - started_s) / ran)
            self._commit_group(tasks[0].model, done)
            for task in tasks[ran:]:  # shutdown: never began
                self._beats.remove(task.id)
                self.store.release(task.id, task.lease_token or "")

    def _commit_group(self, model: str, done: list[tuple[Task, Finished]]) -> None:
        """Commit a run's successes and start the next run's tasks, in one transaction."""
        for task, _ in done:
            self._beats.remove(task.id)  # before the commit ends the lease (see `remove`)
        nxt = self._buffer.next_to_start(model, self._per(model))
        then_start = [(a.task.id, a.task.lease_token or "") for a in nxt]
        if not done and not then_start:
            return
        with self._starting(nxt):
            committed = set(self.store.finish_many([f for _, f in done], then_start))
        for task, f in done:
            if task.id not in committed:
                self._not_committed(task.id, f.result_json)

    @contextlib.contextmanager
    def _starting(self, nxt: list[Ahead]) -> Iterator[None]:
        """Around a commit that starts `nxt` (in its thread): if it fails, they are reserved
        again; if it lands, `_started`."""
        try:
            yield
        except BaseException:
            self._buffer.unstart(nxt)
            raise
        self._buffer.started(nxt)
        for a in nxt:  # evicted meanwhile: given back
            if a.drop:
                self.store.release(a.task.id, a.task.lease_token or "")

    def _release_all(self, tasks: list[Task]) -> None:
        give_back(self.store, tasks)

    async def _run_batch(self, spec: HandlerSpec, tasks: list[Task]) -> None:
        ctxs = [TaskContext(t.id, t.attempts, t.max_attempts, t.model) for t in tasks]
        work = asyncio.ensure_future(self._execute_batch(spec, tasks, ctxs))
        for t, ctx in zip(tasks, ctxs, strict=True):
            # Not "async" for the heartbeats: cancelling one task must not cancel the batch
            # (its result is dropped at the commit instead).
            self._beats.add(t, t.lease_token or "", ctx, work, False)
        said = self._words.say(tasks)
        try:
            await work
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.to_thread(self._release_all, tasks))
            raise
        finally:
            self._words.unsay(said)
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
                message = str(self._no_handler(task))
                await asyncio.to_thread(self.store.fail, task.id, token, message, None)
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
            said = self._words.say((task,))
            try:
                await work
            except asyncio.CancelledError:
                # Shutdown ran out of time: give the task back now rather than at lease expiry.
                await asyncio.shield(asyncio.to_thread(self.store.release, task.id, token))
                raise
            finally:
                self._words.unsay(said)
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
        self,
        task: Task,
        token: str,
        ctx: TaskContext,
        result: Any,
        error: BaseException | None,
        start_next: bool = True,
    ) -> None:
        """Write the outcome (in a worker thread). Fencing makes a lost lease write nothing. The
        same transaction starts the model's next task claimed ahead (unless not `start_next`:
        in a run, whose commit starts the next run), so a buffered task's attempt counts before
        its handler runs without a write of its own."""
        store = self.store
        self._beats.remove(task.id)  # before the commit ends the lease (see `remove`)
        spec = self.registry.handlers.get(task.kind)
        if spec is not None and not spec.keep_result:
            result = None
        # A model run in groups starts its tasks in groups (`_commit_group`, `_take`): a task
        # started alone here would wait, started, behind others that may kill the worker.
        start_next = start_next and not self._groupable.get(task.model, False)
        nxt = self._buffer.next_to_start(task.model, 1) if start_next else []
        then_start = [(a.task.id, a.task.lease_token or "") for a in nxt]
        with self._starting(nxt):
            if ctx.cancelled:
                store.acknowledge_cancel(task.id, token, then_start)
            elif error is not None:
                if isinstance(error, (Fail, NoHandler)):  # a retry cannot help
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
                    self._not_committed(task.id, json.dumps(result, allow_nan=False))

    def _not_committed(self, task_id: str, result_json: str) -> None:
        """Say why a success wrote nothing. Usually the lease was lost (the task ran too long
        without a heartbeat landing, and another worker may run it). But when the connection
        dropped during the commit, the store tried again and the first try may have landed:
        the task is then ours, succeeded, with this result, and nothing was dropped."""
        t = None
        for wait_s in (0.0, 0.5, 1.0, 2.0):  # the store may still be reconnecting
            time.sleep(wait_s)
            try:
                t = self.store.get(task_id)
                break
            except StoreError:
                continue
        if (
            t is not None
            and t.status is TaskStatus.SUCCEEDED
            and t.worker_id == self.worker_id
            and t.result == json.loads(result_json)
        ):
            # A warning, as the outage it comes from: nothing is wrong, but someone reading
            # the outage's lines should know this commit landed.
            log.warning(
                "task %s: committed (the connection dropped during the commit; "
                "the result is stored)",
                task_id,
            )
            return
        log.warning("task %s: lease lost before commit; its result was dropped", task_id)

    def _backoff(self, task: Task) -> float | None:
        if task.attempts >= task.max_attempts:
            return None
        return float(
            min(self.settings.retry_base_s * 2 ** (task.attempts - 1), self.settings.retry_max_s)
        )


def plain(spec: HandlerSpec) -> bool:
    """A handler that can run in a group run: sync, in the worker's thread, one task a call."""
    return not spec.is_async and spec.timeout_s is None and spec.batch_size == 1


class NoHandler(Exception):
    """No handler is registered for the task's kind (fails it for good)."""


def timed_out(spec: HandlerSpec) -> isolate.HandlerTimeout:
    return isolate.HandlerTimeout(f"the handler ran past its timeout_s of {spec.timeout_s:g} s")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
