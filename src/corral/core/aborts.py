"""Which loads stop before they finish (`Aborts`, an object the scheduler calls): a load or
wake that no waiting request needs any more (docs/design/sleep.md, "Aborted loads"). Only
`Tiers.abort` carries an abort out; the rules are here."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from corral.core.state import DeviceRecord, ModelRecord
from corral.core.tiers import Tiers
from corral.core.types import Lifecycle

_ARRIVING = frozenset({Lifecycle.LOADING, Lifecycle.WAKING})
# Loads that are never aborted: an operator's, and those the wait bound forced.
_KEPT_LOADS = frozenset({"requested", "max_wait_s reached"})


class Aborts:
    """`devices` and `tiers` are the scheduler's; `incoming`, the models whose room is being
    freed; `bound_s(batch)`, a class's wait bound now."""

    def __init__(
        self,
        devices: Sequence[DeviceRecord],
        tiers: Tiers,
        incoming: Collection[ModelRecord],
        bound_s: Callable[[bool], float | None],
    ) -> None:
        self._devices = devices
        self._tiers = tiers
        self._incoming = incoming
        self._bound_s = bound_s

    def unwanted(self, m: ModelRecord, now: float) -> None:
        """The last waiting request of `m` left: a load or wake begun for its work stops."""
        if m.count:
            return
        for c in (m, *m.copies):
            if c.state in _ARRIVING and c.in_flight == 0 and c.load_reason not in _KEPT_LOADS:
                self._tiers.abort(c, now, "its waiting requests left")

    def for_interactive(self, candidates: list[ModelRecord], now: float) -> bool:
        """A person's request whose model found no room while a device loads a model for batch
        work only: that load stops, unless letting it finish (then one batch answer, then an
        unload) would cost the person less, or unless the person's model could go to another
        device (there, other work ends sooner or later; an abort only wastes the load: seen on
        the robustness family, docs/design/sleep.md). Loads an operator asked for, those whose
        batch work is past its bound, replicas' loads, and loads on a device that saw an abort
        at this instant go on (so aborts can never repeat within one decision). True if one
        stopped (decide again)."""
        waiting = [c for c in candidates if c.icount and not c.resident and c not in self._incoming]
        if not waiting:
            return False
        bound = self._bound_s(True)
        for d in self._devices:
            c = d.loading
            if c is None or c.in_flight or c.load_reason in _KEPT_LOADS or d.aborted_at == now:
                continue
            if c.primary is not None:
                continue  # a replica: the copy rules would take the device again at once
            q = c.queue
            if q.icount:
                continue
            oldest = q.oldest(True)
            if bound is not None and oldest is not None and oldest.arrived_at + bound <= now:
                continue  # its batch work is overdue: the bound keeps the load
            if c.state is Lifecycle.WAKING:
                est = c.est.wake2_s if c.deep else c.est.wake_s
            else:
                est = c.est.begun_load_s
            left_s = c.load_started_at + est - now
            if left_s <= q.est.service_s + c.est.unload_s:
                continue
            if any(_only_use(w, d, self._devices) for w in waiting):
                self._tiers.abort(c, now, "a person's request needs the device")
                return True
        return False


def _may_use(m: ModelRecord, d: DeviceRecord) -> bool:
    """Non-resident `m` could be brought in on `d` (its devices, its size)."""
    allowed = not m.spec.devices or d.name in m.spec.devices
    return allowed and d.size_of(m) <= d.capacity


def _only_use(m: ModelRecord, d: DeviceRecord, devices: Sequence[DeviceRecord]) -> bool:
    """`d` is the one device non-resident `m` could be brought in on."""
    return _may_use(m, d) and not any(_may_use(m, e) for e in devices if e is not d)
