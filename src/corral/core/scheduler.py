"""The scheduler: an event-driven state machine with no I/O.

Events in (`on_request`, `on_load_finished`, `on_load_failed`, `on_model_lost`,
`on_request_finished`, `on_cancel`, `on_timer`, and an operator's `on_load_requested` /
`on_unload_requested`); decisions out through `Effects`. Time comes from the injected clock.
One instance is owned by one task/thread: it is not thread-safe and needs no locks.

Shared rules, whatever the policy (see docs/design/scheduler.md):
- service classes (policies with `classes`): interactive work of any model goes before batch work
  of any model; a model serving only batch work yields to waiting interactive work of another
  model at its next request boundary (in-flight work finishes, nothing is aborted); batch work
  fills every idle slot and idle device;
- FIFO within a model among equal request priorities, higher request priority first;
- once a model's oldest pending interactive request has waited `max_wait_s` (policies with
  `bounded_wait`), that model is brought in next (after in-flight work drains and the resident
  model has served at least one round since it loaded); batch work has its own bound
  (`batch.max_wait_s`) that applies while no interactive request is past its bound; inside a
  model, overdue requests are served first;
- never more resident models than fit; never evict a model with requests in flight;
- with room for every model that has work, models load side by side and nothing is reordered;
- with nothing pending, resident models stay loaded (until their `ttl_s`, if set).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from corral.config import Config, ModelConfig
from corral.core.aborts import Aborts
from corral.core.backlog import Backlog, Level
from corral.core.board import Board
from corral.core.conversations import Conversations
from corral.core.effects import Effects
from corral.core.pagecache import PageCache
from corral.core.placement import Plan, plan_placement
from corral.core.policies import Policy, make_policy
from corral.core.replicas import Replicas
from corral.core.shares import Shares
from corral.core.sleep import Sleepers
from corral.core.state import ModelRecord, next_due, payers
from corral.core.stretch import WaitBound
from corral.core.swaps import LINGER_TIMER, Swaps
from corral.core.tiers import SchedulerBug, Tiers
from corral.core.traffic import demands
from corral.core.types import Grant, Lifecycle, Request, RequestState

_PENDING = RequestState.PENDING
_RUNNING = RequestState.RUNNING
_READY = Lifecycle.READY
_UNLOADED = Lifecycle.UNLOADED
_SLEEPING = Lifecycle.SLEEPING
_OVERDUE = "overdue"
_TTL = "ttl:"
_RESIDENT = "resident:"  # its min_resident_s ended: evictions it held back may go ahead

Clock = Callable[[], float]


class Scheduler:
    """Decides which model each device holds and which request runs next.

    Contract: every event method returns after issuing its effects synchronously; effects must
    not call back into the scheduler from inside the call (report outcomes as later events).
    """

    def __init__(
        self,
        config: Config,
        effects: Effects,
        clock: Clock,
        policy: Policy | None = None,
        replicas: bool | Collection[str] = True,
    ) -> None:
        """`replicas`: which models may have a second copy when the policy makes copies (all,
        none, or the names given): adapters name the models they can run twice."""
        self.config = config
        self.policy = policy if policy is not None else make_policy(config)
        self._fx = effects
        self._clock = clock
        self._classes = classes = self.policy.classes
        self._strict = self.policy.strict_order
        # Built in dependency order, each part from the parts it uses. The wait bound, per
        # class, configured and as the load leaves room for it (core/stretch.py).
        bounded = self.policy.bounded_wait
        self.wait = WaitBound(
            config.scheduler.max_wait_s if bounded else None,
            config.batch.max_wait_s if bounded and classes else None,
        )
        self.stretch = self.wait.stretch
        self.policy.wait = self.wait
        # Fair shares inside each class (core/shares.py), weighted as the config says; the
        # baselines (no classes) stand for tools that know no users.
        weights = {n: p.weight for n, p in config.server.principals.items()}
        self.shares = shares = Shares(weights, config.scheduler.fair_shares and classes)
        self.board = board = Board(config, classes, self.policy.weight, self._strict, shares)
        self.models = board.models
        self.devices = board.devices
        # Each model's file in the host's page cache, as measured (core/pagecache.py).
        self.files = PageCache(self.models, self.policy.rank)
        self._prepare = config.scheduler.prepare
        self.backlog = Backlog()  # an adapter's work by count: the worker's (core/backlog.py)
        self._solo = board.one_at_a_time()
        self._seq = 0
        self._need_decide = False
        self._deciding = False
        self._overdue_timer_at: float | None = None
        # Every move between residency tiers, and the decisions log (core/tiers.py).
        sleepers = Sleepers(self.devices, config.host.memory_gb, config.scheduler.sleepers == "lru")
        # What a swap throws away of each copy's conversations (core/conversations.py).
        self.conversations = Conversations(config)
        self.tiers = Tiers(self._fx, sleepers, self.conversations.left)
        self.decisions = self.tiers.decisions
        self.sleepers = self.tiers.sleepers
        # The replica and swap rules, as objects over the board's records.
        self.replicas = Replicas(
            self.policy,
            self.devices,
            self._fx,
            classes,
            bool(replicas) and self.policy.replicas and len(self.devices) > 1,
            None if isinstance(replicas, bool) else frozenset(replicas),
            self.wait.effective,
            board.pending,
        )
        self.aborts = Aborts(self.devices, self.tiers, board.incoming, self.wait.effective)
        self.swaps = Swaps(
            self.policy,
            board,
            self.replicas,
            self.wait,
            self._fx,
            config.scheduler.min_visit_swaps,
            self.tiers.start_load,
        )

    # --- events -------------------------------------------------------------------------------
    def on_request(self, r: Request) -> None:
        """A request arrived. Unknown models are rejected at once."""
        m = self.models.get(r.model)
        if m is None:
            r.state = RequestState.REJECTED
            self._fx.reject(r, f"unknown model {r.model!r}; known: {', '.join(self.models)}")
            return
        now = self._clock()
        self.files.arrived(m)
        self._seq += 1
        r.seq = self._seq
        r.arrived_at = now
        r.swaps_waited = -self.tiers.loads  # made a count at dispatch
        r.state = _PENDING
        self.board.add(m, r)
        m.est.observe_arrival(now)
        batch = r.background and self._classes  # counted as batch work
        state = m.state
        if m.idle_since is not None:
            m.est.observe_idle_gap(now - m.idle_since)
            if state is _READY:
                m.lingered_s += now - m.idle_since
            m.idle_since = None
        m.linger_until = None
        if state is _READY:
            if m.yielding:
                self._need_decide = True  # new work may change the policy's mind
            else:
                self._dispatch(m, now)
            if m.copies:
                for c in m.copies:
                    if c.state is _READY and not c.yielding:
                        self._dispatch(c, now)
            if self.replicas.enabled and m.count and self.replicas.worth_copy(m, now):
                self._need_decide = True
        elif state is _UNLOADED or state is _SLEEPING:
            if not self._solo or self.swaps.may_switch_to(m, now):
                self._need_decide = True
            bound = self.wait.effective(batch)
            if bound is not None and (m.count - m.icount if batch else m.icount) == 1:
                self._arm_overdue(now + bound)  # its class's first: the earliest deadline
        self._settle(now)

    def on_load_finished(
        self,
        model: str,
        load_s: float | None = None,
        unload_s: float | None = None,
        device: str | None = None,
        memory_gb: float | None = None,
    ) -> None:
        """`model` is ready (its copy on `device`; None: its only copy). Measured swap times, if
        given, refine the estimates; `memory_gb`, what its server reported it allocated, is the
        room it takes from now on (`Swaps.refit`)."""
        m = self.models[model]
        rec = _copy(m, device)
        woke = rec.state is Lifecycle.WAKING
        self.shares.loaded(model, payers(m), m.top_batch, self._clock() - rec.load_started_at)
        self.tiers.move(rec, _READY)
        assert rec.device is not None
        rec.device.loading = None
        m.est.observe_swap(load_s, unload_s, woke, rec.deep)
        rec.deep = False
        now = self._clock()
        rec.ready_at = now
        rec.lingered_s = 0.0
        if memory_gb is not None and memory_gb != rec.memory_gb:
            why = f"memory: {model} takes {memory_gb:g} GB"
            for v in self.swaps.refit(rec, memory_gb, now):
                self.tiers.drain(v, now, why)
        if rec.state is _READY and rec.spec.min_resident_s:
            self._fx.set_timer(now + rec.spec.min_resident_s, _RESIDENT + rec.name)
        if rec.state is _READY and m.count == 0:
            self._went_idle(rec, now)
        self._need_decide = True
        self._settle(now)

    def on_load_failed(self, model: str, reason: str, device: str | None = None) -> None:
        """`model` could not load (its copy on `device`; None: its only copy): its pending
        requests are rejected with `reason`, unless another copy of it serves them."""
        m = self.models[model]
        rec = _copy(m, device)
        dev = rec.device
        assert dev is not None
        self.shares.loaded(model, payers(m), m.top_batch, self._clock() - rec.load_started_at)
        dev.loading = None
        self.tiers.leave(rec)
        if rec is not m:  # a replica: the model is served; do not try again at once
            m.copy_failed_at = self._clock()
        if m.state is _UNLOADED:
            for r in m.pending():
                self.board.drop(r, RequestState.REJECTED)
                self._fx.reject(r, f"model {model!r} failed to load: {reason}")
        self._need_decide = True
        self._settle(self._clock())

    def on_model_lost(self, model: str, device: str | None = None) -> None:
        """A loaded model's server (its copy on `device`; None: its only copy) died. It takes
        no new work; once its in-flight requests have ended (the adapter fails them), it counts
        as unloaded, and its pending requests load it again like any other model's. Ignored
        unless that copy is ready."""
        m = self.models[model].copy_on(device)
        if m is None or m.state is not _READY or m.lost:
            return
        m.lost = True
        now = self._clock()
        if m.in_flight == 0:
            self.tiers.gone(m)
        self._need_decide = True
        self._settle(now)

    def on_request_finished(self, r: Request) -> bool:
        """A dispatched request ended (success or failure alike). Idempotent. Returns True if
        its slot stays taken instead: a backlog's last slot of a model whose count may be off,
        until an exact count comes (`on_backlog`; the adapter should send one soon)."""
        if r.state is not _RUNNING:
            return False
        if self.backlog.unsettled:
            q = self.models[r.model]
            if self.backlog.parks(r, q.queue.count == 0 and q.in_flight <= 1):
                return True
        now = self._clock()
        r.state = RequestState.DONE
        r.finished_at = now
        m = self.models[r.model]
        if r.dispatched_at is not None:
            m.est.observe_service(now - r.dispatched_at)
        self.shares.ended(r, now, m.concurrency)
        if m.copies:
            m = m.copy_on(r.device) or m
        m.in_flight -= 1
        self.conversations.finished(m, r)
        self._after_slot_freed(m, now)
        return False

    def on_backlog(self, grant: Grant, slots: Mapping[str, Mapping[Level, int] | int]) -> bool:
        """An adapter that hands its work out by count (the worker: tasks in its store) says
        how much of it waits, per model: slots of work per level ((interactive, priority)),
        exactly, or an upper bound on them all while its count may be off (tasks moving). The
        scheduler keeps that many pending requests of its own for the adapter, each granted
        through `grant`, adding new ones in level order across models (core/backlog.py).
        Returns whether the report was applied only in part (a bounded number of requests
        changes per report): the adapter then reports again soon."""
        for r in self.backlog.report(self, grant, slots):
            self.on_request_finished(r)  # settled: a parked last slot ends now
        return self.backlog.behind

    def on_backlog_moved(self, model: str) -> None:
        """Tasks of `model` move between the adapter's store and the adapter: until its next
        exact count, its last slot that ends stays taken, so it never looks idle with work."""
        self.backlog.moved(model)

    def on_cancel(self, r: Request) -> bool:
        """The submitter gave up on `r`. A pending request leaves the queue (never triggers a
        load); a running one frees its slot. Returns False if `r` had already ended."""
        now = self._clock()
        if r.state is RequestState.NEW:
            r.state = RequestState.CANCELLED
            return True
        if r.state is _PENDING:
            self.board.drop(r, RequestState.CANCELLED)
            self.aborts.unwanted(self.models[r.model], now)
            self._need_decide = True
            self._settle(now)
            return True
        if r.state is _RUNNING:
            r.state = RequestState.CANCELLED
            r.finished_at = now
            m = self.models[r.model]
            self.shares.ended(r, now, m.concurrency)
            if m.copies:
                m = m.copy_on(r.device) or m
            m.in_flight -= 1
            self._after_slot_freed(m, now)
            return True
        return False

    def on_load_requested(self, model: str, evict: bool = True) -> str | None:
        """An operator wants `model` loaded now (the load API, preloading at start). It loads
        where placement puts it, evicting only models without work (and none if not `evict`).
        Returns None if it is loading or resident, else why it cannot load now."""
        m = self.models[model]
        if m.resident:
            return None
        now = self._clock()
        plan: Plan | None = plan_placement(self.swaps.views(m, now))
        if plan is None:
            return "a swap is under way on every device that could hold it; try again after it"
        dev = next(d for d in self.devices if d.name == plan.device)
        victims = [dev.holding(n) for n in plan.evict]
        busy = [v for v in victims if v.count or v.in_flight or v.yielding]
        if busy:
            return "it would evict " + ", ".join(
                f"{v.name} ({v.count} queued, {v.in_flight} in flight)" for v in busy
            )
        if victims and not evict:
            return f"no free room: it would evict {', '.join(v.name for v in victims)}"
        self.tiers.start_load(m, dev, victims, now, "requested")
        self._need_decide = True
        self._settle(now)
        return None

    def on_unload_requested(self, model: str) -> str | None:
        """An operator wants `model` unloaded now. Only an idle model is: one with queued or
        running requests stays (it would load again at once). Returns None if it is unloaded
        (or was), else why not."""
        m = self.models[model]
        if m.state is _UNLOADED:
            return None
        if m.asleep:
            self.tiers.stop_sleeper(m, self._clock(), "requested")
            return None
        if any(c.state is not _READY for c in (m, *m.copies)):
            return "it is loading; unload it once it is ready"
        in_flight = m.in_flight + sum(c.in_flight for c in m.copies)
        if m.count or in_flight:
            return f"it has {m.count} queued and {in_flight} in flight requests"
        now = self._clock()
        for c in list(m.copies):
            self.tiers.unload(c, now, "requested")
            self._need_decide = True  # its room may go to waiting work
        self.tiers.unload(m, now, "requested")
        self._need_decide = True  # its room may go to waiting work
        self._settle(now)
        return None

    def on_keep_alive(self, model: str, ttl_s: float) -> None:
        """A request sets how long `model` stays once idle (Ollama's `keep_alive`): seconds,
        0 to unload as soon as it is idle, math.inf to stay until evicted. It holds until the
        next request that says otherwise; an idle model's timer starts again from now."""
        m = self.models[model]
        m.keep_alive_s = ttl_s
        now = self._clock()
        if m.state is not _READY or m.count or m.in_flight or m.yielding or m.lost:
            return  # a request is under way: the timer starts when the model goes idle
        m.idle_since = now
        if m.ttl_s is not None:
            self._fx.set_timer(now + m.ttl_s, _TTL + m.name)

    # --- the configuration changes (`corral serve --watch`) ----------------------------------
    def on_model_added(self, name: str, spec: ModelConfig) -> None:
        self.board.record(name, ModelRecord(name, spec, self._classes))
        self.conversations.add_model(name, spec)
        self._solo = self.board.one_at_a_time()

    def on_model_changed(self, name: str, spec: ModelConfig) -> None:
        """New settings for `model` (priority, concurrency, sizes); its measured estimates stay.
        A new command is `on_restart_requested`'s."""
        m = self.models[name]
        for c in (m, *m.copies):
            c.spec, c.priority, c.concurrency = spec, spec.priority, spec.concurrency
            c.memory_gb = spec.memory_gb  # the new configuration's size, until a load reports one
        self.conversations.add_model(name, spec)
        self._solo = self.board.one_at_a_time()
        self._need_decide = True
        self._settle(self._clock())

    def on_restart_requested(self, name: str) -> bool:
        """`model`'s server must start again (its command changed): each ready copy takes no
        new work and unloads once its requests end; its queue then loads it again. False while
        a copy is loading (ask again once it is ready)."""
        m = self.models[name]
        now = self._clock()
        while True:  # one copy at a time: a primary that leaves hands its record to a replica
            ready = [c for c in (m, *m.copies) if c.state is _READY and not c.lost]
            if not ready:
                break
            c = ready[0]
            self.tiers.drain(c, now, "restart")
            self._need_decide = True  # its room may go to waiting work
        self._need_decide = True
        self._settle(now)
        return all(c.state is not Lifecycle.LOADING for c in (m, *m.copies))

    def on_model_removed(self, name: str) -> bool:
        """Forget `model` once it is unloaded with nothing queued; False until then (it is
        unloaded as soon as it is idle)."""
        m = self.models[name]
        if m.asleep and not m.count:
            self.tiers.stop_sleeper(m, self._clock(), "removed")
        if m.state is not _UNLOADED or m.count:
            self.on_keep_alive(name, 0.0)
            return False
        del self.models[name]
        self._solo = self.board.one_at_a_time()
        return True

    def on_timer(self, key: str) -> None:
        """A timer set through `Effects.set_timer` fired."""
        now = self._clock()
        if key.startswith(_TTL):
            self._ttl_expired(self.models.get(key[len(_TTL) :]), now)
        elif key == _OVERDUE:
            if self._overdue_timer_at is not None and self._overdue_timer_at <= now:
                self._overdue_timer_at = None
        elif key.startswith(LINGER_TIMER):
            m = self.models.get(key[len(LINGER_TIMER) :])
            if m is not None:
                m.linger_timer_at = None
        self._need_decide = True
        self._settle(now)

    # --- views --------------------------------------------------------------------------------
    @property
    def loads(self) -> int:
        """Loads and wakes begun."""
        return self.tiers.loads

    # --- internals ----------------------------------------------------------------------------
    def _ttl_expired(self, m: ModelRecord | None, now: float) -> None:
        if m is None or m.state is not _READY or m.lost or m.yielding or m.count or m.in_flight:
            return  # busy again, or already gone: a later idle period sets a new timer
        ttl_s = m.ttl_s
        if ttl_s is None or m.idle_since is None:
            return
        due = m.idle_since + ttl_s
        if due > now:  # a stale timer from an earlier idle period, or fired a hair early
            self._fx.set_timer(due, _TTL + m.name)
            return
        self.tiers.unload(m, now, "ttl_s")
        self._need_decide = True  # its room may go to waiting work

    def _after_slot_freed(self, m: ModelRecord, now: float) -> None:
        """A request of copy `m` ended."""
        if m.lost:
            if m.in_flight == 0:
                if m.restarting:
                    self.tiers.unload(m, now, m.restarting)
                    self._need_decide = True  # its room may go to waiting work
                else:
                    self.tiers.gone(m)
                self._need_decide = True
            self._settle(now)
            return
        if m.recheck:
            m.recheck = False
            self._need_decide = True  # decide before refilling the slot; decide dispatches
        elif m.yielding:
            if m.in_flight == 0:
                self._need_decide = True
        elif m.queue.count:
            if self.shares.enabled and len(self.board.pending) > 1:
                self._need_decide = True  # a principal waiting elsewhere may be owed its share
            else:
                self._dispatch(m, now)
        if m.queue.count == 0 and m.in_flight == 0 and m.state is _READY:
            self._went_idle(m, now)
        self._settle(now)

    def _went_idle(self, m: ModelRecord, now: float) -> None:
        if m.primary is not None:  # a replica leaves once its model runs dry
            if self.replicas.leaves_idle(m, now):
                self.tiers.unload(m, now, "replica idle")
                self._need_decide = True  # its room may go to waiting work
            return
        m.idle_since = now
        linger = self.policy.linger_s(m, now)
        m.linger_until = now + linger if linger > 0 else None
        if m.ttl_s is not None:
            self._fx.set_timer(now + m.ttl_s, _TTL + m.name)
        if self.board.pending:
            self._need_decide = True

    def _dispatch(self, m: ModelRecord, now: float) -> None:
        """Start the next requests of m's queue (its primary's, for a replica) while copy m has
        free slots: interactive first (overdue ones first), then batch (overdue ones first)."""
        if m.lost:
            return
        board = self.board
        models = board.models
        q = m.primary or m
        assert m.device is not None
        device = m.device.name
        wait = self.wait
        while m.in_flight < m.concurrency and q.count:
            # The configured bound: this order forces no swap (core/stretch.py, WaitBound).
            r = next_due(q, wait.interactive_s, wait.batch_s, now)
            if self._strict and m.served:  # an unserved model gets its round (progress rule)
                head = board.head()
                hm = models[head.model] if head is not None else m
                if hm is not m and not hm.resident and hm not in board.incoming:
                    # The oldest request needs this model's room. Inside a decision that was
                    # just considered; from an event's fast path, decide now.
                    self._need_decide = self._need_decide or not self._deciding
                    return
            board.take(q, r)
            self.shares.dispatched(r, q.est.service_s / q.concurrency)
            r.state = _RUNNING
            r.dispatched_at = now
            r.device = device
            r.swaps_waited += self.tiers.loads
            m.in_flight += 1
            m.last_level = r.level
            m.served = True
            m.used_at = now
            self._fx.dispatch(r)

    def _settle(self, now: float) -> None:
        rounds = 0
        while self._need_decide:
            self._need_decide = False
            self._deciding = True
            try:
                self._decide(now)
            finally:
                self._deciding = False
            rounds += 1
            if rounds > 1_000:
                raise SchedulerBug("scheduler did not settle after 1,000 decisions")
        # Settled: the predicted next model, loaded ahead into free room (core/pagecache.py).
        if self._prepare and self.files.load_ahead(self.swaps, self.devices, self.tiers, now):
            self._need_decide = True
            self._settle(now)

    def _arm_overdue(self, at: float) -> None:
        armed = self._overdue_timer_at
        if armed is None or at < armed:
            self._overdue_timer_at = at
            self._fx.set_timer(at, _OVERDUE)

    def _decide(self, now: float) -> None:
        """Full decision: which models come in, who yields for them; then dispatch."""
        if self.stretch.due(now):
            self.stretch.update(now, *demands(self.models.values(), self.devices, now))
        for m in self.board.residents():
            m.yielding = False
        self.board.incoming.clear()
        forced, next_deadline = self.swaps.overdue(now)
        if next_deadline is not None:
            self._arm_overdue(next_deadline)
        if self.replicas.enabled:
            # A model whose arrivals outrun its copies gets its next copy before any candidate
            # once its queue has waited half the bound: it grows until then. Left to devices
            # the candidates leave idle, the copy came minutes late, at a time that depended
            # on timing (devices-8 live, docs/design/scheduler.md).
            if forced is None:
                self.swaps.replicate(now, outpaced=True)
            else:
                # A model whose backlog is older than the overdue model's gets its copy first.
                self.swaps.replicate(now, forced.oldest())
        candidates = [m for m in self.board.pending if not m.resident]
        if candidates:
            if self._solo:
                self.swaps.swap_solo(candidates, forced, now)
            else:
                self.swaps.swap_placed(candidates, forced, now)
        if self.replicas.enabled:
            self.swaps.replicate(now)
        if self._classes and candidates and self.aborts.for_interactive(candidates, now):
            self._need_decide = True
        for m in list(self.board.residents()):
            if m.state is _READY and not m.yielding and m.queue.count:
                self._dispatch(m, now)


def _copy(m: ModelRecord, device: str | None) -> ModelRecord:
    """`m`'s copy on `device` (None: its only copy), which an event names."""
    rec = m.copy_on(device)
    if rec is None:
        raise SchedulerBug(f"{m.name}: an event for a copy on {device!r}, which it lacks")
    return rec
