"""The task store's types and errors (the roles every adapter implements, and what they
promise, are in roles.py)."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any

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
    # Its place among its model's queued work of its class, in `seq`'s units (a batch line's,
    # from `BatchStore.starts`); None: its own `seq`, in arrival order.
    turn: float | None = None

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
class AuditEntry:
    """One admin action or key change: who (`principal`), what (`action`, on `target`, with
    `detail`) and when (`at`, epoch seconds)."""

    seq: int
    at: float
    principal: str
    action: str
    target: str
    detail: str


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One principal's use of one model in one hour (`hour`: its start, epoch seconds)."""

    hour: int
    principal: str
    model: str
    requests: int
    input_tokens: int
    output_tokens: int
    wait_s: float
    service_s: float
    load_s: float


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
    owner: str | None = None  # the principal that made it; None: an admin's


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
    owner: str | None = None  # the principal that made it; None: an admin's
