"""Fair shares between principals inside a service class (docs/design/scheduler.md, "Fair
shares").

Each principal (a person, team or app: `Request.principal`; None is the anonymous one) has a
*virtual time* in each service class: the device-seconds charged to its work of that class
divided by its weight. It is charged

- the service of each of its requests: its model's estimated device share
  (`service_s / concurrency`) when it is dispatched, corrected to the measured time when it
  ends, so a principal with many requests in flight is charged for them at once; and
- the loads its queued work caused: a load's measured time (its evictions' stops included) is
  split between the principals whose work of the loaded model's top class waited for it, by
  count.

A class's *clock* is the least virtual time among the principals active in it (work pending or
running), less what their running requests were charged (the start of the work in service, as
start-time fair queuing reads it), never moving back. A principal that becomes active starts
at least at the clock, so idling banks no credit and a newcomer does not jump the ones already
sharing. The scheduler serves the least virtual time first among requests of one level
of one model (`ModelRecord.best`), and lets a principal owed more than a swap's round trip take
the device from a model whose queue holds only principals ahead of it (`Swaps`). With one
principal everything reads as before: the parts ask `enabled` first.
"""

from __future__ import annotations

from collections.abc import Mapping

from corral.core.state import BATCH_BELOW
from corral.core.types import Request

Who = str | None


class Shares:
    """Every principal's charged device time and virtual time, per class, owned here."""

    __slots__ = (
        "_active",
        "_clock",
        "_on",
        "_running",
        "_seen",
        "enabled",
        "ledger",
        "vtimes",
        "weights",
    )

    def __init__(self, weights: Mapping[str, float] | None = None, on: bool = True) -> None:
        """`weights`: principals' weights (missing: 1); `on` False: charge, never decide."""
        self.weights: dict[str, float] = {p: w for p, w in (weights or {}).items() if w > 0}
        # Virtual times: [interactive, batch], each per principal.
        self.vtimes: tuple[dict[Who, float], dict[Who, float]] = ({}, {})
        self._clock = [0.0, 0.0]
        # Requests pending or running, per class and principal.
        self._active: tuple[dict[Who, int], dict[Who, int]] = ({}, {})
        # Virtual time charged for requests still running, per class and principal.
        self._running: tuple[dict[Who, float], dict[Who, float]] = ({}, {})
        self._seen: set[Who] = set()
        self._on = on
        # Two principals have been seen: shares decide something (else FIFO, as before).
        self.enabled = False
        # Charged device-seconds per (principal, model): [service_s, load_s].
        self.ledger: dict[tuple[Who, str], list[float]] = {}

    def weigh(self, who: str, weight: float) -> None:
        """`who`'s weight from now on (its keys' say). Virtual time already charged stays."""
        if weight > 0 and self.weights.get(who, 1.0) != weight:
            self.weights[who] = weight

    def weight(self, who: Who) -> float:
        return self.weights.get(who, 1.0) if who is not None else 1.0

    def least(self, who: Mapping[Who, int], batch: bool) -> float:
        """The least virtual time (in class `batch`) among the principals counted in `who`."""
        best = float("inf")
        vtime = self.vtimes[batch]
        for p, n in who.items():
            if n:
                v = vtime.get(p, 0.0)
                if v < best:
                    best = v
        return best

    def arrived(self, r: Request) -> None:
        """Pending `r` (its level stamped): its principal becomes active in its class, starting
        at least at the class's clock."""
        who = r.principal
        k = r.level < BATCH_BELOW
        active = self._active[k]
        n = active.get(who, 0)
        if n == 0:
            vtime = self.vtimes[k]
            clock = self._tick(k)
            if vtime.get(who, 0.0) < clock:
                vtime[who] = clock
        active[who] = n + 1
        if who not in self._seen:
            self._seen.add(who)
            self.enabled = self._on and len(self._seen) > 1

    def _tick(self, k: bool) -> float:
        """Class `k`'s clock: the least virtual time of its active principals, never back."""
        vtime, running = self.vtimes[k], self._running[k]
        floor = min(
            (vtime.get(p, 0.0) - running.get(p, 0.0) for p in self._active[k]), default=None
        )
        if floor is not None and floor > self._clock[k]:
            self._clock[k] = floor
        return self._clock[k]

    def before(self, overdue: Request, fair: Request) -> bool:
        """Whether `overdue` (past its wait bound) goes before `fair` (the queue's fair next
        request): always without shares or from one principal; else only if its principal is
        not ahead of `fair`'s. A principal past its share cannot make its backlog overdue and
        so jump the others (under a flood, all of it is)."""
        if not self.enabled or overdue.principal == fair.principal:
            return True
        vtime = self.vtimes[fair.level < BATCH_BELOW]
        return vtime.get(overdue.principal, 0.0) <= vtime.get(fair.principal, 0.0)

    def left(self, r: Request) -> None:
        """`r` ended, ran or not: it no longer keeps its principal active."""
        active = self._active[r.level < BATCH_BELOW]
        n = active.get(r.principal, 0)
        if n > 1:
            active[r.principal] = n - 1
        else:
            active.pop(r.principal, None)

    def dispatched(self, r: Request, device_s: float) -> None:
        """`r` starts; it is charged its estimated device share now."""
        r.charged_s = device_s
        k = r.level < BATCH_BELOW
        self._charge(r.principal, k, r.model, device_s, 0)
        running = self._running[k]
        running[r.principal] = running.get(r.principal, 0.0) + device_s / self.weight(r.principal)

    def ended(self, r: Request, now: float, concurrency: int) -> None:
        """Running `r` ended (or was cancelled) at `now`: its charge becomes its measured share
        of its model's device (its time over `concurrency`), and it leaves."""
        if r.dispatched_at is not None:
            k = r.level < BATCH_BELOW
            running = self._running[k]
            left_s = running.get(r.principal, 0.0) - r.charged_s / self.weight(r.principal)
            if left_s > 1e-9:
                running[r.principal] = left_s
            else:
                running.pop(r.principal, None)
            device_s = (now - r.dispatched_at) / concurrency
            self._charge(r.principal, k, r.model, device_s - r.charged_s, 0)
            r.charged_s = device_s
        self.left(r)

    def loaded(self, model: str, waiting: Mapping[Who, int], batch: bool, load_s: float) -> None:
        """A load of `model` took `load_s`; the principals `waiting` for it (work of class
        `batch`) pay, by count."""
        total = sum(waiting.values())
        if total <= 0 or load_s <= 0:
            return
        for p, n in waiting.items():
            if n:
                self._charge(p, batch, model, load_s * n / total, 1)

    def _charge(self, who: Who, batch: bool, model: str, device_s: float, kind: int) -> None:
        vtime = self.vtimes[batch]
        vtime[who] = vtime.get(who, 0.0) + device_s / self.weight(who)
        row = self.ledger.get((who, model))
        if row is None:
            row = self.ledger[(who, model)] = [0.0, 0.0]
        row[kind] += device_s

    def charged(self) -> dict[Who, tuple[float, float]]:
        """Per principal: (service_s, load_s) charged so far."""
        out: dict[Who, tuple[float, float]] = {}
        for (who, _model), (service_s, load_s) in self.ledger.items():
            s, ld = out.get(who, (0.0, 0.0))
            out[who] = (s + service_s, ld + load_s)
        return out
