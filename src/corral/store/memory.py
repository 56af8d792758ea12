"""An in-memory store: the reference semantics, for unit tests and users' own tests."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from corral.store.base import (
    Batch,
    BatchNotFound,
    FileNotFound,
    Finished,
    Lease,
    Level,
    NewTask,
    QueueFull,
    Residency,
    StoredFile,
    Task,
    TaskNotFound,
    TaskStatus,
    Wakeups,
    grouped_expiry,
)


class MemoryStore:
    """Thread-safe; nothing survives the process."""

    wakes_other_processes = False  # there are no other processes
    identity: str | None = None  # nor files about it

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tasks: dict[str, Task] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._wakeups = Wakeups()
        self._files: dict[str, tuple[int, StoredFile]] = {}
        self._workers: dict[str, tuple[list[str], float, str | None]] = {}
        self._batches: dict[str, Batch] = {}
        self._residency: dict[str, list[Residency]] = {}
        self._cleared: set[str] = set()  # grouped tasks a dead worker's last words cleared

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._wakeups.add(wake)

    # --- writes -------------------------------------------------------------------------------
    def enqueue(self, task: NewTask) -> str:
        return self.enqueue_many([task])[0]

    def enqueue_many(self, tasks: Sequence[NewTask], max_queued: int | None = None) -> list[str]:
        payloads = [t.payload_json() for t in tasks]  # validate all before storing any
        with self._lock:
            if max_queued is not None and tasks:
                kind = tasks[0].kind
                queued = sum(
                    1
                    for t in self._tasks.values()
                    if t.kind == kind and t.status is TaskStatus.QUEUED
                )
                if queued + len(tasks) > max_queued:
                    raise QueueFull.of(kind, queued, len(tasks), max_queued)
            ids = self._add(tasks, payloads)
        self._wakeups.fire()
        return ids

    def _add(self, tasks: Sequence[NewTask], payloads: Sequence[str]) -> list[str]:
        """Store validated tasks; the caller holds the lock."""
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
                interactive=t.interactive,
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

    def ready_counts(self) -> dict[str, dict[Level, int]]:
        with self._lock:
            out: dict[str, dict[Level, int]] = {}
            for t in self._claimable(self._clock()):
                per = out.setdefault(t.model, {})
                per[t.level] = per.get(t.level, 0) + 1
            return out

    def claim(
        self,
        model: str,
        worker_id: str,
        limit: int,
        lease_s: float,
        start: int | None = None,
        group: bool = False,
    ) -> list[Task]:
        with self._lock:
            now = self._clock()
            eligible = sorted(
                (t for t in self._claimable(now) if t.model == model),
                key=lambda t: (not t.interactive, -t.priority, t.seq),
            )
            picked = eligible[:limit]
            n_start = len(picked) if start is None else min(start, len(picked))
            group = group or n_start > 1
            out = []
            for rank, t in enumerate(picked):
                starts = rank < n_start and not (group and t.run_alone)
                claimed = dataclasses.replace(
                    t,
                    status=TaskStatus.RUNNING,
                    attempts=t.attempts + 1 if starts else t.attempts,
                    lease_token=uuid.uuid4().hex,
                    lease_expires_at=now + lease_s,
                    worker_id=worker_id,
                    started_at=now if starts else None,
                    started_in_group=starts and group,
                )
                self._tasks[t.id] = claimed
                out.append(copy.deepcopy(claimed))
            return out

    def start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        with self._lock:
            return self._start(tasks, group)

    def _start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        started = []
        group = group or len(tasks) > 1
        for task_id, token in tasks:
            t = self._holder(task_id, token)
            if t is not None and t.started_at is None and not (group and t.run_alone):
                self._tasks[task_id] = dataclasses.replace(
                    t, attempts=t.attempts + 1, started_at=self._clock(), started_in_group=group
                )
                started.append(task_id)
        return started

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

    def finish(
        self, task_id: str, token: str, result: Any, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        encoded = json.dumps(result, allow_nan=False)
        return self._end(
            task_id, token, then_start, status=TaskStatus.SUCCEEDED, result=json.loads(encoded)
        )

    def finish_many(
        self, done: Sequence[Finished], then_start: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        with self._lock:
            self._start(then_start)
            committed = []
            now = self._clock()
            for d in done:
                t = self._holder(d.task_id, d.token)
                if t is None:
                    continue
                self._tasks[d.task_id] = dataclasses.replace(
                    t,
                    status=TaskStatus.SUCCEEDED,
                    result=json.loads(d.result_json),
                    lease_token=None,
                    lease_expires_at=None,
                    finished_at=now,
                )
                self._freed(t)
                committed.append(d.task_id)
            return committed

    def _end(
        self,
        task_id: str,
        token: str,
        then_start: Sequence[tuple[str, str]],
        status: TaskStatus,
        **changes: Any,
    ) -> bool:
        """End a held task's attempt with `status` (starting `then_start` first); False if the
        lease was lost."""
        with self._lock:
            self._start(then_start)
            t = self._holder(task_id, token)
            if t is None:
                return False
            self._tasks[task_id] = dataclasses.replace(
                t,
                status=status,
                lease_token=None,
                lease_expires_at=None,
                finished_at=self._clock(),
                **changes,
            )
            self._freed(t)
            return True

    def fail(
        self,
        task_id: str,
        token: str,
        error: str,
        retry_in_s: float | None,
        then_start: Sequence[tuple[str, str]] = (),
    ) -> bool:
        with self._lock:
            self._start(then_start)
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
            self._freed(t)
            return True

    def release(self, task_id: str, token: str) -> bool:
        with self._lock:
            t = self._holder(task_id, token)
            if t is None:
                return False
            self._tasks[task_id] = dataclasses.replace(
                t,
                status=TaskStatus.QUEUED,
                attempts=t.attempts - (t.started_at is not None),
                lease_token=None,
                lease_expires_at=None,
                worker_id=None,
                started_at=None,
                started_in_group=False,
            )
            self._wakeups.fire()
            return True

    def acknowledge_cancel(
        self, task_id: str, token: str, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        return self._end(task_id, token, then_start, status=TaskStatus.CANCELLED)

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
                    started_in_group=False,
                    run_alone=False,
                )
                self._tasks[task_id] = t
                self._wakeups.fire()
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
                    cleared = t.id in self._cleared
                    self._cleared.discard(t.id)
                    self._tasks[t.id] = _expired(t, now, cleared)
                    moved += 1
            if moved:
                self._wakeups.fire()
            return moved

    def blame_death(self, worker_id: str, running: Sequence[tuple[str, str]]) -> int:
        with self._lock:
            mine = [
                t
                for t in self._tasks.values()
                if t.status is TaskStatus.RUNNING and t.worker_id == worker_id
            ]
            held = {(t.id, t.lease_token) for t in mine if t.started_at is not None}
            if not all(r in held for r in running):
                return 0
            blamed = {task_id for task_id, _ in running}
            for t in mine:
                if t.id in blamed:
                    self._cleared.discard(t.id)
                    self._tasks[t.id] = dataclasses.replace(t, started_in_group=False)
                elif t.started_in_group:
                    self._cleared.add(t.id)
            return len(blamed | {t.id for t in mine if t.id in self._cleared})

    def purge(self, finished_before: float, limit: int = 10_000) -> int:
        ended = (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED)
        with self._lock:
            old = sorted(
                (
                    t
                    for t in self._tasks.values()
                    if t.status in ended
                    and t.batch_id is None
                    and t.finished_at is not None
                    and t.finished_at < finished_before
                ),
                key=lambda t: t.finished_at or 0.0,
            )[:limit]
            for t in old:
                del self._tasks[t.id]
            return len(old)

    def _freed(self, t: Task) -> None:
        """A task of a serial key ended its attempt: the key's next task may run."""
        if t.serial_key is not None:
            self._wakeups.fire()

    # --- files and batches ----------------------------------------------------------------------
    def add_file(self, file: StoredFile) -> None:
        with self._lock:
            self._seq += 1
            self._files[file.id] = (self._seq, file)

    def get_file(self, file_id: str) -> StoredFile:
        with self._lock:
            if file_id not in self._files:
                raise FileNotFound(f"no file with id {file_id!r}")
            return self._files[file_id][1]

    def list_files(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 100,
        order: Literal["asc", "desc"] = "desc",
    ) -> list[StoredFile]:
        sign = 1 if order == "asc" else -1
        with self._lock:
            if after is not None and after not in self._files:
                return []
            start = sign * self._files[after][0] if after is not None else None
            rows = sorted(self._files.values(), key=lambda x: sign * x[0])
            return [
                f
                for seq, f in rows
                if (purpose is None or f.purpose == purpose)
                and (start is None or sign * seq > start)
            ][:limit]

    def delete_file(self, file_id: str) -> StoredFile:
        with self._lock:
            if file_id not in self._files:
                raise FileNotFound(f"no file with id {file_id!r}")
            return self._files.pop(file_id)[1]

    def create_batch(self, batch: Batch, tasks: Iterable[NewTask]) -> Batch:
        tasks = list(tasks)
        payloads = [t.payload_json() for t in tasks]
        with self._lock:
            if batch.idempotency_key is not None:
                for b in self._batches.values():
                    if b.idempotency_key == batch.idempotency_key:
                        return copy.deepcopy(b)
            self._seq += 1
            stored = dataclasses.replace(batch, seq=self._seq, data=copy.deepcopy(batch.data))
            self._batches[batch.id] = stored
            self._add(tasks, payloads)
        if tasks:
            self._wakeups.fire()
        return copy.deepcopy(stored)

    def start_batch(
        self, batch_id: str, status: str, data: dict[str, Any], tasks: Iterable[NewTask]
    ) -> Batch | None:
        tasks = list(tasks)
        payloads = [t.payload_json() for t in tasks]
        with self._lock:
            b = self._batches.get(batch_id)
            if b is None:
                raise BatchNotFound(f"no batch with id {batch_id!r}")
            if b.status != "validating":
                return None
            b = self._batches[batch_id] = dataclasses.replace(
                b, status=status, data=copy.deepcopy(data)
            )
            self._add(tasks, payloads)
        if tasks:
            self._wakeups.fire()
        return copy.deepcopy(b)

    def get_batch(self, batch_id: str) -> Batch:
        with self._lock:
            if batch_id not in self._batches:
                raise BatchNotFound(f"no batch with id {batch_id!r}")
            return copy.deepcopy(self._batches[batch_id])

    def list_batches(
        self, after: str | None = None, limit: int = 100, status: Sequence[str] | None = None
    ) -> list[Batch]:
        with self._lock:
            below = self._batches[after].seq if after in self._batches else None
            rows = sorted(self._batches.values(), key=lambda b: -b.seq)
            return copy.deepcopy(
                [
                    b
                    for b in rows
                    if (below is None or b.seq < below) and (status is None or b.status in status)
                ][:limit]
            )

    def update_batch(
        self, batch_id: str, status: str, data: dict[str, Any], expect: Sequence[str]
    ) -> Batch | None:
        with self._lock:
            b = self._batches.get(batch_id)
            if b is None:
                raise BatchNotFound(f"no batch with id {batch_id!r}")
            if b.status not in expect:
                return None
            b = self._batches[batch_id] = dataclasses.replace(
                b, status=status, data=copy.deepcopy(data)
            )
            return copy.deepcopy(b)

    def batch_counts(self, batch_id: str) -> dict[TaskStatus, int]:
        with self._lock:
            out: dict[TaskStatus, int] = {}
            for t in self._tasks.values():
                if t.batch_id == batch_id:
                    out[t.status] = out.get(t.status, 0) + 1
            return out

    def batch_tasks(self, batch_id: str, after_seq: int = 0, limit: int = 1000) -> list[Task]:
        with self._lock:
            rows = sorted(
                (t for t in self._tasks.values() if t.batch_id == batch_id and t.seq > after_seq),
                key=lambda t: t.seq,
            )
            return copy.deepcopy(rows[:limit])

    def cancel_batch(self, batch_id: str) -> int:
        with self._lock:
            now = self._clock()
            n = 0
            for t in list(self._tasks.values()):
                if t.batch_id != batch_id:
                    continue
                if t.status is TaskStatus.QUEUED:
                    self._tasks[t.id] = dataclasses.replace(
                        t, status=TaskStatus.CANCELLED, finished_at=now
                    )
                elif t.status is TaskStatus.RUNNING:
                    self._tasks[t.id] = dataclasses.replace(t, cancel_requested=True)
                else:
                    continue
                n += 1
        self._wakeups.fire()  # workers drop the cancelled lines from their schedule now
        return n

    # --- reads --------------------------------------------------------------------------------
    def _get(self, task_id: str) -> Task:
        t = self._tasks.get(task_id)
        if t is None:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return t

    def get(self, task_id: str) -> Task:
        with self._lock:
            return copy.deepcopy(self._get(task_id))

    def worker_seen(self, worker_id: str, models: Sequence[str], url: str | None = None) -> None:
        with self._lock:
            self._workers[worker_id] = (list(models), self._clock(), url)

    def worker_gone(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)
            self._residency.pop(worker_id, None)

    def set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        with self._lock:
            now = self._clock()
            self._residency[worker_id] = [
                Residency(worker_id, dev, m, st, now) for dev, m, st in resident
            ]

    def residency(self, seen_after: float) -> list[Residency]:
        with self._lock:
            rows = [r for rs in self._residency.values() for r in rs if r.seen_at > seen_after]
        return sorted(rows, key=lambda r: (r.worker_id, r.model))

    def workers(self, seen_after: float) -> dict[str, list[str]]:
        with self._lock:
            return {
                w: list(models)
                for w, (models, seen_at, _) in sorted(self._workers.items())
                if seen_at > seen_after
            }

    def nodes(self, seen_after: float) -> dict[str, str]:
        with self._lock:
            return {
                w: url
                for w, (_, seen_at, url) in sorted(self._workers.items())
                if seen_at > seen_after and url is not None
            }

    def list(
        self,
        status: TaskStatus | None = None,
        model: str | None = None,
        limit: int = 100,
        full: bool = True,
    ) -> list[Task]:
        with self._lock:
            rows = [
                t
                for t in self._tasks.values()
                if (status is None or t.status is status) and (model is None or t.model == model)
            ]
            rows.sort(key=lambda t: -t.seq)
            if not full:
                return [dataclasses.replace(t, payload=None, result=None) for t in rows[:limit]]
            return copy.deepcopy(rows[:limit])

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._lock:
            out: dict[str, dict[TaskStatus, int]] = {}
            for t in self._tasks.values():
                per = out.setdefault(t.model, {})
                per[t.status] = per.get(t.status, 0) + 1
            return out

    def ping(self) -> None:
        pass  # always here

    def close(self) -> None:
        pass


def _expired(t: Task, now: float, cleared: bool = False) -> Task:
    """A running task whose lease ran out: what `reclaim_expired` makes of it. `cleared`: its
    worker's last words showed it was not running (see `blame_death`)."""
    t = dataclasses.replace(t, lease_token=None, lease_expires_at=None)
    if t.cancel_requested:
        return dataclasses.replace(t, status=TaskStatus.CANCELLED, finished_at=now)
    if t.started_at is None:  # reserved, never started: no attempt was used
        return dataclasses.replace(t, status=TaskStatus.QUEUED, worker_id=None)
    if t.started_in_group:  # any task of its group may have killed the worker: not counted
        error = grouped_expiry(t.worker_id, cleared)
        entry = {"attempt": t.attempts, "error": error, "at": now, "counted": False}
        return dataclasses.replace(
            t,
            status=TaskStatus.QUEUED,
            worker_id=None,
            attempts=t.attempts - 1,
            started_in_group=False,
            run_alone=t.run_alone or not cleared,
            error=error,
            errors=[*t.errors, entry],
        )
    error = f"lease expired on worker {t.worker_id} (worker died or stalled)"
    errors = [*t.errors, {"attempt": t.attempts, "error": error, "at": now}]
    if t.attempts >= t.max_attempts:
        return dataclasses.replace(
            t, status=TaskStatus.FAILED, finished_at=now, error=error, errors=errors
        )
    return dataclasses.replace(
        t, status=TaskStatus.QUEUED, worker_id=None, error=error, errors=errors
    )
