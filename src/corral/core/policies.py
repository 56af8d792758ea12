"""The five scheduling policies. Pure: they read model records and the time, and decide.

A policy answers three questions for the scheduler (which owns all state and acts on the answers):
- `rank`: in what order should non-resident models with work be brought in?
- `should_yield`: should a resident model stop taking new work to make room for a challenger?
- `linger_s`: how long should a model that just went idle stay when others wait (debounce)?
The shared rules (FIFO within a model and request priority, service classes, the `max_wait_s`
bound, capacity, no eviction with work in flight) live in the scheduler, so no policy can break
them. Policies price each model by its *top class* (its interactive work while it has any, else
its batch work): the scheduler only ever asks them to compare models of the same class.
"""

from __future__ import annotations

from collections.abc import Callable

from corral.config import Config, PolicyName
from corral.core.state import ModelRecord, priority_of
from corral.core.stretch import WaitBound

_NEVER = 1 << 62
# A predictable model lingers at least this fraction of a reload (see `Cost.linger_s`).
LINGER_FLOOR = 0.25


def oldest_seq(m: ModelRecord) -> int:
    r = m.oldest_top()
    return r.seq if r is not None else _NEVER


def lingering(m: ModelRecord, now: float) -> bool:
    return m.linger_until is not None and now < m.linger_until


class Policy:
    """Base: serve the resident model while it has work; challengers ranked by oldest request."""

    name: str = "fifo-plus"  # a policy of Corral's (`PolicyName`), or a simulator baseline's
    bounded_wait = True  # honours scheduler.max_wait_s
    strict_order = False  # only the model of the oldest request may take new work
    classes = True  # interactive work before batch work (the baselines ignore classes)
    replicas = False  # a model with a deep queue may get a second copy on another device
    wait: WaitBound | None = None  # the scheduler's wait bound (core/stretch.py)

    def rank(self, candidates: list[ModelRecord], now: float) -> list[ModelRecord]:
        return sorted(candidates, key=lambda m: (oldest_seq(m), m.name))

    def should_yield(self, resident: ModelRecord, challenger: ModelRecord, now: float) -> bool:
        return resident.count == 0 and not lingering(resident, now)

    def linger_s(self, m: ModelRecord, now: float) -> float:
        return 0.0

    def keep_value(self, m: ModelRecord, now: float) -> float:
        return float(m.count)

    def weight(self, priority: int) -> float:
        """Weight of a request of this priority in queue prices (the cost policy uses it)."""
        return 1.0


class Fifo(Policy):
    """Strict arrival order: the oldest pending request's model runs next (swap if needed).
    The baseline: Ollama's scheduler and simple FIFO workers (corral/sim/baselines.py says how
    Ollama's matches); arrival order is its only bound, so it ignores max_wait_s (a per-model
    turn would contradict strict order)."""

    name: PolicyName = "fifo"
    strict_order = True
    bounded_wait = False
    classes = False

    def should_yield(self, resident: ModelRecord, challenger: ModelRecord, now: float) -> bool:
        return oldest_seq(challenger) < oldest_seq(resident)


class Grouped(Policy):
    """Naive collation: when the resident model runs dry, switch to the longest queue.
    Ignores max_wait_s: it is the baseline that starves rare models."""

    name: PolicyName = "grouped"
    bounded_wait = False
    classes = False

    def rank(self, candidates: list[ModelRecord], now: float) -> list[ModelRecord]:
        return sorted(candidates, key=lambda m: (-m.n_top, oldest_seq(m), m.name))


class FifoPlus(Policy):
    """Exhaustive service of the resident model, then the model with the oldest request."""

    name: PolicyName = "fifo-plus"


class Priority(Policy):
    """Model priority first (ties: oldest request); higher priority preempts between requests;
    `unload_delay_s` keeps an idle model loaded unless strictly higher-priority work waits."""

    name: PolicyName = "priority"

    def rank(self, candidates: list[ModelRecord], now: float) -> list[ModelRecord]:
        return sorted(candidates, key=lambda m: (-m.priority, oldest_seq(m), m.name))

    def should_yield(self, resident: ModelRecord, challenger: ModelRecord, now: float) -> bool:
        if challenger.priority > resident.priority:
            return True
        return resident.count == 0 and not lingering(resident, now)

    def linger_s(self, m: ModelRecord, now: float) -> float:
        return m.spec.unload_delay_s

    def keep_value(self, m: ModelRecord, now: float) -> float:
        return m.priority * 1e9 + m.count


class Cost(Policy):
    """Smith's rule with setup times, weighted by request priority and age (docs/design).

    A queue's weight is W = Σ b^priority · min(1 + ā/age_weight_s, max_age_factor), ā the queue's
    weight-averaged age (aging breaks ties toward old work; `max_wait_s` is the hard bound, so the
    factor is capped and an old backlog never outweighs higher-priority work); its work
    P = n·service/concurrency.
    Challengers rank by W / (load + P). A resident model with work yields only to a challenger c
    whose most important request outranks all of the resident's, and only if serving c first
    lowers weighted completion time by the pairwise-interchange test
    w_c·P_r > (1 + hysteresis)·w_r·(swap_in + P_c + swap_back), with w the queues' weights without
    age credit: aging only ranks waiting queues. With the same weights on both sides the test is
    antisymmetric (multiplying both directions' inequalities is a contradiction), so two models
    can never preempt each other back and forth; at equal request priority and similar service
    times it never fires, which is exhaustive service, the optimum of polling theory.
    """

    name: PolicyName = "cost"
    replicas = True

    def __init__(
        self,
        base: float = 10.0,
        age_weight_s: float = 60.0,
        hysteresis: float = 0.5,
        linger: bool = True,
        max_age_factor: float = 3.0,
        max_wait_s: float | None = None,
        batch_max_wait_s: float | None = None,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.batch_max_wait_s = batch_max_wait_s
        self.base = base
        self.age_weight_s = age_weight_s
        self.max_age_factor = max_age_factor
        self.hysteresis = hysteresis
        self.linger = linger

    def weight(self, priority: int) -> float:
        return float(self.base**priority)

    def queue_weight(self, m: ModelRecord, now: float) -> float:
        w = m.w_top
        if w <= 0.0:
            return 0.0
        mean_age = now - m.wa_top / w
        return w * min(1.0 + mean_age / self.age_weight_s, self.max_age_factor)

    @staticmethod
    def work_s(m: ModelRecord) -> float:
        return m.n_top * m.est.service_s / m.concurrency

    def bound_s(self, m: ModelRecord) -> float | None:
        """The wait bound of m's top class."""
        if self.wait is not None:  # the scheduler's: as the load leaves room for it
            return self.wait.effective(m.top_batch)
        return self.batch_max_wait_s if m.top_batch else self.max_wait_s

    def rank(self, candidates: list[ModelRecord], now: float) -> list[ModelRecord]:
        """Smith's order, subject to deadlines: queues whose oldest request has used half of
        `max_wait_s`, or would pass it while the best queue is served, go first, earliest
        deadline first (EDF keeps every queue inside the bound whenever that is feasible)."""

        def key(m: ModelRecord) -> tuple[float, int, str]:
            value = self.queue_weight(m, now) / (m.return_s + self.work_s(m) + 1e-9)
            return (-value, oldest_seq(m), m.name)

        order = sorted(candidates, key=key)
        bound = self.bound_s(order[0]) if order else None  # candidates share a class
        if bound is None or len(order) < 2:
            return order
        top = order[0]
        horizon = max(now + top.return_s + self.work_s(top), now + 0.5 * bound)
        urgent: list[tuple[float, ModelRecord]] = []
        for m in order:
            r = m.oldest_top()
            if r is not None and r.arrived_at + bound <= horizon:
                urgent.append((r.arrived_at, m))
        if not urgent:
            return order
        # EDF while it can still keep the deadline: a queue whose deadline is lost even if it
        # went first behind the urgent ones before it keeps its value's place. Under overload,
        # plain EDF turns into arrival order for everyone, every deadline missed and the mean
        # wait up too (devices-4, docs/design/scheduler.md).
        first: list[ModelRecord] = []
        t = now
        for at, m in sorted(urgent, key=lambda x: (x[0], x[1].name)):
            t += m.return_s + self.work_s(m)
            if t <= at + bound:
                first.append(m)
        return first + [m for m in order if m not in first]

    def should_yield(self, resident: ModelRecord, challenger: ModelRecord, now: float) -> bool:
        if resident.count == 0:
            if not lingering(resident, now):
                return True
            # Lingering never holds the device against heavier work or an urgent queue.
            best = challenger.best()
            if best is not None and best.level > resident.last_level:
                return True
            if self._urgent(challenger, now):
                return True
            # Nor, rent-or-buy, once the challenger has waited, while the resident idled,
            # the round trip a hold saves: under Poisson overload each request renews the
            # linger, and the holds added up (crowded family, docs/benchmarks.md).
            oldest = challenger.oldest_top()
            if oldest is not None:
                waited_s = now - oldest.arrived_at
                # A backlog (open-loop arrivals) has waited out the round trip whatever the
                # resident did meanwhile; one closed loop's step counts only the idling.
                if challenger.n_top == 1:
                    idle_s = resident.lingered_s
                    if resident.idle_since is not None:
                        idle_s += now - resident.idle_since
                    waited_s = min(waited_s, idle_s)
                if waited_s >= resident.leave_s + resident.comeback_s:
                    return True
            # Nor against waiting work that the hold costs more than the swap it saves: the
            # request it lingers for (its last one's weight, due within its expected late gap,
            # then served) priced like a queue. A closed loop's next step, against another
            # loop's one waiting step, holds; against an overloaded Poisson stream's backlog
            # the hold only idles the device (crowded family, docs/benchmarks.md).
            e = resident.est
            next_s = (e.late_gap_s or 0.0) + e.service_s / resident.concurrency
            return self._serve_first(
                challenger, resident, self.weight(priority_of(resident.last_level)), next_s
            )
        # Among equals, exhaustive service (never leave a queue with work) is optimal and
        # stable; only strictly more important work may interrupt a visit.
        top_c, top_r = challenger.best(), resident.best()
        if top_c is None or top_r is None or top_c.level <= top_r.level:
            return False
        return self._serve_first(challenger, resident, resident.w_top, self.work_s(resident))

    def _serve_first(
        self, challenger: ModelRecord, resident: ModelRecord, w_r: float, work_r_s: float
    ) -> bool:
        """The pairwise-interchange test: does serving `challenger` before the resident's work
        (weight `w_r`, `work_r_s` of device time) lower weighted completion time, by more than
        the hysteresis?"""
        # A model that sleeps leaves in its sleep time and comes back in its wake time; what
        # leaving now throws away of its conversations is paid again when it comes back
        # (core/conversations.py).
        swap_in = resident.leave_s + challenger.return_s
        swap_back = challenger.leave_s + resident.comeback_s + resident.est.refill_s
        return challenger.w_top * work_r_s > (1.0 + self.hysteresis) * w_r * (
            swap_in + self.work_s(challenger) + swap_back
        )

    def _urgent(self, m: ModelRecord, now: float) -> bool:
        """m's oldest request of its top class has used half of its class's wait bound."""
        bound = self.bound_s(m)
        if bound is None:
            return False
        r = m.oldest_top()
        return r is not None and now - r.arrived_at >= 0.5 * bound

    def linger_s(self, m: ModelRecord, now: float) -> float:
        delay = m.spec.unload_delay_s
        expected_late = m.est.late_gap_s
        if self.linger and expected_late is not None:
            # Not counting what leaving throws away of its conversations: in agent loops over
            # several models a model's next step waits for the others' (docs/benchmarks.md).
            round_trip = m.leave_s + m.comeback_s
            # Rent-or-buy: wait only when the next request is reliably due sooner than a reload
            # would take (closed-loop think times are; Poisson gaps are not).
            if expected_late <= round_trip:
                # The floor absorbs jitter in very short gaps (a client's thread not yet
                # scheduled): waiting LINGER_FLOOR of a reload costs little when the loop has
                # ended, while a false swap costs a whole reload and another to come back.
                want = max(expected_late + m.est.idle_gap_dev_s, LINGER_FLOOR * round_trip)
                delay = max(delay, min(want, round_trip))
        return delay

    def keep_value(self, m: ModelRecord, now: float) -> float:
        return self.queue_weight(m, now) / (self.work_s(m) + 1e-9) if m.count else 0.0


def make_policy(config: Config) -> Policy:
    """The policy named in `config`, with its parameters."""
    c = config.scheduler.cost
    makers: dict[PolicyName, Callable[[], Policy]] = {
        "fifo": Fifo,
        "grouped": Grouped,
        "fifo-plus": FifoPlus,
        "priority": Priority,
        "cost": lambda: Cost(
            c.priority_base,
            c.age_weight_s,
            c.hysteresis,
            c.linger,
            c.max_age_factor,
            config.scheduler.max_wait_s,
            config.batch.max_wait_s,
        ),
    }
    return makers[config.scheduler.policy]()
