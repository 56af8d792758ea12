"""Mutable per-model and per-device records owned by the scheduler (one owner, no locks)."""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from corral.config import DeviceConfig, ModelConfig
from corral.core.estimates import Estimates
from corral.core.types import ON_DEVICE, Lifecycle, Request, RequestState


class FairOrder(Protocol):
    """What a queue reads of fair shares (core/shares.py, `Shares`) to order its levels."""

    enabled: bool
    vtimes: tuple[dict[str | None, float], dict[str | None, float]]

    def before(self, overdue: Request, fair: Request) -> bool: ...


_PENDING = RequestState.PENDING
# Queue levels are one int per (class, priority): batch levels sit this far below every
# interactive one, so "interactive first, then priority" is plain integer order.
_BATCH_SHIFT = 1 << 62
_BATCH_HALF = _BATCH_SHIFT >> 1  # a level below minus this is a batch level
BATCH_BELOW = -_BATCH_HALF  # `level < BATCH_BELOW`: a batch level (inline in hot paths)


def priority_of(level: int) -> int:
    """The request priority a queue level stands for, in either class."""
    return level + _BATCH_SHIFT if level < BATCH_BELOW else level


def backlog_s(m: ModelRecord) -> float:
    """Device seconds the queued work of `m`'s model takes (all classes, at its concurrency)."""
    q = m.queue
    return q.count * q.est.service_s / q.concurrency


def first_pending(q: deque[Request]) -> Request | None:
    """The first pending request of a lazily pruned deque, dropping ended ones in front of it."""
    while q:
        r = q[0]
        if r.state is _PENDING:
            return r
        q.popleft()
    return None


class ModelRecord:
    """One model's queue, residency and running estimates.

    The queue keeps one FIFO per (service class, request priority) level and principal, so the
    next request (interactive first, then highest priority, then the principal furthest behind
    its fair share, then oldest) and the oldest request are found in O(levels x principals);
    cancelled entries leave lazily. Without fair shares (`shares` None or not enabled) a level
    is served oldest first, whoever sent it.

    Policies see the model's *top class*: its interactive work while it has any, else its batch
    work (`top_batch`). `n_top`, `w_top` and `wa_top` are that class's count, Σweight and
    Σweight·arrived_at, so a policy prices the queue it would serve next, ages included, in O(1);
    `count` is every pending request, of both classes.
    """

    __slots__ = (
        "_levels",
        "_order",
        "asked",
        "classes",
        "concurrency",
        "copies",
        "copy_failed_at",
        "count",
        "deep",
        "demand_timer_at",
        "device",
        "est",
        "icount",
        "idle_since",
        "in_flight",
        "keep_alive_s",
        "last_level",
        "linger_timer_at",
        "linger_until",
        "lingered_s",
        "load_reason",
        "load_started_at",
        "lost",
        "memory_gb",
        "name",
        "owed_return",
        "primary",
        "priority",
        "quantum_timer_at",
        "ready_at",
        "recheck",
        "rent_timer_at",
        "restarting",
        "served",
        "shares",
        "spec",
        "state",
        "used_at",
        "w_batch",
        "w_sum",
        "wa_batch",
        "wa_sum",
        "who_b",
        "who_i",
        "yielding",
    )

    def __init__(
        self,
        name: str,
        spec: ModelConfig,
        classes: bool = True,
        primary: ModelRecord | None = None,
    ) -> None:
        self.name = name
        # A second copy of a model on another device (a replica) is a record of its own with
        # its own residency and an empty queue: it serves `primary`'s queue. The primary is
        # resident whenever a copy is (a copy takes its place when it leaves).
        self.primary = primary
        self.copies: list[ModelRecord] = []
        self.copy_failed_at: float | None = None  # a replica's load failed then: wait a while
        # Evicted while its work waited: who made the load that evicted it (by count) and
        # when; its way back is theirs to pay (`payers`).
        self.owed_return: tuple[float, dict[str | None, int]] | None = None
        self.demand_timer_at: float | None = None  # when its decaying demand is looked at again
        self.classes = classes  # False: one class for all (the fifo and grouped baselines)
        self.spec = spec
        # Its size on a device (None: it fills one): the configuration's estimate, until its
        # server reports what it took once loaded (each copy; `Swaps.refit`): kept here,
        # beside the configuration, never written into it.
        self.memory_gb: float | None = spec.memory_gb
        self.priority = spec.priority
        self.concurrency = spec.concurrency
        self.state = Lifecycle.UNLOADED
        self.device: DeviceRecord | None = None
        self.in_flight = 0
        self.count = 0  # pending requests, both classes
        self.icount = 0  # ... of them interactive, as the policy sees them (all without classes)
        self.asked = 0  # ... of them sent as interactive, whatever the policy (max_queue)
        self.w_sum = 0.0  # Σweight and Σweight·arrived_at of pending interactive requests
        self.wa_sum = 0.0
        self.w_batch = 0.0  # ... and of pending batch requests
        self.wa_batch = 0.0
        # Per level, one FIFO per principal.
        self._levels: dict[int, dict[str | None, deque[Request]]] = {}
        self._order: list[int] = []  # negated levels, ascending = first to run first
        self.shares: FairOrder | None = None  # the scheduler's fair shares (core/shares.py)
        # Pending requests per principal: interactive (as the policy sees them) and batch.
        self.who_i: dict[str | None, int] = {}
        self.who_b: dict[str | None, int] = {}
        self.yielding = False  # stops taking new work: it is to make room for another model
        self.lost = False  # its server died: no new work; unloaded once in-flight work ends
        # Lost on purpose, and why ("restart": its command changed; its device overfilled): it
        # unloads the same way. Empty: not.
        self.restarting = ""
        self.served = False  # dispatched at least once since it last loaded
        self.recheck = False  # a challenger waits for this model's first round to end
        self.load_started_at = 0.0
        self.load_reason = ""  # why its current (or last) load began (Decision.reason)
        self.quantum_timer_at: float | None = None
        self.rent_timer_at: float | None = None  # a sleeper may load elsewhere from then
        self.ready_at = 0.0
        self.linger_until: float | None = None
        self.lingered_s = 0.0  # idle while resident, this visit, up to its last arrival
        self.linger_timer_at: float | None = None
        self.idle_since: float | None = None
        # Idle time before it unloads, set by a request's `keep_alive` (Ollama's API): None
        # until one does (then `spec.ttl_s`), math.inf for never.
        self.keep_alive_s: float | None = None
        self.last_level = 0  # the level of the request it dispatched last
        self.est = Estimates(spec)  # its running estimates (core/estimates.py)
        self.deep = False  # asleep (or waking) at level 2 below its configured level 1
        self.used_at = 0.0  # its last dispatch (the `lru` sleepers' order)

    def __repr__(self) -> str:
        return f"ModelRecord({self.name!r}, {self.state.value}, pending={self.count})"

    @property
    def ttl_s(self) -> float | None:
        """Idle seconds before it unloads (None: it stays)."""
        if self.spec.pin:
            return None
        ttl_s = self.spec.ttl_s if self.keep_alive_s is None else self.keep_alive_s
        return None if ttl_s is None or ttl_s == math.inf else ttl_s

    @property
    def resident(self) -> bool:
        """It holds room on its device: loading, ready or waking."""
        return self.state in ON_DEVICE

    @property
    def asleep(self) -> bool:
        return self.state is Lifecycle.SLEEPING

    @property
    def sleeps(self) -> bool:
        """Evicted, it may sleep rather than stop (its server can; replicas always stop)."""
        return self.spec.sleep is not None and self.primary is None

    @property
    def return_s(self) -> float:
        """Seconds to bring it in now: a wake if it sleeps, else a load."""
        if self.state is Lifecycle.SLEEPING:
            return self.est.wake2_s if self.deep else self.est.wake_s
        return self.est.load_s

    @property
    def leave_s(self) -> float:
        """Seconds for it to leave its device: falling asleep if it may, else an unload."""
        return self.est.sleep_s if self.sleeps else self.est.unload_s

    @property
    def comeback_s(self) -> float:
        """Seconds to bring it back once it has left: a wake if it may sleep, else a load."""
        return self.est.wake_s if self.sleeps else self.est.load_s

    @property
    def held_gb(self) -> float:
        """Host memory it holds asleep (none asleep at level 2)."""
        return 0.0 if self.deep else self.spec.host_gb_at(self.memory_gb)

    @property
    def soft_pin(self) -> bool:
        """Pinned by a request (Ollama's `keep_alive: -1`): never unloaded for idleness, and
        evicted last, only when nothing else makes room (a `pin: true` never is)."""
        return self.keep_alive_s == math.inf and not self.spec.pin

    @property
    def queue(self) -> ModelRecord:
        """The record whose queue this copy serves (itself, unless it is a replica)."""
        return self.primary or self

    def copy_on(self, device: str | None) -> ModelRecord | None:
        """This model's copy (the primary or a replica) on `device`; the primary if None."""
        if device is None or (self.device is not None and self.device.name == device):
            return self
        for c in self.copies:
            if c.device is not None and c.device.name == device:
                return c
        return None

    # --- the top class, as policies see it ---------------------------------------------------
    @property
    def top_batch(self) -> bool:
        """Its pending work is batch work only (or it has none)."""
        return self.icount == 0

    @property
    def n_top(self) -> int:
        return self.icount or self.count

    @property
    def w_top(self) -> float:
        return self.w_sum if self.icount else self.w_batch

    @property
    def wa_top(self) -> float:
        return self.wa_sum if self.icount else self.wa_batch

    # --- queue ------------------------------------------------------------------------------
    def enqueue(self, r: Request, weight: float) -> None:
        """Queue pending `r` (its `arrived_at` set); stamps `r.level`."""
        batch = r.background and self.classes
        level = r.level = r.priority - _BATCH_SHIFT if batch else r.priority
        if not r.background:
            self.asked += 1
        lv = self._levels.get(level)
        if lv is None:
            lv = self._levels[level] = {}
            insort(self._order, -level)
        q = lv.get(r.principal)
        if q is None:
            q = lv[r.principal] = deque()
        q.append(r)
        self.count += 1
        who = self.who_b if batch else self.who_i
        who[r.principal] = who.get(r.principal, 0) + 1
        if batch:
            self.w_batch += weight
            self.wa_batch += weight * r.arrived_at
        else:
            self.icount += 1
            self.w_sum += weight
            self.wa_sum += weight * r.arrived_at

    def best(self) -> Request | None:
        """The next request by the shared rule: interactive first, then highest request
        priority, then the principal furthest behind its share, then oldest."""
        for neg in self._order:
            r = _first(self._levels[-neg], self.shares)
            if r is not None:
                return r
        return None

    def oldest(self, batch: bool | None = None) -> Request | None:
        """The pending request that arrived first (of class `batch`, if given)."""
        found: Request | None = None
        for neg in self._order:
            if batch is not None and (neg > _BATCH_HALF) is not batch:
                continue
            for q in self._levels[-neg].values():
                r = first_pending(q)
                if r is not None and (found is None or r.seq < found.seq):
                    found = r
        return found

    def oldest_top(self) -> Request | None:
        """The oldest pending request of the top class."""
        return self.oldest(self.icount == 0)

    def take(self, r: Request, weight: float) -> None:
        """Remove `r`, which `best()` or `oldest()` just returned."""
        self._levels[r.level][r.principal].popleft()
        self._forget(r, weight)

    def discard(self, r: Request, weight: float) -> None:
        """Forget a pending `r` whose state the caller already changed (it leaves lazily)."""
        self._forget(r, weight)

    def _forget(self, r: Request, weight: float) -> None:
        self.count -= 1
        if not r.background:
            self.asked -= 1
        who = self.who_b if r.level < BATCH_BELOW else self.who_i
        n = who.get(r.principal, 0)
        if n > 1:
            who[r.principal] = n - 1
        else:
            who.pop(r.principal, None)
        if r.level < BATCH_BELOW:
            if self.count > self.icount:
                self.w_batch -= weight
                self.wa_batch -= weight * r.arrived_at
            else:  # reset exactly, so float drift never accumulates
                self.w_batch = self.wa_batch = 0.0
        else:
            self.icount -= 1
            if self.icount:
                self.w_sum -= weight
                self.wa_sum -= weight * r.arrived_at
            else:
                self.w_sum = self.wa_sum = 0.0

    def pending(self, limit: int | None = None) -> list[Request]:
        """Pending requests in dispatch order, the first `limit` of them (for status views;
        O(n) without a limit)."""
        out: list[Request] = []
        for neg in self._order:
            level = self._levels[-neg]
            rs: Iterator[Request] = (
                iter(next(iter(level.values())))
                if len(level) == 1
                else heapq.merge(*level.values(), key=_seq)
            )
            for r in rs:
                if r.state is _PENDING:
                    if limit is not None and len(out) >= limit:
                        return out
                    out.append(r)
        return out


def _seq(r: Request) -> int:
    return r.seq


def who_top(m: ModelRecord) -> dict[str | None, int]:
    """`m`'s pending requests of its top class, per principal."""
    return m.who_i if m.icount else m.who_b


def payers(m: ModelRecord) -> dict[str | None, int]:
    """Who pays `m`'s load that just ended: those whose load evicted it while its work waited,
    when its oldest work now waited across that eviction (the way back of their swap);
    else its top class's waiting principals (`who_top`)."""
    owed, m.owed_return = m.owed_return, None
    if owed is not None:
        oldest = m.oldest()
        if oldest is not None and oldest.arrived_at <= owed[0]:
            return owed[1]
    return who_top(m)


def next_due(
    q: ModelRecord, max_wait_s: float | None, batch_max_wait_s: float | None, now: float
) -> Request:
    """The request of `q`'s queue to dispatch next: `best()`, unless the oldest of its class
    has waited past its class's bound and its principal is not ahead of best's in fair shares
    (`Shares.before`). `q` must have pending work."""
    r = q.best()
    assert r is not None
    max_wait = batch_max_wait_s if r.level < BATCH_BELOW else max_wait_s
    if max_wait is not None:
        # The oldest of r's class (one class queued: the plain, cheaper scan).
        old = q.oldest() if q.icount == q.count else q.oldest(r.level < BATCH_BELOW)
        if (
            old is not None
            and old.arrived_at + max_wait <= now
            and (q.shares is None or q.shares.before(old, r))
        ):
            return old
    return r


def _first(level: dict[str | None, deque[Request]], shares: FairOrder | None) -> Request | None:
    """A level's next request: the least virtual time's first (ties: the oldest)."""
    if len(level) == 1:
        for q in level.values():
            return first_pending(q)
    vtime = None
    if shares is not None and shares.enabled:
        for q in level.values():  # one class per level: any request says which
            if q:
                vtime = shares.vtimes[q[0].level < BATCH_BELOW]
                break
    found: Request | None = None
    key = (0.0, 0)
    for who, q in level.items():
        r = first_pending(q)
        if r is None:
            continue
        k = (vtime.get(who, 0.0) if vtime is not None else 0.0, r.seq)
        if found is None or k < key:
            found, key = r, k
    return found


class DeviceRecord:
    """A device and the models resident on it (loading or ready)."""

    __slots__ = (
        "aborted_at",
        "capacity",
        "loading",
        "memory_gb",
        "name",
        "residents",
        "sleepers",
    )

    def __init__(self, spec: DeviceConfig) -> None:
        self.name = spec.name
        self.memory_gb = spec.memory_gb
        self.capacity = spec.memory_gb if spec.memory_gb is not None else 1.0
        self.residents: list[ModelRecord] = []
        self.sleepers: list[ModelRecord] = []  # asleep here: they hold no room, wake only here
        self.loading: ModelRecord | None = None  # loading or waking
        self.aborted_at: float | None = None  # when a load here was last aborted

    def holding(self, name: str) -> ModelRecord:
        """The resident record (primary or replica) of model `name` here."""
        return next(m for m in self.residents if m.name == name)

    def size_of(self, model: ModelRecord) -> float:
        """Room `model` takes here: its memory_gb, or the whole device when either lacks one."""
        if self.memory_gb is None or model.memory_gb is None:
            return self.capacity
        return model.memory_gb
