"""An in-memory store: the reference semantics, for unit tests and users' own tests."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from corral.store.base import (
    Lease,
    NewTask,
    Task,
    TaskNotFound,
    TaskStatus,
)


class MemoryStore:
    """Thread-safe; nothing survives the process."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tasks: dict[str, Task] = {}
        self._seq = 0
        self._lock = threading.Lock()

    # --- writes -------------------------------------------------------------------------------
    def enqueue(self, task: NewTask) -> str:
        return self.enqueue_many([task])[0]

    def enqueue_many(self, tasks: Sequence[NewTask]) -> list[str]:
        payloads = [t.payload_json() for t in tasks]  # validate all before storing any
        with self._lock:
            now = self._clock()
            ids = []
            for t, payload in zip(tasks, payloads, strict=True):
                self._seq += 1
                tid = uuid.uuid4().hex
                self._tasks[tid] = Task(
                    id=tid,
                    seq=self._seq,
                    kind=t.kind,
                    model=t.model,
                    payload=json.loads(payload),
                    priority=t.priority,
                    serial_key=t.serial_key,
                    status=TaskStatus.QUEUED,
                    attempts=0,
                    max_attempts=t.max_attempts,
                    created_at=now,
                    run_after=now,
                    batch_id=t.batch_id,
                )
                ids.append(tid)
            return ids

    def _claimable(self, now: float) -> list[Task]:
        """Queued tasks `claim` may take now: due, and first of a serial key with none running."""
        busy_keys = {
            t.serial_key
            for t in self._tasks.values()
            if t.status is TaskStatus.RUNNING and t.serial_key is not None
        }
        first_of_key: dict[str, int] = {}
        for t in self._tasks.values():
            if t.status is TaskStatus.QUEUED and t.serial_key is not None:
                first_of_key[t.serial_key] = min(first_of_key.get(t.serial_key, t.seq), t.seq)
        return [
            t
            for t in self._tasks.values()
            if t.status is TaskStatus.QUEUED
            and t.run_after <= now
            and (
                t.serial_key is None
                or (t.serial_key not in busy_keys and first_of_key[t.serial_key] == t.seq)
            )
        ]

    def ready_counts(self) -> dict[str, dict[int, int]]:
        with self._lock:
            out: dict[str, dict[int, int]] = {}
            for t in self._claimable(self._clock()):
                per = out.setdefault(t.model, {})
                per[t.priority] = per.get(t.priority, 0) + 1
            return out

    def claim(self, model: str, worker_id: str, limit: int, lease_s: float) -> list[Task]:
        with self._lock:
            now = self._clock()
            eligible = sorted(
                (t for t in self._claimable(now) if t.model == model),
                key=lambda t: (-t.priority, t.seq),
            )
            out = []
            for t in eligible[:limit]:
                claimed = dataclasses.replace(
                    t,
                    status=TaskStatus.RUNNING,
                    attempts=t.attempts + 1,
                    lease_token=uuid.uuid4().hex,
                    lease_expires_at=now + lease_s,
                    worker_id=worker_id,
                    started_at=now,
                )
                self._tasks[t.id] = claimed
                out.append(copy.deepcopy(claimed))
            return out

    def _holder(self, task_id: str, token: str) -> Task | None:
        t = self._tasks.get(task_id)
        if t is None or t.status is not TaskStatus.RUNNING or t.lease_token != token:
            return None
        return t

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return Lease.LOST
            self._tasks[task_id] = dataclasses.replace(t, lease_expires_at=self._clock() + lease_s)
            return Lease.CANCEL if t.cancel_requested else Lease.HELD

    def finish(self, task_id: str, token: str, result: Any) -> bool:
        encoded = json.dumps(result, allow_nan=False)
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return False
            self._tasks[task_id] = dataclasses.replace(
                t,
                status=TaskStatus.SUCCEEDED,
                result=json.loads(encoded),
                lease_token=None,
                lease_expires_at=None,
                finished_at=self._clock(),
            )
            return True

    def fail(self, task_id: str, token: str, error: str, retry_in_s: float | None) -> bool:
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return False
            now = self._clock()
            errors = [*t.errors, {"attempt": t.attempts, "error": error, "at": now}]
            if retry_in_s is not None and t.attempts < t.max_attempts:
                self._tasks[task_id] = dataclasses.replace(
                    t,
                    status=TaskStatus.QUEUED,
                    run_after=now + retry_in_s,
                    lease_token=None,
                    lease_expires_at=None,
                    worker_id=None,
                    error=error,
                    errors=errors,
                )
            else:
                self._tasks[task_id] = dataclasses.replace(
                    t,
                    status=TaskStatus.FAILED,
                    lease_token=None,
                    lease_expires_at=None,
                    finished_at=now,
                    error=error,
                    errors=errors,
                )
            return True

    def release(self, task_id: str, token: str) -> bool:
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return False
            self._tasks[task_id] = dataclasses.replace(
                t,
                status=TaskStatus.QUEUED,
                attempts=t.attempts - 1,
                lease_token=None,
                lease_expires_at=None,
                worker_id=None,
                started_at=None,
            )
            return True

    def acknowledge_cancel(self, task_id: str, token: str) -> bool:
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return False
            self._tasks[task_id] = dataclasses.replace(
                t,
                status=TaskStatus.CANCELLED,
                lease_token=None,
                lease_expires_at=None,
                finished_at=self._clock(),
            )
            return True

    def cancel(self, task_id: str) -> TaskStatus:
        with self._lock:
            t = self._get(task_id)
            if t.status is TaskStatus.QUEUED:
                t = dataclasses.replace(t, status=TaskStatus.CANCELLED, finished_at=self._clock())
            elif t.status is TaskStatus.RUNNING:
                t = dataclasses.replace(t, cancel_requested=True)
            self._tasks[task_id] = t
            return t.status

    def retry(self, task_id: str) -> TaskStatus:
        with self._lock:
            t = self._get(task_id)
            if t.status in (TaskStatus.FAILED, TaskStatus.CANCELLED):
                now = self._clock()
                t = dataclasses.replace(
                    t,
                    status=TaskStatus.QUEUED,
                    attempts=0,
                    run_after=now,
                    finished_at=None,
                    cancel_requested=False,
                    worker_id=None,
                    started_at=None,
                )
                self._tasks[task_id] = t
            return t.status

    def reclaim_expired(self) -> int:
        with self._lock:
            now = self._clock()
            moved = 0
            for t in list(self._tasks.values()):
                if (
                    t.status is TaskStatus.RUNNING
                    and t.lease_expires_at is not None
                    and t.lease_expires_at < now
                ):
                    error = f"lease expired on worker {t.worker_id} (worker died or stalled)"
                    errors = [*t.errors, {"attempt": t.attempts, "error": error, "at": now}]
                    final = t.attempts >= t.max_attempts
                    self._tasks[t.id] = dataclasses.replace(
                        t,
                        status=TaskStatus.FAILED if final else TaskStatus.QUEUED,
                        lease_token=None,
                        lease_expires_at=None,
                        worker_id=t.worker_id if final else None,
                        finished_at=now if final else None,
                        error=error,
                        errors=errors,
                    )
                    moved += 1
            return moved

    # --- reads --------------------------------------------------------------------------------
    def _get(self, task_id: str) -> Task:
        t = self._tasks.get(task_id)
        if t is None:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return t

    def get(self, task_id: str) -> Task:
        with self._lock:
            return copy.deepcopy(self._get(task_id))

    def list(
        self, status: TaskStatus | None = None, model: str | None = None, limit: int = 100
    ) -> list[Task]:
        with self._lock:
            rows = [
                t
                for t in self._tasks.values()
                if (status is None or t.status is status) and (model is None or t.model == model)
            ]
            rows.sort(key=lambda t: -t.seq)
            return copy.deepcopy(rows[:limit])

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._lock:
            out: dict[str, dict[TaskStatus, int]] = {}
            for t in self._tasks.values():
                per = out.setdefault(t.model, {})
                per[t.status] = per.get(t.status, 0) + 1
            return out

    def close(self) -> None:
        pass
