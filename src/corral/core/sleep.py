"""Which evicted models sleep and which stop (`Sleepers`, an object the scheduler calls).

A model with `sleep:` that leaves its device may sleep: its server stays, its weights in host
memory (level 1) or dropped (level 2), and it comes back in its wake time instead of its load
time. Sleepers hold host memory (`ModelConfig.host_gb`) up to `host.memory_gb`. `predicted`
(the default) sleeps a model while host memory has room; when it is short, a model not
expected back at all (fewer than two arrivals) stops, and a level-1 model sleeps at level 2 (no
host memory; a wake a few times slower, still far quicker than a load). `lru` (the baseline: a
wrapper that always sleeps) sleeps every victim at its level and stops the least recently used
sleepers to make room. docs/design/sleep.md has the rules and the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from corral.core.state import DeviceRecord, ModelRecord

_EPS = 1e-9


# The mean absolute deviation of an exponential gap, over its mean: Poisson arrivals.
_POISSON_DEV = 2 / math.e


def next_use_s(m: ModelRecord, now: float) -> float:
    """Seconds until `m`'s next request is expected: 0 with work queued, inf if it has had
    fewer than two arrivals (no gap to go by)."""
    if m.queue.count:
        return 0.0
    gap = m.est.arrival_gap_s
    if gap is None or m.est.last_arrival_at is None:
        return math.inf
    elapsed = now - m.est.last_arrival_at
    # How memoryless its arrivals are, from how much its gaps vary: 0 for a loop that comes
    # back like a clock (the time left is the gap less what has passed), 1 for Poisson arrivals
    # (the time left is the mean gap, however long it has been).
    memoryless = min(1.0, m.est.arrival_gap_dev_s / (_POISSON_DEV * gap)) if gap > 0 else 0.0
    left = (1.0 - memoryless) * max(gap - elapsed, 0.0) + memoryless * gap
    # A silence longer than 8 mean gaps pushes the expectation out with it.
    return max(left, elapsed / 8)


def keep_value(m: ModelRecord, now: float) -> float:
    """Seconds `m`'s sleep saves at its return (a load against a wake) per second until that
    return: who stops when host memory runs short is who saves least for the memory it holds
    (GreedyDual's rule, with the expected next use for the recency)."""
    saved_s = max(m.est.load_s - m.est.wake_s, _EPS)
    return saved_s / max(next_use_s(m, now), _EPS)


class Sleepers:
    """The host memory sleeping models hold, and the choice between sleeping and stopping."""

    def __init__(self, devices: Sequence[DeviceRecord], host_gb: float | None, lru: bool) -> None:
        self._devices = devices
        self.host_gb = math.inf if host_gb is None else host_gb
        self._lru = lru

    def all(self) -> list[ModelRecord]:
        return [s for d in self._devices for s in d.sleepers]

    def used_gb(self) -> float:
        return sum(s.held_gb for d in self._devices for s in d.sleepers)

    def _admitted(self, v: ModelRecord, incoming: ModelRecord, now: float) -> bool:
        """Whether level-1 `v` ranks, among itself and the models asleep at level 1 once
        `incoming` is awake, within host memory less `incoming`'s room (when it is evicted in
        turn, it falls asleep before the next model wakes, so for a moment one more sleeps),
        ranked by what their level-1 sleep is worth: the seconds a level-1 wake saves over a
        level-2 one per second until the next use (GreedyDual's rule). Nobody asleep is moved:
        `v` only declines room that models worth more hold."""
        rivals = [
            s
            for s in self.all()
            if s is not incoming
            and not s.deep
            and _level(s) == 1
            and s.spec.host_gb_at(s.memory_gb) > 0
        ]
        rivals.append(v)
        reserve = (
            incoming.spec.host_gb_at(incoming.memory_gb)
            if incoming.sleeps and _level(incoming) == 1
            else 0.0
        )
        room = self.host_gb - reserve
        for m in sorted(rivals, key=lambda m: (-_l1_value(m, now), m.name)):
            if m.spec.host_gb_at(m.memory_gb) > room + _EPS:
                continue
            room -= m.spec.host_gb_at(m.memory_gb)
            if m is v:
                return True
        return False

    def plan(self, victims: Sequence[ModelRecord], incoming: ModelRecord, now: float) -> Plan:
        """For the swap that brings `incoming` in: which victims stop, which fall asleep (and
        of those, which at level 2 below their level 1), and which sleepers stop first to leave
        host memory for them. The victims fall asleep before `incoming` wakes (they free the
        device it wakes on), so a waking `incoming` still holds its host memory meanwhile."""
        plan = Plan([], [], [], [])
        free = self.host_gb - self.used_gb()
        for v in victims:
            if not v.sleeps or v.copies:
                plan.stop.append(v)  # a model with copies elsewhere stops: its queue is served
                continue
            need = v.spec.host_gb_at(v.memory_gb)
            others = [s for s in self.all() if s not in plan.drop and s is not incoming]
            if not self._lru and need > free + _EPS:
                # Sleepers with no return in sight make room first: nothing expected is lost.
                idle = [s for s in others if s.held_gb and next_use_s(s, now) == math.inf]
                chosen, room = _make_room(sorted(idle, key=lambda s: s.name), need, free)
                if need <= room + _EPS:
                    plan.drop += chosen
                    free = room
            if need <= free + _EPS:
                # It sleeps while there is room, even with no return in sight (fewer than two
                # arrivals): such a sleeper is the first to stop when room is needed. Room it
                # holds at level 1 that models worth more will want at the next swaps goes to
                # them: it sleeps at level 2 instead.
                plan.sleep.append(v)
                if self._lru or self._admitted(v, incoming, now):
                    free -= need
                else:
                    plan.deep.append(v)
                continue
            if not self._lru and next_use_s(v, now) == math.inf:
                plan.stop.append(v)  # not expected back, and no room: not held at all
                continue
            nap = v.spec.sleep
            assert nap is not None
            if not self._lru and nap.level == 1:
                # Host memory is short: it sleeps at level 2 (its weights dropped, its server
                # kept), which wakes in seconds where a stop would reload in tens of them.
                plan.sleep.append(v)
                plan.deep.append(v)
                continue
            # Sleepers that matter less than `v`: the least recently used (lru), or those whose
            # sleep saves less per second than `v`'s (predicted), the least first.
            others = [s for s in others if s not in plan.drop]
            if self._lru:
                order = sorted(others, key=lambda s: (s.used_at, s.name))
            else:
                mine = keep_value(v, now)
                values = [(keep_value(s, now), s.name, s) for s in others if s.held_gb]
                order = [s for k, _, s in sorted(values) if k < mine]
            chosen, room = _make_room(order, need, free)
            if need > room + _EPS:
                plan.stop.append(v)
                continue
            plan.drop += chosen
            plan.sleep.append(v)
            free = room - need
        return plan


def _level(m: ModelRecord) -> int:
    return m.spec.sleep.level if m.spec.sleep is not None else 0


def _l1_value(m: ModelRecord, now: float) -> float:
    """Seconds a level-1 wake saves over a level-2 one, per second until `m`'s next use."""
    return max(m.est.wake2_s - m.est.wake_s, _EPS) / max(next_use_s(m, now), _EPS)


def _make_room(
    order: Sequence[ModelRecord], need: float, free: float
) -> tuple[list[ModelRecord], float]:
    """The first sleepers of `order` whose host memory, with `free`, makes `need`; and the
    room then (short of `need` if all of them do not)."""
    chosen: list[ModelRecord] = []
    room = free
    for s in order:
        if need <= room + _EPS:
            break
        chosen.append(s)
        room += s.held_gb
    return chosen, room


@dataclass
class Plan:
    """Who leaves how in one swap (`Sleepers.plan`): `deep` is a part of `sleep`."""

    stop: list[ModelRecord]
    sleep: list[ModelRecord]
    deep: list[ModelRecord]
    drop: list[ModelRecord]
