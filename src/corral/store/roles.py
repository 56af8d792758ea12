"""The store's roles: the Protocols every adapter implements (memory, SQLite, PostgreSQL),
and their combinations for parts that use two or three. The tasks (`TaskQueue`, `TaskControl`)
are the store's own methods; the other roles are its attributes (`files`, `batches`,
`members`, `schema`). A part that uses one role takes that one (`store.members`, not the
store); the whole `Store` is left to the few that compose the others: the worker, the Batch
API's runtime, the CLI's maintenance.

Semantics every adapter shares (tests/contract holds the one suite they all pass):
- `claim` takes queued tasks of one model whose `run_after` has come, interactive before batch,
  then highest priority first, then oldest; it never hands out two tasks with the same
  `serial_key` at once, and within a serial key only the oldest queued task is eligible (FIFO
  per key, even across retries).
- A claim gives each task a fresh `lease_token` and an expiry; every later write by the worker
  (`heartbeat`, `finish`, `fail`, `release`, `acknowledge_cancel`) must present that token, so a
  worker whose lease was lost (and whose task was re-claimed) can never commit: execution is
  at-least-once, commit exactly-once.
- A claim may *reserve* tasks beyond those that start now (`claim(..., start=n)`): a reserved
  task is held under the lease (`status` running, `started_at` None) but its attempt is not
  counted until it starts, with `start` or piggy-backed on the previous commit (`then_start`),
  always before its handler runs. So a worker killed with reserved tasks burns no attempts for
  them, while a task whose handler kills the worker still runs out of attempts.
- Tasks started by one call together with others (a claim or `start` of several, `then_start`
  of several) are a *group*: a worker runs them one after another and commits them together
  (`finish_many`). If its lease expires, a grouped task gets that attempt back (the worker died,
  and any task of the group may have killed it) and is marked `run_alone`. A `run_alone` task is
  never started in a group (a call starting several leaves it reserved; start it by itself), so
  a task that kills its worker runs out of attempts alone, and its neighbours lose none.
- Unless the dead worker's last words are known: a worker on the same host reads which tasks
  were running when it died (`corral.worker.last_words`) and calls `blame_death`. Those tasks
  then count the attempt as tasks started alone do; the rest of its groups get theirs back and
  are not marked `run_alone` (they were not running, so none of them killed it).
- `reclaim_expired` returns tasks whose lease ran out to the queue (or fails them when out of
  attempts; reserved and grouped ones always go back, cancelled-while-running ones end
  cancelled).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from corral.store.base import (
    AuditEntry,
    Batch,
    Finished,
    Lease,
    Level,
    NewTask,
    Residency,
    StoredFile,
    Task,
    TaskStatus,
    UsageRow,
)


class TaskQueue(Protocol):
    """A worker's side of the tasks: submitting, claiming, running and committing them, and
    hearing of new ones."""

    def enqueue(self, task: NewTask) -> str:
        """Store one queued task; returns its id."""
        ...

    def enqueue_many(self, tasks: Sequence[NewTask], max_queued: int | None = None) -> list[str]:
        """Store many queued tasks in one transaction (all or none); returns their ids.
        `max_queued` (the tasks are then all of one kind and model): raise `QueueFull`, storing
        nothing, if that kind would hold more queued tasks than this; checked atomically."""
        ...

    def claim(
        self,
        model: str,
        worker_id: str,
        limit: int,
        lease_s: float,
        start: int | None = None,
        group: bool = False,
    ) -> builtins.list[Task]:
        """Atomically take up to `limit` eligible tasks of `model` (see the module docstring),
        best first. The first `start` of them (default: all) start now; the rest are reserved.
        Several started are a group; `group`: those started join a run the worker has already
        started, so even one is (a `run_alone` task is then left reserved)."""
        ...

    def start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        """Start reserved tasks, given as (id, lease token): count their attempt. Returns the
        ids started (a task whose lease was lost is left alone). Several are a group, and so is
        one if `group` (see `claim`)."""
        ...

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        """Extend the lease if `token` still holds it."""
        ...

    def finish(
        self, task_id: str, token: str, result: Any, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        """Commit success; False (nothing written) if the lease was lost. `then_start`: reserved
        tasks to start in the same transaction (as `start`), whatever the commit's outcome."""
        ...

    def finish_many(
        self, done: Sequence[Finished], then_start: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        """Commit several successes in one transaction (group commit), each fenced by its own
        lease token as in `finish`; returns the ids committed (a task whose lease was lost is
        left alone). `then_start` as in `finish`."""
        ...

    def fail(
        self,
        task_id: str,
        token: str,
        error: str,
        retry_in_s: float | None,
        then_start: Sequence[tuple[str, str]] = (),
    ) -> bool:
        """Record a failed attempt: back to the queue after `retry_in_s` while attempts remain
        (None: fail for good). False if the lease was lost. `then_start` as in `finish`."""
        ...

    def release(self, task_id: str, token: str) -> bool:
        """Give a claimed (started or reserved) task back untouched; the attempt does not
        count."""
        ...

    def acknowledge_cancel(
        self, task_id: str, token: str, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        """The worker stopped a task whose cancellation was requested: mark it cancelled.
        `then_start` as in `finish`."""
        ...

    # True when `subscribe` also hears of work added by other processes (PostgreSQL's
    # LISTEN/NOTIFY), so an idle worker may poll rarely.
    wakes_other_processes: bool
    # Names the database in files a worker keeps about it on this host (its last words); None
    # where no other process can share it.
    identity: str | None

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` (from any thread) soon after tasks may have become claimable: enqueued,
        released, retried, reclaimed, or a serial key freed. Through this store object always;
        through other processes too where `wakes_other_processes`. Returns the unsubscribe."""
        ...


class TaskControl(Protocol):
    """Reading and steering tasks: what is there, cancelling, retrying, reclaiming expired
    leases, blaming a dead worker, purging."""

    def get(self, task_id: str) -> Task:
        """The task, or `TaskNotFound`."""
        ...

    def list(
        self,
        status: TaskStatus | None = None,
        model: str | None = None,
        limit: int = 100,
        full: bool = True,
    ) -> builtins.list[Task]:
        """Tasks, newest first, optionally filtered; `full=False`: without their payloads and
        results (None), which are then never read, however large."""
        ...

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        """Tasks per model and status."""
        ...

    def ready_counts(self) -> dict[str, dict[Level, int]]:
        """Tasks `claim` could take right now, per model and level (class, priority), serial keys
        and `run_after` respected: what a worker's scheduler should see as waiting."""
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

    def blame_death(self, worker_id: str, running: Sequence[tuple[str, str]]) -> int:
        """Worker `worker_id` died (its process is gone) while running the tasks `running`, as
        (id, lease token): when their leases expire, those count the attempt (as tasks started
        alone do), and its other grouped tasks get theirs back without being marked
        `run_alone`. Changes nothing, and returns 0, unless every one of `running` is still
        running under that worker and token (a stale record leaves the group rule in force);
        returns how many tasks it settled. Idempotent."""
        ...

    def purge(self, finished_before: float, limit: int = 10_000) -> int:
        """Delete up to `limit` tasks that finished (succeeded, failed or cancelled) before
        `finished_before` (epoch seconds), oldest first; a batch's lines only once the batch
        has ended (completed, failed, expired, cancelled: its counts and files are written);
        returns how many were deleted."""
        ...


class Membership(Protocol):
    """The workers and nodes on this store, and the models each holds (cluster.md)."""

    def worker_seen(self, worker_id: str, models: Sequence[str], url: str | None = None) -> None:
        """Record that worker `worker_id` is alive and serves `models` (now); `url`: where a
        `corral serve` node is reached by the others (None: a plain worker)."""
        ...

    def worker_gone(self, worker_id: str) -> None:
        """Forget the worker and what it held (it stopped cleanly)."""
        ...

    def set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        """Replace what worker `worker_id` holds with `resident`, (device, model, state) each,
        stamped now; a worker calls it on every load and unload and with each `worker_seen`.
        A dead worker's rows age out: readers pass `seen_after`."""
        ...

    def residency(self, seen_after: float) -> builtins.list[Residency]:
        """Models held by workers that said so after `seen_after`, by worker and model."""
        ...

    def workers(self, seen_after: float) -> dict[str, builtins.list[str]]:
        """Workers seen after `seen_after` (epoch seconds), each with the models it serves."""
        ...

    def nodes(self, seen_after: float) -> dict[str, str]:
        """The workers seen after `seen_after` that said a `url` (`corral serve` nodes), each
        with it."""
        ...


class Audit(Protocol):
    """The audit log: admin actions and key changes (docs/design/access.md)."""

    def record(
        self,
        principal: str,
        action: str,
        target: str,
        detail: str = "",
        at: float | None = None,
        once: bool = False,
    ) -> None:
        """Keep that `principal` did `action` on `target` at `at` (default now); `once`: an
        event with one occurrence (a key made or revoked), kept once however often told."""
        ...

    def list(self, since: float = 0.0, limit: int = 100) -> builtins.list[AuditEntry]:
        """The newest entries at or after `since`, newest first, at most `limit`."""
        ...


class FileStore(Protocol):
    """The Batch API's files (their records: the bytes live on disk)."""

    def add(self, file: StoredFile) -> None:
        """Record a file whose bytes are already at `file.path`."""
        ...

    def get(self, file_id: str) -> StoredFile:
        """The file's record, or `FileNotFound`."""
        ...

    def list(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 100,
        order: Literal["asc", "desc"] = "desc",
        owner: str | None = None,
    ) -> builtins.list[StoredFile]:
        """Files newest first (`order="asc"`: oldest first); `after`: only those past that file
        id in that order (none if no file has that id); `owner`: only that principal's."""
        ...

    def delete(self, file_id: str) -> StoredFile:
        """Forget the file (the caller removes its bytes); `FileNotFound` if there is none."""
        ...


class BatchStore(Protocol):
    """The Batch API's batches, whose lines are tasks."""

    def create(self, batch: Batch, tasks: Iterable[NewTask]) -> Batch:
        """Store `batch` and its line tasks in one transaction (`tasks` may be a generator: it
        is consumed in chunks, so a large batch never sits in memory whole). With an
        `idempotency_key` that an earlier batch has, store nothing and return that batch."""
        ...

    def start(
        self, batch_id: str, status: str, data: dict[str, Any], tasks: Iterable[NewTask]
    ) -> Batch | None:
        """Move a `validating` batch to `status` with `data` and store its line tasks, in one
        transaction (`tasks` consumed in chunks, as in `create`); None, storing nothing,
        if the batch is no longer `validating` (cancelled meanwhile, or started by another
        process). `BatchNotFound` if there is none."""
        ...

    def get(self, batch_id: str) -> Batch:
        """The batch, or `BatchNotFound`."""
        ...

    def list(
        self,
        after: str | None = None,
        limit: int = 100,
        status: Sequence[str] | None = None,
        owner: str | None = None,
    ) -> builtins.list[Batch]:
        """Batches newest first; `after`: only those older than that batch id; `status`: only
        those in one of these statuses; `owner`: only that principal's."""
        ...

    def update(
        self, batch_id: str, status: str, data: dict[str, Any], expect: Sequence[str]
    ) -> Batch | None:
        """Set the batch's status and data if its status is one of `expect` (compare and set);
        None if it was not. `BatchNotFound` if there is no such batch."""
        ...

    def starts(self, models: Iterable[str], owner: str | None, priority: int) -> dict[str, float]:
        """Per model, the turn after which a new batch of `owner`'s lines of the batch class
        at `priority` take their places (`NewTask.turn`): where the model's queued work of that
        class stands now, or after the owner's own lines queued before, whichever is later.
        Line k of the batch (from 1) on a model then goes at its start + k / the owner's
        weight, so owners' batches interleave by weight instead of running one after the
        other."""
        ...

    def counts(self, batch_id: str) -> dict[TaskStatus, int]:
        """The batch's tasks per status."""
        ...

    def tasks(self, batch_id: str, after_seq: int = 0, limit: int = 1000) -> builtins.list[Task]:
        """The batch's tasks in line order (seq), those after `after_seq`."""
        ...

    def cancel(self, batch_id: str) -> int:
        """Cancel the batch's unfinished tasks: queued ones at once, running ones are flagged
        for their worker. Returns how many were queued or running."""
        ...


class Schema(Protocol):
    """The database's schema: numbered migrations (store/migrations.sql)."""

    def version(self) -> int:
        """The version the database is at (0: none yet)."""
        ...

    def check(self) -> None:
        """The schema must be this code's: `SchemaTooNew` if ahead, `StoreError` if behind
        (`corral db upgrade`). Writes nothing."""
        ...

    def upgrade(self) -> builtins.list[int]:
        """Apply pending migrations, each in its own transaction; returns the versions
        applied. `SchemaTooNew` if the database is ahead of this code."""
        ...


class UsageBook(Protocol):
    """Usage per hour, principal and model, kept across restarts (access/usage.py)."""

    def add(self, rows: Sequence[UsageRow]) -> None:
        """Add each row's figures to what is kept for its (hour, principal, model), in one
        transaction."""
        ...

    def since(self, hour: int) -> builtins.list[UsageRow]:
        """Every row of the hours from `hour` on, oldest first."""
        ...

    def forget_before(self, hour: int) -> int:
        """Delete the rows of hours before `hour`; returns how many."""
        ...


class Store(TaskQueue, TaskControl, Protocol):
    """The tasks themselves (`TaskQueue`, `TaskControl`) and the other roles as attributes, as
    the stores implement them (memory, SQLite, PostgreSQL). Every method is one atomic
    transaction; none blocks beyond the busy timeout. Times are seconds since the epoch from the
    store's clock. A part that needs one role takes that role: `store.files`, not the store."""

    @property
    def files(self) -> FileStore: ...

    @property
    def batches(self) -> BatchStore: ...

    @property
    def members(self) -> Membership: ...

    @property
    def audit(self) -> Audit: ...

    @property
    def usage(self) -> UsageBook: ...

    @property
    def schema(self) -> Schema: ...

    def ping(self) -> None:
        """Check, within about `connect_timeout_s` and without retrying, that the database
        answers; raises `StoreUnavailable` (saying why) if not. For health checks."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


class Reachable(Protocol):
    """Whether the database answers (a health check)."""

    def ping(self) -> None: ...


class TaskWork(TaskQueue, TaskControl, Protocol):
    """Running tasks and reading one back (the worker's executor; a dead worker's last words)."""


class Liveness(TaskControl, Protocol):
    """Saying this worker is alive, and reading what waits that nobody serves."""

    @property
    def members(self) -> Membership: ...


class BatchFiles(Protocol):
    """Batches and their files (ending a batch)."""

    @property
    def files(self) -> FileStore: ...

    @property
    def batches(self) -> BatchStore: ...


class BatchWork(TaskControl, Protocol):
    """Batches, their files and their lines' counts (the Batch API's service)."""

    @property
    def files(self) -> FileStore: ...

    @property
    def batches(self) -> BatchStore: ...
