"""Value types shared by the core and its adapters."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class RequestState(enum.Enum):
    NEW = "new"  # created, not yet seen by the scheduler
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


class Lifecycle(enum.Enum):
    """Where a model copy is. Allowed moves are in `TRANSITIONS`. A sleeping copy holds no room
    on its device (its server stays, its weights in host memory or dropped) and wakes only
    there."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    SLEEPING = "sleeping"
    WAKING = "waking"


TRANSITIONS: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.UNLOADED: frozenset({Lifecycle.LOADING}),
    Lifecycle.LOADING: frozenset({Lifecycle.READY, Lifecycle.UNLOADED}),  # done / failed
    Lifecycle.READY: frozenset({Lifecycle.UNLOADED, Lifecycle.SLEEPING}),  # evicted / slept
    Lifecycle.SLEEPING: frozenset({Lifecycle.WAKING, Lifecycle.UNLOADED}),  # woken / stopped
    Lifecycle.WAKING: frozenset({Lifecycle.READY, Lifecycle.UNLOADED}),  # done / failed
}
# Copies that hold room on their device (the rest are unloaded or asleep).
ON_DEVICE = frozenset({Lifecycle.LOADING, Lifecycle.READY, Lifecycle.WAKING})


class Grant(Protocol):
    """Who hears a request's outcome: the adapter that submitted it. Where adapters share one
    scheduler (`corral serve`: the gateway's clients and the batch worker's lines), the runtime
    doing the effects passes each dispatch and rejection to the request's own grant, so no
    runtime asks who submitted a request."""

    def granted(self, request: Request) -> None:
        """`request` may run now, on the copy of its model on `request.device`."""

    def refused(self, request: Request, reason: str) -> None:
        """`request` will never run: `reason` says why."""


class Request:
    """One unit of work for one model.

    Adapters create it with `model`, `priority`, its service class, an opaque `id`, its
    `principal` and the `grant` to tell of its outcome (None where the `Effects` themselves
    hear it); the scheduler stamps `seq` (arrival order), `arrived_at`, `dispatched_at`,
    `device` (which copy of the model serves it), `swaps_waited` and `state`. Subclass it to
    carry payloads.

    The class: `background=False` is interactive (someone is waiting: gateway requests),
    `background=True` is batch work, in the background (Batch API lines, queue tasks by
    default). Interactive work of any model
    goes before batch work of any model; `priority` orders requests inside their class.
    """

    __slots__ = (
        "arrived_at",
        "background",
        "charged_s",
        "context_tokens",
        "conversation",
        "device",
        "dispatched_at",
        "finished_at",
        "grant",
        "id",
        "level",
        "model",
        "prefill_s",
        "prefill_tokens",
        "principal",
        "priority",
        "seq",
        "state",
        "swaps_waited",
    )

    def __init__(
        self,
        id: object,
        model: str,
        priority: int = 0,
        background: bool = False,
        grant: Grant | None = None,
        principal: str | None = None,
    ) -> None:
        self.id = id
        # Whose work it is (a principal's name; None: anonymous): fair shares inside a class
        # are kept between principals (core/shares.py).
        self.principal = principal
        self.charged_s = 0.0  # device-seconds charged to its principal so far
        self.grant = grant
        self.model = model
        self.priority = priority
        self.background = background
        self.level = 0  # its queue level, stamped by the scheduler (see core/state.py)
        self.seq = 0
        self.arrived_at = 0.0
        self.dispatched_at: float | None = None
        self.device: str | None = None  # the device whose copy of the model serves it
        self.finished_at: float | None = None
        self.state = RequestState.NEW
        # Loads begun (on any device) between its arrival and its dispatch: on one device, the
        # swaps it waited for. Stamped by the scheduler; tests and clients read it.
        self.swaps_waited = 0
        # Set by the adapter before the request ends, where it knows them (core/conversations.py):
        # the conversation it belongs to, the tokens of its prompt (its context), and the tokens
        # its server prefilled for it and how long that took.
        self.conversation: str | None = None
        self.context_tokens = 0
        self.prefill_tokens = 0
        self.prefill_s = 0.0

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id!r}, model={self.model!r}, priority={self.priority}, "
            f"class={'batch' if self.background else 'interactive'}, seq={self.seq}, "
            f"state={self.state.value})"
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """A committed swap or unload, kept in the scheduler's recent-decisions log. `model` is the
    model loaded (or woken), or None for an unload with nothing loaded in its place."""

    at_s: float
    model: str | None
    device: str
    evict: tuple[str, ...]
    reason: str
    asleep: tuple[str, ...] = ()  # put to sleep rather than evicted
    woke: bool = False  # `model` was asleep there: a wake, not a load
