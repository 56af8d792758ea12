"""Which evicted models sleep and which stop (`Sleepers`, an object the scheduler calls).

A model with `sleep:` that leaves its device may sleep: its server stays, its weights in host
memory (level 1) or dropped (level 2), and it comes back in its wake time instead of its load
time. Sleepers hold host memory (`ModelConfig.host_gb`) up to `host.memory_gb`; when that runs
short, someone stops. `predicted` (the default) keeps the sleepers expected back soonest (from
the learned gaps between arrivals) and stops a model rather than sleep it when it is not
expected back at all; `lru` always sleeps the victim and stops the least recently used sleepers
(the baseline). docs/design/sleep.md has the rules and the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from corral.core.state import DeviceRecord, ModelRecord

_EPS = 1e-9


def next_use_s(m: ModelRecord, now: float) -> float:
    """Seconds until `m`'s next request is expected: 0 with work queued, inf if it has had
    fewer than two arrivals (no gap to go by)."""
    if m.queue.count:
        return 0.0
    gap = m.arrival_gap_est
    if gap is None or m.last_arrival_at is None:
        return math.inf
    # A silence longer than the mean gap pushes the expectation out with it.
    return max(m.last_arrival_at + gap - now, (now - m.last_arrival_at) / 8, 0.0)


class Sleepers:
    """The host memory sleeping models hold, and the choice between sleeping and stopping."""

    def __init__(self, devices: Sequence[DeviceRecord], host_gb: float | None, lru: bool) -> None:
        self._devices = devices
        self.host_gb = math.inf if host_gb is None else host_gb
        self._lru = lru

    def all(self) -> list[ModelRecord]:
        return [s for d in self._devices for s in d.sleepers]

    def used_gb(self) -> float:
        return sum(s.spec.host_gb for d in self._devices for s in d.sleepers)

    def plan(
        self, victims: Sequence[ModelRecord], incoming: ModelRecord, now: float
    ) -> tuple[list[ModelRecord], list[ModelRecord], list[ModelRecord]]:
        """For the swap that brings `incoming` in: (victims that stop, victims that fall
        asleep, sleepers that stop first to leave host memory for them). The victims fall
        asleep before `incoming` wakes (they free the device it wakes on), so a waking
        `incoming` still holds its host memory meanwhile."""
        stop: list[ModelRecord] = []
        sleep: list[ModelRecord] = []
        drop: list[ModelRecord] = []
        free = self.host_gb - self.used_gb()
        for v in victims:
            if not v.sleeps or v.copies:
                stop.append(v)  # a model with copies elsewhere stops: its queue is served
                continue
            need = v.spec.host_gb
            mine = 0.0 if self._lru else next_use_s(v, now)
            if mine == math.inf:
                stop.append(v)  # not expected back: its host memory is better left free
                continue
            if need > free + _EPS:
                # Sleepers that matter less than `v`: the least recently used (lru), or those
                # expected back later than `v` (predicted), the latest first.
                others = [s for s in self.all() if s not in drop and s is not incoming]
                if self._lru:
                    order = sorted(others, key=lambda s: (s.used_at, s.name))
                else:
                    later = [(next_use_s(s, now), s.name, s) for s in others]
                    order = [s for u, _, s in sorted(later, reverse=True) if u > mine]
                chosen: list[ModelRecord] = []
                room = free
                for s in order:
                    if need <= room + _EPS:
                        break
                    chosen.append(s)
                    room += s.spec.host_gb
                if need > room + _EPS:
                    stop.append(v)
                    continue
                drop += chosen
                free = room
            sleep.append(v)
            free -= need
        return stop, sleep, drop
