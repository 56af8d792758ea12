"""The library API an app writes against:

q = corral.Queue("sqlite:///tasks.db")            # or postgresql://...
@q.handler("cover_letter", model="cover-writer")
def write_cover_letter(payload): ...
task_id = q.submit("cover_letter", {"job": 42})
q.result(task_id, timeout=60)                      # waits; raises on failure or cancel
q.run_worker()                                     # drains in the scheduler's order
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from corral.config import Config, ModelConfig, load_config
from corral.errors import CorralError
from corral.store import (
    MAX_PAYLOAD_BYTES,
    BadTask,
    NewTask,
    Store,
    Task,
    TaskStatus,
    open_store,
    payload_text,
)
from corral.worker.registry import Hook, ModelHooks, Registry
from corral.worker.runtime import Worker, WorkerSettings

F = TypeVar("F", bound=Callable[..., Any])


class UnknownKind(CorralError):
    """No handler is registered for that task kind."""


class TaskFailed(CorralError):
    """The task failed for good; `.task` holds every attempt's error."""

    def __init__(self, task: Task) -> None:
        self.task = task
        super().__init__(
            f"task {task.id} ({task.kind}) failed after {task.attempts} attempt(s): {task.error}"
        )


class TaskCancelled(CorralError):
    """The task was cancelled."""


class Queue:
    """Submit tasks, wait for results, run workers. Thread-safe for submitting."""

    def __init__(
        self,
        url: str = "sqlite:///corral.db",
        config: Config | str | Path | None = None,
        *,
        max_payload_mb: float = MAX_PAYLOAD_BYTES / 1048576,
    ) -> None:
        """`max_payload_mb`: the largest payload (as JSON) `submit` accepts; a larger one is a
        `BadTask` (keep large data elsewhere and pass a reference)."""
        if not max_payload_mb > 0:
            raise ValueError(f"max_payload_mb must be > 0; got {max_payload_mb!r}")
        self.url = url
        self._store: Store | None = None
        self._config = config
        self.max_payload_bytes = int(max_payload_mb * 1048576)
        self.registry = Registry()

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.url)
        return self._store

    def handler(
        self,
        kind: str,
        *,
        model: str,
        split_on_failure: bool = False,
        timeout_s: float | None = None,
        batch_size: int = 1,
        batch_wait_ms: float = 0.0,
        max_queued: int | None = None,
        keep_result: bool = True,
    ) -> Callable[[F], F]:
        """Register the function that runs tasks of `kind` on `model` (sync or async).

        `batch_size` > 1: the function takes a *list* of up to that many payloads (tasks of
        this kind ready together, claimed in one store call, collected for at most
        `batch_wait_ms` after the first) and returns a list with one result per payload, in
        order. An item whose result is an exception instance fails alone (`corral.Fail(...)`:
        without retries); if the call raises, every task of the batch records the error. Each
        task keeps its own status, attempts and retries. The scheduler counts one batch as one
        unit of work, so it learns what a batch costs. Inside the call, `current_task()` is the
        batch's first task.

        `keep_result=False`: a success stores no result (`result` is None; the task's status,
        attempts and times are kept): for tasks whose effect is elsewhere, and whose results
        would only fill the database. Finished tasks are deleted a week after they end (the
        worker's `WorkerSettings(retention_s=...)`, `--retention-s`; None or 0 keeps them).

        `max_queued`: at most this many tasks of `kind` wait queued; `submit` past it raises
        `corral.QueueFull` (nothing is stored), so producers feel back-pressure.

        `timeout_s`: an attempt running longer is stopped and counts as failed (retried while
        attempts remain). An async handler is cancelled; a sync one runs in a child process
        that is killed, so it must be defined at module level and its payload and result
        picklable. Such a sync handler is also stopped at once when its task is cancelled;
        other sync handlers must check `current_task().cancelled`.

        `split_on_failure`: the payload is a list processed in one call and the function
        returns one result per item. If a call fails, the list is split in halves and each half
        is tried again (serially); an item that fails alone is recorded as failed, and every
        success is kept. The task's result is `{"results": [...], "failed": {index: error}}`;
        the task fails (and may retry) only if every item failed."""

        def register(fn: F) -> F:
            self.registry.add_handler(
                kind,
                model,
                fn,
                split_on_failure,
                timeout_s,
                batch_size,
                batch_wait_ms / 1000,
                max_queued,
                keep_result,
            )
            return fn

        return register

    def model(self, name: str, *, load: Hook | None = None, unload: Hook | None = None) -> None:
        """Declare an in-process model: `load()` runs before its tasks, `unload()` on eviction."""
        self.registry.add_model(ModelHooks(name, load, unload))

    # --- submitting ---------------------------------------------------------------------------
    def _new(
        self,
        kind: str,
        payload: Any,
        priority: int,
        serial_key: str | None,
        max_attempts: int,
        batch_id: str | None,
        interactive: bool,
    ) -> NewTask:
        spec = self.registry.handlers.get(kind)
        if spec is None:
            raise UnknownKind(
                f"no handler for task kind {kind!r}; registered: "
                f"{', '.join(sorted(self.registry.handlers)) or 'none'} "
                "(register one with @queue.handler(kind, model=...))"
            )
        if spec.split_on_failure and (not isinstance(payload, list) or not payload):
            raise BadTask(
                f"a {kind!r} task splits on failure, so its payload must be a non-empty list; "
                f"got {type(payload).__name__}"
            )
        text = payload_text(kind, payload, self.max_payload_bytes)
        return NewTask(
            kind,
            spec.model,
            payload,
            priority,
            serial_key,
            max_attempts,
            batch_id,
            interactive,
            payload_raw=text,
        )

    def submit(
        self,
        kind: str,
        payload: Any = None,
        *,
        priority: int = 0,
        serial_key: str | None = None,
        max_attempts: int = 3,
        batch_id: str | None = None,
        interactive: bool = False,
    ) -> str:
        """Queue one task; returns its id.

        A task is batch work unless `interactive=True` (someone waits for its result): a worker
        runs interactive tasks of any model before batch tasks of any model; `priority` orders
        tasks inside their class."""
        task = self._new(kind, payload, priority, serial_key, max_attempts, batch_id, interactive)
        bound = self.registry.handlers[kind].max_queued
        if bound is not None:
            return self.store.enqueue_many([task], max_queued=bound)[0]
        return self.store.enqueue(task)

    def submit_many(
        self,
        kind: str,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        max_attempts: int = 3,
        batch_id: str | None = None,
        interactive: bool = False,
    ) -> list[str]:
        """Queue many tasks of one kind in one transaction (all or none); `interactive` as in
        `submit`. A bad payload is a `BadTask` naming its index, and nothing is queued."""
        tasks = []
        for i, p in enumerate(payloads):
            try:
                tasks.append(
                    self._new(kind, p, priority, None, max_attempts, batch_id, interactive)
                )
            except BadTask as exc:
                raise BadTask(f"payloads[{i}]: {exc}") from None
        return self.store.enqueue_many(tasks, max_queued=self.registry.handlers[kind].max_queued)

    def get(self, task_id: str) -> Task:
        return self.store.get(task_id)

    def cancel(self, task_id: str) -> TaskStatus:
        return self.store.cancel(task_id)

    def result(self, task_id: str, timeout: float | None = None, poll_s: float = 0.05) -> Any:
        """Wait for the task to end; its result, or `TaskFailed` / `TaskCancelled`;
        `TimeoutError` if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            t = self.store.get(task_id)
            if t.status is TaskStatus.SUCCEEDED:
                return t.result
            if t.status is TaskStatus.FAILED:
                raise TaskFailed(t)
            if t.status is TaskStatus.CANCELLED:
                raise TaskCancelled(f"task {task_id} was cancelled")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"task {task_id} is still {t.status.value} after {timeout} s")
            time.sleep(poll_s)

    async def aresult(self, task_id: str, timeout: float | None = None) -> Any:
        return await asyncio.to_thread(self.result, task_id, timeout)

    async def asubmit(self, kind: str, payload: Any = None, **kw: Any) -> str:
        return await asyncio.to_thread(self.submit, kind, payload, **kw)

    # --- working ------------------------------------------------------------------------------
    def config(self) -> Config:
        """The scheduler configuration: the given file, or defaults for every registered model."""
        if isinstance(self._config, Config):
            return self._config
        if self._config is not None:
            return load_config(self._config)
        return Config(models={m: ModelConfig() for m in self.registry.model_names()})

    def worker(self, settings: WorkerSettings | None = None) -> Worker:
        return Worker(self.store, self.registry, self.config(), settings)

    async def arun_worker(
        self, until_idle: bool = False, settings: WorkerSettings | None = None
    ) -> Worker:
        w = self.worker(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Not in the main thread, or no signals on this platform: stop() still works.
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, w.stop)
        await w.run(until_idle=until_idle)
        return w

    def run_worker(
        self, until_idle: bool = False, settings: WorkerSettings | None = None
    ) -> Worker:
        """Run a worker in this thread until SIGTERM/SIGINT (or until idle)."""
        return asyncio.run(self.arun_worker(until_idle, settings))

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
