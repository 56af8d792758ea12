"""Where each model copy is (`Tiers`, an object the scheduler owns and calls): the moves between
unloaded, loading, ready, sleeping and waking, the device records' residents and sleepers, the
effects that carry them out, the count of loads and the recent-decisions log. Who moves and
when is decided elsewhere (scheduler.py, swaps.py, replicas.py); every move happens here."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from corral.core.effects import Effects
from corral.core.sleep import Sleepers
from corral.core.state import DeviceRecord, ModelRecord, who_top
from corral.core.types import TRANSITIONS, Decision, Lifecycle

# What a replica that becomes the primary brings with it.
_RESIDENCY = (
    "device",
    "in_flight",
    "last_level",
    "linger_timer_at",
    "linger_until",
    "lingered_s",
    "load_started_at",
    "lost",
    "quantum_timer_at",
    "ready_at",
    "recheck",
    "served",
    "state",
    "yielding",
)
_READY = Lifecycle.READY
_UNLOADED = Lifecycle.UNLOADED


class SchedulerBug(RuntimeError):
    """The scheduler failed to settle or broke its own books: a bug in Corral, never a user
    error."""


class Tiers:
    """The moves, over the records of the scheduler's board."""

    def __init__(
        self,
        fx: Effects,
        sleepers: Sleepers,
        forget: Callable[[ModelRecord], None] = lambda _: None,
    ) -> None:
        """`forget(copy)`: `copy`'s server no longer holds its conversations (it left)."""
        self._fx = fx
        self.sleepers = sleepers
        self._forget = forget
        self.loads = 0  # loads and wakes begun
        self.decisions: deque[Decision] = deque(maxlen=256)

    @staticmethod
    def move(m: ModelRecord, to: Lifecycle) -> None:
        if to not in TRANSITIONS[m.state]:
            raise SchedulerBug(f"{m.name}: {m.state.value} -> {to.value} is not a lifecycle move")
        m.state = to

    def leave(self, m: ModelRecord) -> DeviceRecord:
        """`m` is no longer resident (evicted, unloaded, lost, failed to load or aborted);
        returns where it was."""
        dev = m.device
        assert dev is not None
        dev.residents.remove(m)
        self.move(m, Lifecycle.UNLOADED)
        self._forget(m)
        m.device = None
        m.lost = m.yielding = m.recheck = m.deep = False
        m.restarting = ""
        m.linger_until = None  # idle_since stays: the next arrival still measures the gap
        if m.primary is not None:
            m.primary.copies.remove(m)
        elif m.copies:
            self._promote(m)
        return dev

    @staticmethod
    def _promote(m: ModelRecord) -> None:
        """Primary `m` just left: its first ready replica (else its first) becomes the primary
        (the model's record stays the one the queue, the maps and the policies know)."""
        c = next((c for c in m.copies if c.state is _READY), m.copies[0])
        m.copies.remove(c)
        dev = c.device
        assert dev is not None
        dev.residents[dev.residents.index(c)] = m
        if dev.loading is c:
            dev.loading = m
        for name in _RESIDENCY:
            setattr(m, name, getattr(c, name))
        c.state, c.device = _UNLOADED, None

    def gone(self, m: ModelRecord) -> None:
        """`m`'s server is gone (it died): it leaves, with nothing to unload."""
        self.leave(m)
        m.idle_since = None

    def unload(self, m: ModelRecord, now: float, reason: str) -> None:
        """Unload idle `m` with nothing loaded in its place."""
        dev = self.leave(m)
        self.decisions.append(Decision(now, None, dev.name, (m.name,), reason))
        self._fx.unload(m.name, dev.name)

    def drain(self, m: ModelRecord, now: float, reason: str) -> None:
        """Ready `m` leaves on purpose: at once if idle, else it takes no new work and unloads
        once its requests in flight end (the scheduler's `_after_slot_freed`)."""
        if m.in_flight == 0:
            self.unload(m, now, reason)
        else:
            m.lost, m.restarting = True, reason

    def start_load(
        self, c: ModelRecord, dev: DeviceRecord, victims: list[ModelRecord], now: float, reason: str
    ) -> None:
        """Bring `c` in on `dev` (a load, or a wake if it sleeps there), `victims` leaving:
        each falls asleep or stops (core/sleep.py)."""
        if c.asleep and c.device is not dev:
            self.stop_sleeper(c, now, "loads on another device")
        plan = self.sleepers.plan(victims, c, now) if victims else None
        stop, asleep, deep = (plan.stop, plan.sleep, plan.deep) if plan else ([], [], [])
        for s in plan.drop if plan else ():
            self.stop_sleeper(s, now, "host memory")
        for v in victims:
            assert v.in_flight == 0, "evicting a model with requests in flight"
            if v.primary is None and v.count and (who := who_top(c.primary or c)):
                v.owed_return = (now, dict(who))  # its way back is the newcomers' (`payers`)
            if v in asleep:
                self._fall_asleep(v, v in deep)
            else:
                self.leave(v)
        wake = c.asleep
        if wake:
            dev.sleepers.remove(c)
            self.move(c, Lifecycle.WAKING)
        else:
            self.move(c, Lifecycle.LOADING)
        c.load_started_at = now
        c.queue.est.load_begins()
        c.load_reason = reason
        c.device = dev
        c.idle_since = None
        c.served = False
        dev.residents.append(c)
        dev.loading = c
        self.loads += 1
        evict = tuple(v.name for v in stop)
        slept = tuple(v.name for v in asleep)
        self.decisions.append(Decision(now, c.name, dev.name, evict, reason, slept, wake))
        if deep:
            deeper = tuple(v.name for v in deep)
            self._fx.load(c.name, dev.name, evict, sleep=slept, wake=wake, deep=deeper)
        elif slept or wake:
            self._fx.load(c.name, dev.name, evict, sleep=slept, wake=wake)
        else:
            self._fx.load(c.name, dev.name, evict)

    def abort(self, c: ModelRecord, now: float, reason: str) -> None:
        """Stop `c`'s load or wake under way (an aborted wake stops the server too)."""
        dev = c.device
        assert dev is not None
        assert dev.loading is c, "aborting a copy that is not loading"
        dev.loading = None
        dev.aborted_at = now
        self.leave(c)
        self.decisions.append(Decision(now, None, dev.name, (c.name,), f"load aborted: {reason}"))
        self._fx.abort(c.name, dev.name)

    def _fall_asleep(self, v: ModelRecord, deep: bool) -> None:
        """Evicted `v` sleeps on its device: no room there, host memory held (none `deep`, at
        level 2), wakes there."""
        dev = v.device
        assert dev is not None
        dev.residents.remove(v)
        self.move(v, Lifecycle.SLEEPING)
        self._forget(v)  # a sleeping server keeps no prompt cache (docs/design/sleep.md)
        v.deep = deep
        dev.sleepers.append(v)
        v.yielding = v.recheck = False
        v.linger_until = None

    def stop_sleeper(self, s: ModelRecord, now: float, reason: str) -> None:
        """Stop sleeping `s`'s server: its host memory frees; it loads from scratch next."""
        dev = s.device
        assert dev is not None
        dev.sleepers.remove(s)
        self.move(s, Lifecycle.UNLOADED)
        s.device = None
        s.deep = False
        self.decisions.append(Decision(now, None, dev.name, (s.name,), f"asleep, {reason}"))
        self._fx.unload(s.name, dev.name)
