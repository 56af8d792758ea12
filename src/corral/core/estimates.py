"""One model's running estimates (`Estimates`, a `ModelRecord`'s `est`): how long its swaps
and requests take, how often requests arrive, and how long it stays idle between them. Each is
measured as the scheduler sees events, starting from the configured figures.

A load is priced by where its file is: a warm load (its file in the host's page
cache) and a cold one (read from the disk) are learned apart, and a load costs the warm figure
plus the uncached share of the difference, at the fraction cached as last measured
(`core/pagecache.py`). A model whose file was never measured counts as cached: its loads are
priced by its measured loads alone."""

from __future__ import annotations

import math

from corral.config import ModelConfig

_EWMA_SERVICE = 0.2
_EWMA_GAP = 0.3
_EWMA_SWAP = 0.3
_EWMA_DEMAND = 0.01  # about the last 100 arrivals or requests served
_DEMAND_MIN_ARRIVALS = 20  # demand() says 0 until it has seen this many gaps


class Estimates:
    """Seconds each: a request's service, a load, an unload, a wake (from level 1, and from
    a level-2 sleep below its configured level), falling asleep; the gaps between arrivals and
    the idle gaps (went idle -> next arrival), each with its mean absolute deviation."""

    __slots__ = (
        "arrival_gap_dev_s",
        "arrival_gap_s",
        "arrivals",
        "cached",
        "cold_load_s",
        "idle_gap_dev_s",
        "idle_gap_s",
        "last_arrival_at",
        "load_cached",
        "refill_s",
        "service_avg_s",
        "service_s",
        "sleep_s",
        "unload_s",
        "wake2_s",
        "wake_s",
        "warm_load_s",
        "warm_seen",
    )

    def __init__(self, spec: ModelConfig) -> None:
        self.service_s = spec.service_s
        self.service_avg_s = spec.service_s  # a slower EWMA, for demand()
        self.warm_load_s = spec.load_s
        self.warm_seen = False  # a warm load measured: until then `load_s` is a guess
        self.cold_load_s = spec.cold_load_s  # None: no cold load seen nor configured
        # The fraction of its file in the page cache, as last measured (None: never).
        self.cached: float | None = None
        self.load_cached = 1.0  # ... when its last load began
        self.unload_s = spec.unload_s
        self.wake_s = spec.sleep.wake_s if spec.sleep is not None else spec.load_s
        self.sleep_s = spec.sleep.sleep_s if spec.sleep is not None else spec.unload_s
        self.wake2_s = spec.deep_wake_s
        self.idle_gap_s: float | None = None  # EWMA of idle gaps: went idle -> next arrival
        self.idle_gap_dev_s = 0.0  # EWMA of the gaps' absolute deviation from idle_gap_s
        self.last_arrival_at: float | None = None
        self.arrival_gap_s: float | None = None  # EWMA of the time between arrivals
        self.arrival_gap_dev_s = 0.0  # EWMA of their absolute deviation from it
        self.arrivals = 0  # gaps observed (arrivals after the first)
        # What leaving costs its conversations when they come back (core/conversations.py).
        self.refill_s = 0.0

    @property
    def load_s(self) -> float:
        """Seconds a load takes now: the warm figure, plus the uncached share of what a cold
        load costs more."""
        return self._load_s_at(self.cached)

    @property
    def begun_load_s(self) -> float:
        """Seconds the load under way takes, as priced when it began (its own reads fill the
        page cache as it goes)."""
        return self._load_s_at(self.load_cached)

    def _load_s_at(self, cached: float | None) -> float:
        cold = self.cold_load_s
        if cold is None or cached is None or cached >= 1.0:
            return self.warm_load_s
        return self.warm_load_s + (1.0 - cached) * max(0.0, cold - self.warm_load_s)

    def load_begins(self) -> None:
        """A load begins: its measured time will be read at the fraction cached now."""
        self.load_cached = 1.0 if self.cached is None else self.cached

    def observe_service(self, seconds: float) -> None:
        self.service_s += _EWMA_SERVICE * (seconds - self.service_s)
        self.service_avg_s += _EWMA_DEMAND * (seconds - self.service_avg_s)

    def observe_arrival(self, now: float) -> None:
        last = self.last_arrival_at
        self.last_arrival_at = now
        if last is None:
            return
        gap = now - last
        self.arrivals += 1
        # A plain mean over the first arrivals, then the EWMA: a few early gaps alone would
        # make a cold model look hot.
        est = self.arrival_gap_s
        alpha = max(_EWMA_DEMAND, 1.0 / self.arrivals)
        if est is not None:
            self.arrival_gap_dev_s += alpha * (abs(gap - est) - self.arrival_gap_dev_s)
        self.arrival_gap_s = gap if est is None else est + alpha * (gap - est)

    def demand(
        self, now: float, concurrency: int, min_arrivals: int = _DEMAND_MIN_ARRIVALS
    ) -> float:
        """Copies its arrivals keep busy (arrival rate x service time / concurrency), from
        slow averages of the gaps between arrivals and of service times. A silence since the
        last arrival of more than 8 mean gaps (0.03% of Poisson gaps) lowers the rate. Below
        `min_arrivals` gaps seen it says 0: a few early gaps alone would make a cold model look
        hot (a caller that must not under-count, such as the room others need, asks for 1)."""
        est = self.arrival_gap_s
        if est is None or self.last_arrival_at is None or self.arrivals < min_arrivals:
            return 0.0
        gap = _gap(now, est, self.last_arrival_at)
        return self.service_avg_s / (concurrency * gap) if gap > 0 else math.inf

    def demand_below_at(self, level: float, concurrency: int) -> float | None:
        """When `demand` falls below `level` if nothing more arrives (None: it is already
        below, or never will be)."""
        est = self.arrival_gap_s
        if est is None or self.last_arrival_at is None or self.arrivals < _DEMAND_MIN_ARRIVALS:
            return None
        if level <= 0.0:
            return None
        gap = self.service_avg_s / (concurrency * level)  # demand < level past this gap
        if est > gap:
            return None
        return self.last_arrival_at + 8 * gap

    def rate_hz(self, now: float) -> float:
        """Arrivals per second, from the same average of gaps as `demand`, once one gap has
        been seen; a silence of more than 8 mean gaps lowers it."""
        est = self.arrival_gap_s
        if est is None or self.last_arrival_at is None:
            return 0.0
        return 1.0 / max(_gap(now, est, self.last_arrival_at), 1e-3)

    @property
    def late_gap_s(self) -> float | None:
        """When its next request is due after it goes idle, allowing for a late one: the idle
        gap plus its deviation (None: no idle gap seen yet)."""
        g = self.idle_gap_s
        return None if g is None else g + self.idle_gap_dev_s

    def observe_idle_gap(self, seconds: float) -> None:
        g = self.idle_gap_s
        if g is None:
            self.idle_gap_s = seconds
            return
        self.idle_gap_dev_s += _EWMA_GAP * (abs(seconds - g) - self.idle_gap_dev_s)
        self.idle_gap_s = g + _EWMA_GAP * (seconds - g)

    def observe_swap(
        self, load_s: float | None, unload_s: float | None, woke: bool = False, deep: bool = False
    ) -> None:
        """Measured times of its last swap in (`woke`: `load_s` was a wake; `deep`: from a
        level-2 sleep below its configured level)."""
        if load_s is not None and woke and deep:
            self.wake2_s += _EWMA_SWAP * (load_s - self.wake2_s)
        elif load_s is not None and woke:
            self.wake_s += _EWMA_SWAP * (load_s - self.wake_s)
        elif load_s is not None:
            self._observe_load(load_s)
        if unload_s is not None:
            self.unload_s += _EWMA_SWAP * (unload_s - self.unload_s)

    def _observe_load(self, load_s: float) -> None:
        """A load measured at `load_cached`: mostly cached, it refines the warm figure (less
        the uncached share of the cold difference); mostly not, the cold figure (less the
        cached share of the warm one). The first of each kind replaces the configured guess,
        and a cold load below a warm figure still guessed brings it down to its own."""
        f = self.load_cached
        warm, cold = self.warm_load_s, self.cold_load_s
        if f >= 0.5:
            seen = max(0.0, load_s - (1.0 - f) * max(0.0, (cold or warm) - warm))
            self.warm_load_s = warm + _EWMA_SWAP * (seen - warm) if self.warm_seen else seen
            self.warm_seen = True
            return
        seen = max(0.0, (load_s - f * warm) / (1.0 - f))
        self.cold_load_s = seen if cold is None else cold + _EWMA_SWAP * (seen - cold)
        if not self.warm_seen and warm > self.cold_load_s:
            self.warm_load_s = self.cold_load_s  # a guess above a cold load: at most that


def _gap(now: float, est: float, last_arrival_at: float) -> float:
    """The mean gap between arrivals, lengthened by a silence of more than 8 of them."""
    return max(est, (now - last_arrival_at) / 8)
