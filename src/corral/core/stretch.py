"""The wait bound the load leaves room for (docs/design/scheduler.md, "A bound that stretches").

Polling theory (../shared/notes/scheduling-theory.md): a server that must visit every queue with
work once per bound B spends, per second, Σᵢ sᵢ·min(1, λᵢB)/B on swaps (sᵢ the swap into model
i, λᵢ its arrival rate: a model that gets a request less than once per B needs a swap per
request). That must fit in what the work leaves, D - Σρᵢ over D devices. Below that bound every
forced switch spends capacity the queues need, so they grow without end and even the oldest
request waits longer than with no bound at all (measured over the random families). So
`max_wait_s` is kept while Σᵢ sᵢ·min(1, λᵢB)/B ≤ HEADROOM·(D - Σρᵢ), and otherwise stretched to the
smallest B that satisfies it. Without room (Σρᵢ ≥ D, overload), the bound stretches to
MAX_STRETCH times its configured value: forced switches become rare, never absent.

Pure: the scheduler feeds it measured rates and estimates; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# How much of the spare capacity the swaps a bound forces may take, as counted by `swap_rate`.
# Above 1 because the count is an upper bound: a model already resident, or served by a visit
# another request paid for, needs no swap of its own. Chosen on the random families of
# `corral.sim.families` (0.5, 0.8, 1, 1.5, 2 tried on seeds 1000-1039), checked on fresh seeds
# 2000-2099 (docs/design/scheduler.md, "A bound that stretches").
HEADROOM = 1.5
# The bound stretches only while the queues hold this fraction of a bound's work per device: a
# backlog the devices clear within the bound needs no stretching, and closed loops (agents that
# send their next request when the last is answered) keep the devices busy without ever
# building one, though their measured load looks like overload.
BACKLOG_FRAC = 0.5
# A stretched bound is at most this many times the queued work per device (2 and 8 tried on
# the families: 2 cost devices-4 5% on its mean, 8 let a tight bound overshoot a looser one).
REACH = 4.0
# Under overload the bound stretches to at most this many times its configured value.
MAX_STRETCH = 8.0
# The bound is worked out again at most this often (its inputs are slow averages).
RECOMPUTE_S = 5.0


@dataclass(frozen=True, slots=True)
class Demand:
    """One model's measured traffic: arrivals per second, mean service per slot, the swap that
    brings it in, and the share of a device it takes."""

    rate_hz: float
    service_s: float
    concurrency: int
    swap_s: float
    size: float  # fraction of one device's room (1.0: the whole device)

    @property
    def load(self) -> float:
        """Devices its work keeps busy (rho)."""
        return self.rate_hz * self.service_s / self.concurrency


def swap_rate(demands: Sequence[Demand], bound_s: float) -> float:
    """Seconds of swapping per second that visiting every queue once per `bound_s` costs. A
    model that keeps a device busy on its own (rho >= 1) stays resident and costs none."""
    total = 0.0
    for d in demands:
        if d.load < 1.0:
            total += d.swap_s * min(1.0, d.rate_hz * bound_s) / bound_s
    return total


def feasible_bound_s(demands: Sequence[Demand], devices: int, bound_s: float) -> float:
    """The wait bound to keep: `bound_s` while the load leaves room for the switches it forces,
    else the smallest bound that does (at most MAX_STRETCH·bound_s)."""
    active = [d for d in demands if d.rate_hz > 0.0]
    if sum(d.size for d in active) <= devices + 1e-9:
        return bound_s  # every model with traffic fits at once: nothing needs to swap
    cap_s = MAX_STRETCH * bound_s
    room = HEADROOM * (devices - sum(d.load for d in active))
    if room <= 0.0 or swap_rate(active, cap_s) > room:
        return cap_s
    if swap_rate(active, bound_s) <= room:
        return bound_s
    lo, hi = bound_s, cap_s  # swap_rate is non-increasing in the bound
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if swap_rate(active, mid) <= room:
            hi = mid
        else:
            lo = mid
        if hi - lo < 0.5:
            break
    return hi


class Stretch:
    """The scheduler's current bound for interactive work, worked out again every RECOMPUTE_S;
    `scale` raises each class's configured bound to it; `since` is when stretching began."""

    __slots__ = ("_at", "bound_s", "configured_s", "episodes", "since")

    def __init__(self, configured_s: float | None) -> None:
        self.configured_s = configured_s
        self.bound_s = configured_s
        self.since: float | None = None
        self.episodes = 0  # how many times stretching began
        self._at = -math.inf

    @property
    def stretched(self) -> bool:
        return self.since is not None

    def due(self, now: float) -> bool:
        return self.configured_s is not None and now >= self._at + RECOMPUTE_S

    def update(self, now: float, demands: Sequence[Demand], devices: int, backlog_s: float) -> bool:
        """Work the bound out again from the traffic and the queued work (`backlog_s`: seconds
        of service waiting, over all models); True if stretching began or ended."""
        self._at = now
        if self.configured_s is None:
            return False
        # No hysteresis: stretching for a burst's backlog and ending with it did better on the
        # families (devices-4: mean 77.2 s against 82.2 s with an exit at half the backlog).
        if backlog_s < BACKLOG_FRAC * self.configured_s * devices:
            self.bound_s = self.configured_s
        else:
            # No further than the queues need: at most REACH times the queued work per device
            # (twice the bound at which stretching begins), growing with the backlog. Without
            # this cap a tight bound stretched at once to what the load needs, past a looser
            # bound that never stretched, and waited longer than it.
            reach_s = REACH * backlog_s / devices
            feasible = feasible_bound_s(demands, devices, self.configured_s)
            self.bound_s = max(self.configured_s, min(feasible, reach_s))
        stretched = self.bound_s > self.configured_s * (1 + 1e-9)
        if stretched == self.stretched:
            return False
        self.since = now if stretched else None
        self.episodes += stretched
        return True

    def scale(self, bound_s: float | None) -> float | None:
        """A class's configured bound, at least the stretched bound (batch work's longer bound
        needs no more room than interactive work's)."""
        if bound_s is None or self.bound_s is None or self.since is None:
            return bound_s
        return max(bound_s, self.bound_s)


class WaitBound:
    """The wait bound, one value every part reads: per class (interactive: `scheduler.max_wait_s`;
    batch: `batch.max_wait_s`), as configured and as kept now (`effective`: stretched while the
    load leaves no room for the switches it would force). None: no bound (a policy that ignores
    it, a class without one).

    Where each is meant: every decision that forces a swap (an overdue model, a replica, an
    abort, cost's deadline order) reads the effective bound, since the stretch is about the
    swaps a bound forces; the order inside a resident model's queue (its oldest request past
    its class's bound goes first, `Scheduler._dispatch`) reads the configured one, since it
    forces no swap and costs nothing (docs/design/scheduler.md, "A bound that stretches")."""

    __slots__ = ("batch_s", "interactive_s", "stretch")

    def __init__(self, interactive_s: float | None, batch_s: float | None) -> None:
        self.interactive_s = interactive_s
        self.batch_s = batch_s
        # The interactive bound's stretch (both classes' bounds scale with it).
        self.stretch = Stretch(interactive_s)

    def configured(self, batch: bool) -> float | None:
        return self.batch_s if batch else self.interactive_s

    def effective(self, batch: bool) -> float | None:
        return self.stretch.scale(self.batch_s if batch else self.interactive_s)
