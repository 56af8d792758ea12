"""Who makes room for whom (`Swaps`, an object `Scheduler` calls): the class rule and the
policy asked in turn, the wait bound's quantum and progress rules, and the two swap paths (one
device holding one model at a time; several devices or models per device, through
`plan_placement`). The rules are described in docs/design/scheduler.md ("Rules every policy
shares", "Several devices").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from corral.core.board import Board
from corral.core.effects import Effects
from corral.core.placement import DeviceView, ResidentView, overflow, plan_placement
from corral.core.policies import Policy, lingering
from corral.core.replicas import Replicas
from corral.core.state import BATCH_BELOW, DeviceRecord, ModelRecord, backlog_s, who_top
from corral.core.stretch import WaitBound
from corral.core.types import Lifecycle, Request

_READY = Lifecycle.READY

_QUANTUM = "quantum:"  # timer keys; the scheduler's on_timer reads them
LINGER_TIMER = "linger:"
_RENT = "rent:"  # a sleeping model may load on another device from then


class Swaps:
    """The swap rules of one scheduler, over its board's records: who makes room for whom,
    where a model's next copy goes (`replicate`), and starting the load (`start_load`,
    `Tiers`')."""

    def __init__(
        self,
        policy: Policy,
        board: Board,
        replicas: Replicas,
        wait: WaitBound,
        fx: Effects,
        min_visit: float,
        start_load: Callable[[ModelRecord, DeviceRecord, list[ModelRecord], float, str], None],
    ) -> None:
        self.policy = policy
        self.board = board
        self.models = board.models
        self.devices = board.devices
        self.replicas = replicas
        self.wait = wait  # the wait bound, per class (core/stretch.py)
        self._fx = fx
        self._classes = policy.classes
        self._strict = policy.strict_order
        self._several = len(board.devices) > 1
        self._incoming = board.incoming  # models whose room is being freed (draining)
        self._pending = board.pending  # models with pending work, in order
        self._min_visit = min_visit
        self._start_load = start_load

    def overdue(self, now: float) -> tuple[ModelRecord | None, float | None]:
        """The non-resident model whose oldest interactive request is oldest among those that
        waited `max_wait_s` (else the same for batch requests and `batch.max_wait_s`), and the
        next deadline of a non-resident model not yet overdue."""
        bounds = ((False, self.wait.effective(False)), (True, self.wait.effective(True)))
        forced: list[ModelRecord | None] = [None, None]
        forced_seq = [0, 0]
        next_at: float | None = None
        for m in self._pending:
            if m.resident:
                continue
            for k, (batch, max_wait) in enumerate(bounds):
                if max_wait is None or not (m.count - m.icount if batch else m.icount):
                    continue
                r = m.oldest(batch) if self._classes else m.oldest()
                assert r is not None
                at = r.arrived_at + max_wait  # one form of the comparison, so rounding agrees
                if at <= now:
                    if forced[k] is None or r.seq < forced_seq[k]:
                        forced[k], forced_seq[k] = m, r.seq
                    # Several devices: past twice its bound it may take a device whose model
                    # still has work (`_desperate`); decide again then, whatever else happens
                    # (closed loops kept both devices' queues from running dry, and nothing
                    # else looked: 646 s waits on the conversation family, seed 5008).
                    at = r.arrived_at + 2 * max_wait
                    if self._several and at > now and (next_at is None or at < next_at):
                        next_at = at
                elif next_at is None or at < next_at:
                    next_at = at
        return forced[0] or forced[1], next_at

    def _class_preempts(self, victims: list[ModelRecord], c: ModelRecord) -> bool:
        """`c` has interactive work and every victim only batch work (queued, or the last it
        ran): the class rule makes them yield, whatever the policy would say."""
        if not self._classes or not c.icount:
            return False
        return all(not v.icount and (v.count or v.last_level < BATCH_BELOW) for v in victims)

    def should_yield(self, r: ModelRecord, c: ModelRecord, now: float) -> bool:
        """The class rule, then the policy (which only compares work of one class). Called on
        arrivals: the class checks are inline."""
        if self._classes:
            if c.icount:
                if not r.icount and (r.count or r.last_level < BATCH_BELOW):
                    return True  # the same rule as `_class_preempts`, for one victim
            elif r.icount:
                return False  # batch work never displaces interactive work
            if self.board.shares.enabled and self._owed(r, c):
                return True
        if self.replicas.enabled and r.count == 0 and not self.replicas.spare(r, now):
            return False  # idle for a moment, but its arrivals keep a device busy
        return self.policy.should_yield(r, c, now)

    def _owed(self, r: ModelRecord, c: ModelRecord) -> bool:
        """Fair shares (core/shares.py): resident `r` still has work of `c`'s class, and the
        principal furthest behind among those waiting for `c` is behind every principal
        waiting for `r` by more than the round trip that yielding costs (so each swap it
        forces is paid for by the share it restores, and the loads it causes are charged to
        whoever waited for them)."""
        q = r.queue
        if not q.count or not c.count or (q.icount > 0) is not (c.icount > 0):
            return False
        shares = self.board.shares
        round_trip_s = r.leave_s + c.return_s + c.leave_s + r.comeback_s
        batch = c.top_batch
        return shares.least(who_top(c), batch) + round_trip_s < shares.least(who_top(q), batch)

    def _rank(self, candidates: list[ModelRecord], now: float) -> list[ModelRecord]:
        """Models to bring in, best first: interactive ones before batch ones, each class in
        the policy's order, except that a model whose waiting principal is owed more than a
        load's worth of device time against the policy's first goes before it."""
        if not self._classes:
            return self.policy.rank(candidates, now)
        interactive = [m for m in candidates if m.icount]
        if not interactive or len(interactive) == len(candidates):
            return self._fair(self.policy.rank(candidates, now))
        batch = [m for m in candidates if not m.icount]
        return self._fair(self.policy.rank(interactive, now)) + self._fair(
            self.policy.rank(batch, now)
        )

    def _fair(self, order: list[ModelRecord]) -> list[ModelRecord]:
        """`order` (one class) with the most owed principal's model first, where it is owed
        more than the policy's first choice's load against that model's principals."""
        shares = self.board.shares
        if not shares.enabled or len(order) < 2:
            return order
        top = order[0]
        batch = top.top_batch

        def least(m: ModelRecord) -> float:
            return shares.least(who_top(m), batch)

        owed = min(order, key=least)
        if owed is top or least(owed) + top.return_s >= least(top):
            return order
        return [owed] + [m for m in order if m is not owed]

    def views(self, target: ModelRecord, now: float, forced: bool = False) -> list[DeviceView]:
        """What placement sees for `target`; `forced` (an overdue target): a copy of a model
        that keeps another copy looks spare, so the overdue model takes its device first."""
        keep = self.policy.keep_value
        allowed = target.spec.devices
        name = target.name
        # Where it sleeps, it wakes; elsewhere it loads afresh (its sleeping server stops).
        home = target.device if target.asleep else None
        anywhere = home is None or self._rented_out(target, now)
        return [
            DeviceView(
                name=d.name,
                capacity=d.capacity,
                # A device the model may not use, or holds a copy of it, is one it does not fit.
                target_size=(
                    d.size_of(target)
                    if (not allowed or d.name in allowed)
                    and (anywhere or d is home)
                    and all(m.name != name for m in d.residents)
                    else math.inf
                ),
                # A replica serves its model's queue; among residents with work it goes first.
                residents=tuple(
                    _held(
                        ResidentView(m.name, d.size_of(m), m.in_flight, 0, -1.0)
                        if forced and self.replicas.shared(m)
                        else ResidentView(
                            m.name,
                            d.size_of(m),
                            m.in_flight,
                            m.count,
                            keep(m, now),
                            lingering(m, now),
                        )
                        if m.primary is None and (m.count or not self.replicas.enabled)
                        else self.replicas.copy_view(m, d, now),
                        m,
                        now,
                    )
                    for m in d.residents
                ),
                busy=d.loading is not None,
                home=d is home,
            )
            for d in self.devices
        ]

    def refit(self, rec: ModelRecord, memory_gb: float, now: float) -> list[ModelRecord]:
        """Ready `rec`'s model takes `memory_gb` from now on (each copy); who leaves its device
        for that: the neighbours placement would have evicted (`overflow`); itself where only
        held ones could make room (its queue places it again); no one where it is too big for
        the device alone (it runs)."""
        family = rec.primary or rec
        for c in (family, *family.copies):
            c.memory_gb = memory_gb
        dev = rec.device
        assert dev is not None
        view = next(v for v in self.views(rec, now) if v.name == dev.name)
        victims = overflow(view, rec.name)
        if victims is None:
            return [rec] if memory_gb <= dev.capacity else []
        return [dev.holding(name) for name in victims]

    def _rented_out(self, m: ModelRecord, now: float) -> bool:
        """Sleeping `m` may load afresh on another device once its oldest request has waited
        what that load costs over its wake (ski rental: waiting for its own device, then
        buying the load, is never worse than twice the better choice made knowing when the
        device frees). Until then it wakes only where it sleeps; a timer decides again then."""
        oldest = m.oldest()
        if oldest is None:
            return False
        at = oldest.arrived_at + max(0.0, m.est.load_s - m.return_s)
        if at <= now:
            return True
        if m.rent_timer_at != at:
            m.rent_timer_at = at
            self._fx.set_timer(at, _RENT + m.name)
        return False

    def _yield_to(
        self, victims: list[ModelRecord], c: ModelRecord, forced: ModelRecord | None, now: float
    ) -> bool:
        """Do `victims` make room for `c` (policy, max_wait and the progress rule)?"""
        if c is not forced and not all(self.replicas.spare(v, now) for v in victims if v.primary):
            return False
        wants = c is forced or all(
            self.should_yield(v, c, now) for v in victims if v.primary is None
        )
        if not wants:
            return False
        if c is not forced and self._class_preempts(victims, c):
            return True  # one way only (batch never preempts), so no progress rule is needed
        desperate = c is forced and self._several and self._desperate(c, now)
        if (
            c is forced
            and self._several
            and not desperate
            and any(self.replicas.has_work(v, now) for v in victims)
        ):
            # Several devices: an overdue model takes the next device whose model runs dry (it
            # goes first for it), never one whose model still has work. Forcing swaps there
            # turned an unmeetable bound into thrash: on `devices-4`, max_wait_s 120 made cost's
            # mean wait 404 s against 109 s without a bound; now 89 s (docs/design/scheduler.md).
            # Past twice its bound, it takes a copy of a model that keeps another copy: a model
            # with copies on every device never runs dry, and overdue models waited for it
            # forever. Sooner, it cost devices-8 a fifth more loads.
            return False
        if c is forced:
            # Quantum: max_wait_s may end a visit only after it has served for min_visit_swaps
            # times the swap that began it, so turn-taking under overload cannot collapse into
            # swapping (at most 1/(1+min_visit_swaps) of the device goes to swaps).
            for v in victims:
                until = v.ready_at + self._min_visit * (v.ready_at - v.load_started_at)
                if v.queue.count and until > now:
                    if v.quantum_timer_at != until:
                        v.quantum_timer_at = until
                        self._fx.set_timer(until, _QUANTUM + v.name)
                    return False
        # Progress: a model loaded for pending work serves one round before it yields, so no
        # swap is wasted and no two models can swap back and forth forever.
        if all(v.served or v.count == 0 for v in victims):
            return True
        for v in victims:
            v.recheck = True  # decide again when its first round frees a slot
        return False

    def _commit(
        self,
        c: ModelRecord,
        dev: DeviceRecord,
        victims: list[ModelRecord],
        forced: ModelRecord | None,
        now: float,
    ) -> None:
        for v in victims:
            v.yielding = True
        if all(v.in_flight == 0 for v in victims):
            reason = "max_wait_s reached" if c is forced else self.policy.name
            self._start_load(c, dev, victims, now, reason)
        else:
            self._incoming.add(c)

    def swap_solo(
        self, candidates: list[ModelRecord], forced: ModelRecord | None, now: float
    ) -> None:
        """One device, one model at a time: the same rule as `_swap_placed`, without views."""
        dev = self.devices[0]
        if dev.loading is not None:
            return
        if not dev.residents:
            target = forced or self._rank(candidates, now)[0]
            self._start_load(target, dev, [], now, "free room")
            return
        r = dev.residents[0]
        if (r.spec.pin or r.spec.min_resident_s) and holds(r, now):
            return  # decided again when its min_resident_s ends (a timer)
        if self._classes and forced is None:
            interactive = [c for c in candidates if c.icount]
            if interactive:  # batch work may not take the device while interactive work waits
                candidates = interactive
        if forced is not None:
            target = forced
        elif self._strict:
            # Strict order: the only possible target is the oldest request's model (the same
            # answer as ranking every candidate, in O(1)).
            head = self.board.head()
            hm = self.models[head.model] if head is not None else r
            if hm is r or hm.resident or not self.should_yield(r, hm, now):
                self._arm_linger(r, now)
                return
            target = hm
        else:
            passing = [c for c in candidates if self.should_yield(r, c, now)]
            if not passing:
                self._arm_linger(r, now)
                return
            target = passing[0] if len(passing) == 1 else self._rank(passing, now)[0]
        if self._yield_to([r], target, forced, now):
            self._commit(target, dev, [r], forced, now)

    def swap_placed(
        self, candidates: list[ModelRecord], forced: ModelRecord | None, now: float
    ) -> None:
        """Several devices or models per device: place candidates in rank order."""
        order = self._rank(candidates, now)
        if forced is not None:
            order.remove(forced)
            order.insert(0, forced)
        evicting = False
        # While interactive work waits, batch work takes only free room, never evicts.
        interactive_waits = self._classes and any(c.icount for c in order)
        # Per device: the better candidate waiting for its room, and the residents it evicts.
        claims: dict[str, tuple[ResidentView, frozenset[str]]] = {}
        drains_s: dict[str, float] = {}  # per claimed device: when its victims run dry
        for c in order:
            if interactive_waits and not c.icount and c is not forced:
                evicting = True
            views = self.views(c, now, c is forced and self._desperate(c, now))
            fits_s = c.return_s + backlog_s(c)
            plan = plan_placement(
                _beside(views, {d: x for d, x in claims.items() if fits_s > drains_s[d]})
            )
            if plan is None:
                evicting = evicting or c is forced  # nobody jumps an overdue model's queue
                continue
            dev = next(d for d in self.devices if d.name == plan.device)
            if not plan.evict:
                self._start_load(c, dev, [], now, "free room")
                continue
            if evicting:
                continue  # one eviction decision at a time; later ones only take free room
            victims = [dev.holding(n) for n in plan.evict]
            if self._yield_to(victims, c, forced, now):
                evicting = True
                self._commit(c, dev, victims, forced, now)
            else:
                for v in victims:
                    self._arm_linger(v, now)
                # Backfilling without delaying it (EASY backfilling): the room c waits for
                # is c's; a worse candidate takes only what is left beside c there. Else
                # the worse ones took that room each time a resident went idle, and a model
                # that needed the whole device waited for their queues until its stretched
                # bound (default family, seed 5216: 645 s for a burst of 50 requests).
                view = next(v for v in views if v.name == dev.name)
                shared = len(victims) > 1 or sum(r.size for r in view.residents) < view.capacity
                if shared and dev.name not in claims:
                    size = view.target_size
                    me = ResidentView(c.name, size, 0, c.count, math.inf, held=True)
                    claims[dev.name] = (me, frozenset(plan.evict))
                    drains_s[dev.name] = max(backlog_s(v) for v in victims)

    def _desperate(self, c: ModelRecord, now: float) -> bool:
        """Overdue `c`'s oldest request of its top class has waited twice its class's bound."""
        bound = self.wait.effective(c.top_batch)
        r = c.oldest_top()
        return bound is not None and r is not None and now - r.arrived_at >= 2 * bound

    def _arm_linger(self, m: ModelRecord, now: float) -> None:
        until = m.linger_until
        if until is not None and until > now and m.linger_timer_at != until:
            m.linger_timer_at = until
            self._fx.set_timer(until, LINGER_TIMER + m.name)

    def may_switch_to(self, c: ModelRecord, now: float) -> bool:
        """Solo device: could an arrival for non-resident `c` change the decision? (O(1))"""
        dev = self.devices[0]
        if dev.loading is not None:
            # Decided again when the load ends, unless a person's request may stop a load that
            # only batch work wants (core/aborts.py).
            return self._classes and c.icount > 0 and not dev.loading.queue.icount
        if not dev.residents:
            return True
        r = dev.residents[0]
        if r.yielding:
            return False  # a swap is already coming; its target is chosen when r drains
        if self._classes and c.icount and not r.icount and (r.count or r.last_level < BATCH_BELOW):
            return True  # batch yields to interactive at its next request boundary
        if not r.served and r.count:
            r.recheck = True  # it serves a round first; decide again when that round ends
            return False
        if r.count == 0:
            return r.in_flight == 0  # idle: decide now; busy: decide when it goes idle
        return self.should_yield(r, c, now)

    def replicate(self, now: float, before: Request | None = None, outpaced: bool = False) -> None:
        """Give models with a deep queue a copy more (`Replicas.worth_copy`), into free room or
        over residents that are idle and not lingering; with `before`, only models with a
        request older; with `outpaced`, only models whose arrivals outrun the copies they have
        (demand above their number: their queue grows until the copy comes) and whose oldest
        request has waited OUTRUN_WAIT_FRAC of the bound."""
        for m in list(self._pending):
            if (
                m.state is not _READY
                or m.yielding
                or m.lost
                or not self.replicas.worth_copy(m, now)
            ):
                continue
            if outpaced and (
                m.est.demand(now, m.concurrency) <= 1 + len(m.copies)
                or not self.replicas.copy_urgent(m, now)
            ):
                continue
            if before is not None:
                mine = m.oldest()
                if mine is None or mine.seq > before.seq:
                    continue
            plan = plan_placement(self.views(m, now))
            if plan is None:
                continue
            dev = next(d for d in self.devices if d.name == plan.device)
            victims = [dev.holding(n) for n in plan.evict]
            if not all(self.replicas.may_evict_for_copy(m, v, now) for v in victims):
                continue
            c = ModelRecord(m.name, m.spec, self._classes, primary=m)
            m.copies.append(c)
            self._start_load(c, dev, victims, now, "replica")


def _beside(
    views: list[DeviceView], claims: dict[str, tuple[ResidentView, frozenset[str]]]
) -> list[DeviceView]:
    """`views` where a better candidate waits for room: there, the residents it evicts are
    its (held), and the rest of the room it takes is taken already (the free room left is
    what is free now and also beside it)."""
    out = []
    for v in views:
        if v.name in claims:
            c, evicts = claims[v.name]
            freed = sum(r.size for r in v.residents if r.name in evicts)
            held = tuple(
                dataclasses.replace(r, held=True) if r.name in evicts else r for r in v.residents
            )
            rest = dataclasses.replace(c, size=max(0.0, c.size - freed))
            v = dataclasses.replace(v, residents=(*held, rest))
        out.append(v)
    return out


def _held(view: ResidentView, m: ModelRecord, now: float) -> ResidentView:
    """`view` with its residency rules: a pinned model is never evicted, one inside its
    `min_resident_s` not yet (the scheduler decides again when that ends), a soft pin last."""
    spec = m.spec
    if not (spec.pin or spec.min_resident_s or m.keep_alive_s == math.inf):
        return view
    return dataclasses.replace(view, held=holds(m, now), soft_pin=m.soft_pin)


def holds(m: ModelRecord, now: float) -> bool:
    """Resident `m` may not be evicted now: pinned, or inside its `min_resident_s`."""
    return (m.spec.pin and m.primary is None) or (
        m.state is Lifecycle.READY and now < m.ready_at + m.spec.min_resident_s
    )
