"""The task store's contract: types, errors and the `Store` Protocol every adapter implements.

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
import enum
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from corral.errors import CorralError
from corral.limits import PRIORITY_MAX, PRIORITY_MIN

Level = tuple[bool, int]
"""A task's place in claim order: (interactive, priority); higher goes first."""


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


class StoreUnavailable(StoreError):
    """The database could not be reached for the store's patience (a dropped connection, a
    restart, a cut network path). The message says whether the operation may have taken effect;
    a worker waits and goes on, a front door answers 503."""


class QueueFull(StoreError):
    """A bounded kind already holds its `max_queued` queued tasks: submit later."""

    @classmethod
    def of(cls, kind: str, queued: int, adding: int, max_queued: int) -> QueueFull:
        more = f", and {adding} more were submitted" if adding > 1 else ""
        return cls(
            f"task kind {kind!r} is full: {queued} queued, max_queued is {max_queued}{more}; "
            "submit again once workers have drained some (or raise max_queued)"
        )


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
    interactive: bool = False  # its service class: interactive, else batch (the scheduler's)
    # The payload already as JSON text (the caller vouches for it): stored as it is, sparing a
    # parse and a dump per task when the text comes from a file (a batch's lines).
    payload_raw: str | None = None

    def payload_json(self) -> str:
        """The payload as JSON, or `BadTask` naming what cannot be serialised."""
        if not self.kind:
            raise BadTask("kind must be a non-empty handler name")
        if not self.model:
            raise BadTask("model must be a non-empty model name")
        if self.max_attempts < 1:
            raise BadTask(f"max_attempts must be >= 1; got {self.max_attempts}")
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise BadTask(
                f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}; "
                f"got {self.priority}"
            )
        if self.payload_raw is not None:
            return self.payload_raw
        return payload_text(self.kind, self.payload, MAX_PAYLOAD_BYTES)


MAX_PAYLOAD_BYTES = (
    16 * 1024 * 1024
)  # the default limit on a payload's JSON (Queue: max_payload_mb)


# One encoder for every payload: `json.dumps(..., allow_nan=False)` builds a new one per call.
_ENCODER = json.JSONEncoder(allow_nan=False)


def new_ids(n: int) -> list[str]:
    """`n` fresh task ids: random (version 4) UUIDs as 32 hex digits, like `uuid4().hex`, from
    one read of the OS's randomness (a bulk enqueue of 10,000 spent a third of its own time in
    `uuid4()`)."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = bytes((b & 0x0F) | 0x40 for b in raw[6::16])  # version 4
    raw[8::16] = bytes((b & 0x3F) | 0x80 for b in raw[8::16])  # RFC 4122 variant
    hexed = raw.hex()
    return [hexed[i : i + 32] for i in range(0, 32 * n, 32)]


def payload_text(kind: str, payload: Any, max_bytes: int) -> str:
    """`payload` as JSON text, or `BadTask` saying what is wrong: not JSON, larger than
    `max_bytes`, or a value JSON would silently change (a tuple comes back as a list, a dict key
    that is not a string comes back as one)."""
    _faithful(kind, payload, "payload")
    try:
        text = _ENCODER.encode(payload)
    except (TypeError, ValueError) as exc:
        raise BadTask(f"payload of a {kind!r} task is not JSON-serialisable: {exc}") from None
    if len(text) > max_bytes:  # characters: bytes or more
        raise BadTask(
            f"payload of a {kind!r} task is {len(text) / 1048576:.1f} MB of JSON; the limit is "
            f"{max_bytes / 1048576:g} MB (max_payload_mb): keep large data elsewhere and pass "
            "its path or URL"
        )
    return text


def _faithful(kind: str, x: Any, path: str) -> None:
    t = type(x)
    if t is dict:
        for k, v in x.items():
            if type(k) is not str:
                raise BadTask(
                    f"{path} of a {kind!r} task has the key {k!r} ({type(k).__name__}); JSON keys "
                    f"are strings, so it would come back as {json.dumps(str(k))}: use string keys"
                )
            _faithful(kind, v, f"{path}[{k!r}]")
    elif t is list:
        for i, v in enumerate(x):
            _faithful(kind, v, f"{path}[{i}]")
    elif t is tuple:
        raise BadTask(
            f"{path} of a {kind!r} task is a tuple, which JSON keeps as a list (it would come "
            "back as one): pass a list"
        )


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
    interactive: bool = False
    started_in_group: bool = False  # this attempt started with others (see the module docs)
    run_alone: bool = False  # its worker died while it ran in a group: never group it again

    @property
    def level(self) -> Level:
        return (self.interactive, self.priority)


@dataclass(frozen=True, slots=True)
class Residency:
    """A model a live worker holds: `state` is "loading" or "ready"; `seen_at` when the worker
    last said so (epoch seconds)."""

    worker_id: str
    device: str
    model: str
    state: str
    seen_at: float


@dataclass(frozen=True, slots=True)
class Finished:
    """A success for `finish_many`: the result already as JSON text (`json.dumps`)."""

    task_id: str
    token: str
    result_json: str


def grouped_expiry(worker_id: str | None, cleared: bool = False) -> str:
    """The error recorded when a grouped task's lease expires (its attempt does not count).
    `cleared`: the worker's last words named the tasks it was running, and this was not one."""
    if cleared:
        return (
            f"lease expired on worker {worker_id} (the worker died) while this task waited in a "
            "group run, not running: the attempt is not counted"
        )
    return (
        f"lease expired on worker {worker_id} (worker died or stalled) while this task was in a "
        "group run with others: the attempt is not counted, and the task runs alone from now on"
    )


class FileNotFound(StoreError):
    """No stored file has that id."""


class BatchNotFound(StoreError):
    """No batch has that id."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    """An uploaded or generated file: its bytes live at `path`, its record in the store."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    path: str
    expires_at: float | None = None  # epoch seconds; None: kept until deleted


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch as stored: `status` is queryable, `data` holds the rest of its object (the Batch
    API's fields and Corral's). Its lines are tasks with `batch_id` = `id`."""

    id: str
    status: str
    created_at: float
    data: dict[str, Any]
    idempotency_key: str | None = None
    seq: int = 0


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
        `finished_before` (epoch seconds), oldest first, except a batch's lines (the batch owns
        them); returns how many were deleted."""
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
    ) -> builtins.list[StoredFile]:
        """Files newest first (`order="asc"`: oldest first); `after`: only those past that file
        id in that order (none if no file has that id)."""
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
        self, after: str | None = None, limit: int = 100, status: Sequence[str] | None = None
    ) -> builtins.list[Batch]:
        """Batches newest first; `after`: only those older than that batch id; `status`: only
        those in one of these statuses."""
        ...

    def update(
        self, batch_id: str, status: str, data: dict[str, Any], expect: Sequence[str]
    ) -> Batch | None:
        """Set the batch's status and data if its status is one of `expect` (compare and set);
        None if it was not. `BatchNotFound` if there is no such batch."""
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

    def ping(self) -> None:
        """Check, within about `connect_timeout_s` and without retrying, that the database
        answers; raises `StoreUnavailable` (saying why) if not. For health checks."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...
