"""The board: what one scheduler knows of its models and devices, owned in one place.

The records (`ModelRecord`, `DeviceRecord`), which models have pending work (in the order it
came), which models' room is being freed for them (`incoming`), and the arrival order that
strict-order policies read. Every part of the core reads these through the board; only the
board adds and removes pending work, so "a model with pending work" has one owner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from corral.config import Config
from corral.core.shares import Shares
from corral.core.state import DeviceRecord, ModelRecord, first_pending
from corral.core.types import Request, RequestState


class Board:
    """The records of one scheduler. `weight(priority)`: a request's weight in its model's
    queue (the policy's, computed once per priority); `strict`: keep the arrival order (the
    policy serves the oldest request of all first). `shares`: the principals' fair shares,
    told of every request that becomes pending and every one that leaves unserved."""

    def __init__(
        self,
        config: Config,
        classes: bool,
        weight: Callable[[int], float],
        strict: bool,
        shares: Shares,
    ) -> None:
        self.classes = classes
        self.shares = shares
        self.models: dict[str, ModelRecord] = {}
        for name, spec in config.models.items():
            self.record(name, ModelRecord(name, spec, classes))
        self.devices: list[DeviceRecord] = [DeviceRecord(d) for d in config.devices]
        # Models with pending work, in the order their first pending request came (a dict as
        # an ordered set: the parts iterate it every decision).
        self.pending: dict[ModelRecord, None] = {}
        self.incoming: set[ModelRecord] = set()  # models whose room is being freed (draining)
        self._arrivals: deque[Request] = deque()  # pending requests in arrival order (lazy)
        self._strict = strict
        self._policy_weight = weight
        self._weights: dict[int, float] = {}

    def record(self, name: str, m: ModelRecord) -> None:
        """Keep `m` as model `name`'s record (its queue served by the board's shares)."""
        m.shares = self.shares
        self.models[name] = m

    def weight(self, priority: int) -> float:
        w = self._weights.get(priority)
        if w is None:
            w = self._weights[priority] = self._policy_weight(priority)
        return w

    def add(self, m: ModelRecord, r: Request) -> None:
        """Pending request `r` joins model `m`'s queue."""
        m.enqueue(r, self.weight(r.priority))
        self.shares.arrived(r)
        if m.count == 1:
            self.pending[m] = None
        if self._strict:
            self._arrivals.append(r)

    def take(self, q: ModelRecord, r: Request) -> None:
        """`r` leaves queue `q` to run."""
        q.take(r, self.weight(r.priority))
        if q.count == 0:
            del self.pending[q]

    def drop(self, r: Request, state: RequestState) -> None:
        """Pending `r` leaves its queue without running (cancelled or rejected)."""
        m = self.models[r.model]
        r.state = state
        m.discard(r, self.weight(r.priority))
        self.shares.left(r)
        if m.count == 0:
            del self.pending[m]

    def head(self) -> Request | None:
        """The oldest pending request of all (kept for strict-order policies only)."""
        return first_pending(self._arrivals)

    def residents(self) -> Iterator[ModelRecord]:
        for d in self.devices:
            yield from d.residents

    def one_at_a_time(self) -> bool:
        """One device that holds one model at a time: arrival checks take the O(1) path."""
        return len(self.devices) == 1 and all(
            self.devices[0].size_of(m) >= self.devices[0].capacity for m in self.models.values()
        )
