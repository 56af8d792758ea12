"""Value types shared by the core and its adapters."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestState(enum.Enum):
    NEW = "new"  # created, not yet seen by the scheduler
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


class Lifecycle(enum.Enum):
    """Where a model is. Allowed moves are in `TRANSITIONS`."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"


TRANSITIONS: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.UNLOADED: frozenset({Lifecycle.LOADING}),
    Lifecycle.LOADING: frozenset({Lifecycle.READY, Lifecycle.UNLOADED}),  # done / failed
    Lifecycle.READY: frozenset({Lifecycle.UNLOADED}),  # evicted
}


class Request:
    """One unit of work for one model.

    Adapters create it with `model`, `priority` and an opaque `id`; the scheduler stamps `seq`
    (arrival order), `arrived_at`, `dispatched_at` and `state`. Subclass it to carry payloads.
    """

    __slots__ = (
        "arrived_at",
        "dispatched_at",
        "finished_at",
        "id",
        "model",
        "priority",
        "seq",
        "state",
    )

    def __init__(self, id: object, model: str, priority: int = 0) -> None:
        self.id = id
        self.model = model
        self.priority = priority
        self.seq = 0
        self.arrived_at = 0.0
        self.dispatched_at: float | None = None
        self.finished_at: float | None = None
        self.state = RequestState.NEW

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id!r}, model={self.model!r}, priority={self.priority}, "
            f"seq={self.seq}, state={self.state.value})"
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """A committed swap or unload, kept in the scheduler's recent-decisions log. `model` is the
    model loaded, or None for an unload with nothing loaded in its place."""

    at_s: float
    model: str | None
    device: str
    evict: tuple[str, ...]
    reason: str
