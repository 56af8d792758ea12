"""Replicas inside one scheduler (docs/design/scheduler.md, "Replicas in one scheduler"):
when a model wants one more copy and which copy may make room for another model: `Replicas`,
rules `Scheduler` and `Swaps` ask (`Swaps.replicate` places a copy; `Tiers.leave` hands a
leaving primary's place to a replica).

A replica is a `ModelRecord` with `primary` set: its own device, lifecycle and `in_flight`,
serving its primary's single queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

from corral.core.effects import Effects
from corral.core.placement import ResidentView
from corral.core.policies import Policy, lingering
from corral.core.state import BATCH_BELOW, DeviceRecord, ModelRecord, backlog_s
from corral.core.types import Lifecycle

_READY = Lifecycle.READY
_UNLOADED = Lifecycle.UNLOADED

# Replicas (docs/design/scheduler.md): a model gets one more copy when its arrivals outpace the
# copies it has (`Estimates.demand` above their number) and its backlog holds this many loads'
# worth of work, so the new copy starts busy.
REPLICA_LOADS = 2.0
REPLICA_BUSY = 0.9  # a replica stays while the other copies alone would be this busy
# A model its copies cannot keep up with gets its next copy ahead of the candidates once its
# oldest request has waited this fraction of `max_wait_s`, the bound capped at the default's
# 120 s: a looser bound (or none) lets other models wait longer for a turn, not the copy of a
# model whose queue only grows until it comes (devices-8 at 600 s: a mean of 69.7 s against
# 52.4 s without a bound, docs/design/scheduler.md).
OUTRUN_WAIT_FRAC = 0.5
OUTRUN_BOUND_CAP_S = 120.0
REPLICA_RETRY_S = 60.0  # after a replica failed to load, the model gets none for this long
DEMAND_TIMER = "demand:"  # timer key: a copy kept by its decaying demand is looked at again


class Replicas:
    """The replica rules of one scheduler, over the scheduler's records (it owns them): which
    copy may go, which model gets one more copy and where, and a replica taking its primary's
    place (`Tiers.leave`). `bound_s` is a class's wait bound now."""

    def __init__(
        self,
        policy: Policy,
        devices: list[DeviceRecord],
        fx: Effects,
        classes: bool,
        enabled: bool,
        copyable: Collection[str] | None,
        bound_s: Callable[[bool], float | None],
        pending: Collection[ModelRecord],
    ) -> None:
        self.policy = policy
        self.devices = devices
        self._fx = fx
        self._classes = classes
        self.enabled = enabled  # the policy makes copies, on several devices
        self._copyable = copyable  # the models that may have copies (None: all)
        self._bound_s = bound_s
        self._pending = pending  # the board's models with pending work (it owns them)

    def worth_copy(self, m: ModelRecord, now: float) -> bool:
        """Does `m` want one more copy: do its arrivals outpace its copies, with a backlog of
        REPLICA_LOADS loads' work? (O(1); at most one copy per device it may use.)"""
        n = 1 + len(m.copies)
        allowed = len(m.spec.devices) or len(self.devices)
        if n >= allowed or (self._copyable is not None and m.name not in self._copyable):
            return False
        if m.copy_failed_at is not None and now < m.copy_failed_at + REPLICA_RETRY_S:
            return False
        return (
            backlog_s(m) > REPLICA_LOADS * m.est.load_s
            and m.est.demand(now, m.concurrency) > REPLICA_BUSY * n
            and self._room_left(m, n + 1, now)
        )

    def _room_left(self, m: ModelRecord, copies: int, now: float) -> bool:
        """Do `copies` of `m` leave room for the other models waiting now: their demand and
        what the copies serve of `m`'s (at most its own demand) within the devices? Under
        overload a copy takes a device the others need anyway and their backlog never drains
        (the `crowded` family: a hot model's copy held the only other device while two
        models queued, 1,812 s against fifo-plus's 727 s)."""
        # A waiting model's demand counts from its first gap: with the usual 20, a model that
        # had not yet seen 20 arrivals counted for nothing, and three copies of a hot model
        # held three devices, idle between its requests, while two models waited 57 s
        # (a hunt of the family properties, seed 5384953).
        others = sum(
            o.est.demand(now, o.concurrency, min_arrivals=1)
            for o in self._pending
            if o is not m and o.count
        )
        mine = min(m.est.demand(now, m.concurrency), float(copies))
        # And the room the copies hold is not the others': they need theirs beside it, a
        # device's worth at most (they take turns on it). Two devices, a model of demand 0.95
        # with a copy on each: four models waited for twice their bound (default family,
        # seed 5530).
        n_dev = len(self.devices)
        share = sum(min(1.0, d.size_of(m) / d.capacity) for d in self.devices) / n_dev
        return others + mine <= n_dev and n_dev - copies * share >= min(others, 1.0)

    def leaves_idle(self, v: ModelRecord, now: float) -> bool:
        """Does replica `v`, just gone idle, unload now: spare, and another model waiting for a
        device? With nobody waiting it stays, a spare copy placement takes first when someone
        needs its room (`packed` seed 5112 unloaded one and loaded it again three times in
        100 s)."""
        return self.spare(v, now) and any(not p.resident for p in self._pending)

    def copy_urgent(self, m: ModelRecord, now: float) -> bool:
        """Has `m`'s oldest request waited OUTRUN_WAIT_FRAC of the wait bound, capped at
        OUTRUN_BOUND_CAP_S (the cap without a bound)?"""
        bound = self._bound_s(False)
        cap_s = OUTRUN_BOUND_CAP_S if bound is None else min(bound, OUTRUN_BOUND_CAP_S)
        r = m.oldest()
        return r is not None and now - r.arrived_at >= OUTRUN_WAIT_FRAC * cap_s

    @staticmethod
    def shared(v: ModelRecord) -> bool:
        """`v` is one of several copies of its model: its model keeps serving without it."""
        return v.primary is not None or bool(v.copies)

    def has_work(self, v: ModelRecord, now: float) -> bool:
        """Resident `v` has work, lingers for more, or is a copy its model still needs."""
        return bool(v.count) or lingering(v, now) or (self.enabled and not self.spare(v, now))

    def may_evict_for_copy(self, m: ModelRecord, v: ModelRecord, now: float) -> bool:
        """May a new copy of `m` take resident `v`'s room: `v` idle, not yielding, without
        work (`has_work`), and, for a copy wanted by batch work alone, not a model whose last
        work was a person's (it would be back for its next request a reload later: `packed`
        seed 5219 made 44 loads against the simple policies' 10, its waits 10x theirs)?"""
        if v.in_flight or v.yielding or self.has_work(v, now):
            return False
        return not (self._classes and not m.icount and v.last_level >= BATCH_BELOW)

    def copy_view(self, c: ModelRecord, d: DeviceRecord, now: float) -> ResidentView:
        """A replica, or an idle primary, as placement sees it: spare (no work; a replica
        before any primary) once it may go, else like a resident with work, so placement looks
        elsewhere first."""
        if self.spare(c, now):  # a replica before its primary
            keep = -1.0 if c.primary is not None else self.policy.keep_value(c, now)
            return ResidentView(c.name, d.size_of(c), c.in_flight, 0, keep, lingering(c, now))
        m = c.queue
        return ResidentView(c.name, d.size_of(c), c.in_flight, max(m.count, 1), math.inf)

    def spare(self, v: ModelRecord, now: float) -> bool:
        """May copy `v` (a replica, or the primary) make room for another model? Not while
        its model's arrivals would keep the copies left REPLICA_BUSY busy (a model whose
        arrivals keep a whole device busy keeps one copy even when idle for a moment), nor,
        with several copies, while its backlog keeps each copy busy for half of
        REPLICA_LOADS loads (half: hysteresis against `_worth_copy`). A copy that may not go
        counts as a model with work, for overdue challengers too: they take the next device
        whose model runs dry."""
        m = v.queue
        n = 1 + len(m.copies)
        if n > 1 and not self._room_left(m, n, now):
            return True  # other models' waiting work needs the device more than a copy does
        if (
            n > 1
            and m.count * m.est.service_s > 0.5 * REPLICA_LOADS * m.est.load_s * m.concurrency * n
        ):
            return False
        level = REPLICA_BUSY * (n - 1) if n > 1 else 1.0
        if m.est.demand(now, m.concurrency) < level:
            return True
        if m.count == 0:
            # Idle, kept only by its arrival rate, which decays while nothing arrives: decide
            # again when it has decayed, or a model waiting for this room waits for the next
            # arrival, which may never come.
            at = m.est.demand_below_at(level, m.concurrency)
            if at is not None and at > now and m.demand_timer_at != at:
                m.demand_timer_at = at
                self._fx.set_timer(at + 1e-6, DEMAND_TIMER + m.name)
        return False
