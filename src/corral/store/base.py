"""The task store's contract: types, errors and the `Store` Protocol every adapter implements.

Semantics every adapter shares (tests/contract holds the one suite they all pass):
- `claim` takes queued tasks of one model whose `run_after` has come, highest priority first,
  then oldest; it never hands out two tasks with the same `serial_key` at once, and within a
  serial key only the oldest queued task is eligible (FIFO per key, even across retries).
- A claim gives each task a fresh `lease_token` and an expiry; every later write by the worker
  (`heartbeat`, `finish`, `fail`, `release`, `acknowledge_cancel`) must present that token, so a
  worker whose lease was lost (and whose task was re-claimed) can never commit: execution is
  at-least-once, commit exactly-once.
- `reclaim_expired` returns tasks whose lease ran out to the queue (or fails them when out of
  attempts).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from corral.errors import CorralError


class TaskStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Lease(enum.StrEnum):
    """What a heartbeat learns about its task."""

    HELD = "held"  # keep going
    LOST = "lost"  # the lease expired and the task went back (or elsewhere): stop, commit nothing
    CANCEL = "cancel"  # cancellation was requested: stop and acknowledge_cancel


class StoreError(CorralError):
    """A store operation failed."""


class TaskNotFound(StoreError):
    """No task has that id."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer Corral than this one."""


class StoreBusy(StoreError):
    """The database stayed locked beyond the busy timeout; the operation changed nothing and can
    be retried."""


class BadTask(StoreError):
    """A task cannot be stored as given (the message says which field and why)."""


@dataclass(frozen=True, slots=True)
class NewTask:
    """What `enqueue` takes."""

    kind: str
    model: str
    payload: Any = None
    priority: int = 0
    serial_key: str | None = None
    max_attempts: int = 3
    batch_id: str | None = None

    def payload_json(self) -> str:
        """The payload as JSON, or `BadTask` naming what cannot be serialised."""
        if not self.kind:
            raise BadTask("kind must be a non-empty handler name")
        if not self.model:
            raise BadTask("model must be a non-empty model name")
        if self.max_attempts < 1:
            raise BadTask(f"max_attempts must be >= 1; got {self.max_attempts}")
        try:
            return json.dumps(self.payload, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise BadTask(
                f"payload of a {self.kind!r} task is not JSON-serialisable: {exc}"
            ) from None


@dataclass(frozen=True, slots=True)
class Task:
    """A stored task, as of the read that returned it."""

    id: str
    seq: int
    kind: str
    model: str
    payload: Any
    priority: int
    serial_key: str | None
    status: TaskStatus
    attempts: int
    max_attempts: int
    created_at: float
    run_after: float
    lease_token: str | None = None
    lease_expires_at: float | None = None
    worker_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    result: Any = None
    error: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # one entry per failed attempt
    cancel_requested: bool = False
    batch_id: str | None = None


class Store(Protocol):
    """Durable tasks. Every method is one atomic transaction; none blocks beyond the busy
    timeout. Times are seconds since the epoch from the store's clock."""

    def enqueue(self, task: NewTask) -> str:
        """Store one queued task; returns its id."""
        ...

    def enqueue_many(self, tasks: Sequence[NewTask]) -> list[str]:
        """Store many queued tasks in one transaction (all or none); returns their ids."""
        ...

    def claim(self, model: str, worker_id: str, limit: int, lease_s: float) -> list[Task]:
        """Atomically take up to `limit` eligible tasks of `model` (see the module docstring)."""
        ...

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        """Extend the lease if `token` still holds it."""
        ...

    def finish(self, task_id: str, token: str, result: Any) -> bool:
        """Commit success; False (nothing written) if the lease was lost."""
        ...

    def fail(self, task_id: str, token: str, error: str, retry_in_s: float | None) -> bool:
        """Record a failed attempt: back to the queue after `retry_in_s` while attempts remain
        (None: fail for good). False if the lease was lost."""
        ...

    def release(self, task_id: str, token: str) -> bool:
        """Give a claimed task back untouched (graceful shutdown); the attempt does not count."""
        ...

    def acknowledge_cancel(self, task_id: str, token: str) -> bool:
        """The worker stopped a task whose cancellation was requested: mark it cancelled."""
        ...

    def cancel(self, task_id: str) -> TaskStatus:
        """Cancel: a queued task never starts; a running one is flagged for its worker. Returns
        the status after the call (a finished task keeps its status)."""
        ...

    def retry(self, task_id: str) -> TaskStatus:
        """Queue a failed or cancelled task again with fresh attempts."""
        ...

    def reclaim_expired(self) -> int:
        """Return running tasks whose lease expired to the queue; returns how many moved."""
        ...

    def get(self, task_id: str) -> Task:
        """The task, or `TaskNotFound`."""
        ...

    def list(
        self, status: TaskStatus | None = None, model: str | None = None, limit: int = 100
    ) -> list[Task]:
        """Tasks, newest first, optionally filtered."""
        ...

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        """Tasks per model and status."""
        ...

    def ready_counts(self) -> dict[str, dict[int, int]]:
        """Tasks `claim` could take right now, per model and priority (serial keys and
        `run_after` respected): what a worker's scheduler should see as waiting."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...
