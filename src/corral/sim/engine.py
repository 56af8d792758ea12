"""Discrete-event simulator: a virtual clock driving the real `Scheduler` (not a copy).

Timing rules: a swap takes the evicted models' `unload_s` (`sleep.sleep_s` for those put to
sleep), then the new model's `load_s` (`sleep.wake_s` for a wake), one after the other; an unload
on its own (`ttl_s`, an operator's) takes `unload_s`, and stopping a sleeping model takes no
device time; a device does one such operation at a time. A model runs up to `concurrency`
requests at once, each at its solo speed (`service_s` from the trace), i.e. parallel slots scale
throughput linearly, as continuous batching does below saturation; requests that arrive during a
swap queue; ties in time go by line order, and at one instant finishes come before load
completions, then arrivals, then timers.

Conversations (a trace's `context_tokens`): a model copy's server holds the
conversations of its last `concurrency` sessions (one per slot); a request whose conversation
it holds processes only its new tokens, others their whole context, at the model's
`prefill_tok_s`, on top of `service_s`. A copy that leaves its device loses them; where the
model keeps its prompt caches (`Config.keeps_prompt_cache`), each of at least
`prompt_cache.min_tokens` is saved first (its tokens at `prompt_cache.state_tok_s`, added to
the unload), kept within `prompt_cache.max_gb` (at the model's `kv_bytes_per_token`, least
recently used dropped first), and restored at the same speed when its session comes back.

The page cache (`host.page_cache_gb`): a load reads its file's uncached share at
`host.disk_read_gb_s` on top of `load_s` (sim/pagecache.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.config import Config, ModelConfig
from corral.core import Request, Scheduler
from corral.policy_names import SimPolicyName
from corral.sim.baselines import LlamaSwap
from corral.sim.lru_route import LruRoute
from corral.sim.pagecache import SimPageCache
from corral.sim.trace import Trace, TraceLine

_FINISH, _LOAD, _ARRIVAL, _TIMER, _PREPARED = 0, 1, 2, 3, 4
_EPS = 1e-9


class InvariantViolation(AssertionError):
    """The scheduler broke a rule the simulator checks independently (`check=True`)."""


class SimRequest(Request):
    __slots__ = ("line", "service_s", "session")

    def __init__(self, src: TraceLine) -> None:
        super().__init__(src.line, src.model, src.priority, src.background, None, src.principal)
        self.line = src.line
        self.service_s = src.service_s
        self.session = src.session
        if src.context_tokens and src.session is not None:
            self.conversation = src.session
            self.context_tokens = src.context_tokens


class Prompts:
    """The conversations' side of the simulation (the module docstring's rules): what each
    model copy's server holds, the saved states, and what prefill, saves and restores cost."""

    def __init__(self, config: Config) -> None:
        self.config = config
        pc = config.prompt_cache
        self._keeps = {m: config.keeps_prompt_cache(m) for m in config.models}
        self._held: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        self._saved: dict[tuple[str, str], int] = {}  # (model, session) -> tokens, LRU first
        self._budget = pc.max_gb * 1024**3
        self._bytes = 0.0
        self.prefill_tokens = 0  # figures of the run
        self.restores = 0
        self.restored_tokens = 0
        self.saves = 0

    def _size(self, model: str, tokens: int) -> float:
        return float(tokens * (self.config.models[model].kv_bytes_per_token or 0))

    def start(self, r: SimRequest, device: str) -> float:
        """Seconds `r` takes on its copy on `device` beyond its `service_s`: the restore of
        its saved state, and the prefill of what its server does not hold."""
        session, tokens = r.conversation, r.context_tokens
        if session is None or not tokens:
            return 0.0
        model = r.model
        cached = min(tokens, self._held[model, device].get(session, 0))
        extra_s = 0.0
        saved = self._saved.pop((model, session), None)
        if saved is not None:  # least recently used last: it is used now
            self._saved[model, session] = saved
            if not cached:
                cached = min(tokens, saved)
                extra_s += saved / self.config.prompt_cache.state_tok_s
                self.restores += 1
                self.restored_tokens += saved
        speed = self.config.models[model].prefill_tok_s
        r.prefill_tokens = tokens - cached
        r.prefill_s = r.prefill_tokens / speed if speed else 0.0
        self.prefill_tokens += r.prefill_tokens
        return extra_s + r.prefill_s

    def finishing(self, then: Callable[[Request], object]) -> Callable[[Request], object]:
        """`then` (the scheduler's hearing of a finished request), after `finish`."""

        def finished(r: Request) -> object:
            assert r.device is not None
            self.finish(r, r.device)
            return then(r)

        return finished

    def finish(self, r: Request, device: str) -> None:
        """`r` ended: its copy's server holds its conversation (its context), one a slot."""
        if r.conversation is None or not r.context_tokens:
            return
        held = self._held[r.model, device]
        held.pop(r.conversation, None)
        held[r.conversation] = r.context_tokens
        while len(held) > max(1, self.config.models[r.model].concurrency):
            del held[next(iter(held))]

    def leave(self, model: str, device: str, stops: bool) -> float:
        """`model`'s copy leaves `device` (`stops`: its server stops, else it sleeps, which
        keeps nothing): seconds its saves take."""
        held = self._held.pop((model, device), {})
        if not stops or not self._keeps[model]:
            return 0.0
        pc = self.config.prompt_cache
        took_s = 0.0
        for session, tokens in held.items():
            if tokens < max(1, pc.min_tokens):
                continue
            old = self._saved.pop((model, session), None)
            if old is not None:
                self._bytes -= self._size(model, old)
            self._saved[model, session] = tokens
            self._bytes += self._size(model, tokens)
            took_s += tokens / pc.state_tok_s
            self.saves += 1
        while self._bytes > self._budget and self._saved:
            (m, _), tokens = next(iter(self._saved.items()))
            del self._saved[next(iter(self._saved))]
            self._bytes -= self._size(m, tokens)
        return took_s


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of a device's time: `swap` (unloading then loading `model`), `aborted` (a swap
    whose load was stopped), `unload` (of `model`, nothing loaded in its place) or
    `resident`."""

    device: str
    model: str
    kind: str
    start_s: float
    end_s: float


@dataclass
class Run:
    """Everything one simulated run produced."""

    policy: str
    config: Config
    trace: Trace
    requests: list[SimRequest]
    segments: list[Segment]
    loads: dict[str, int]
    busy_s: dict[str, float]
    swap_s: dict[str, float]
    rejected: list[tuple[SimRequest, str]] = field(default_factory=list)
    wakes: dict[str, int] = field(default_factory=dict)  # of `loads`, those that were wakes
    aborted: dict[str, int] = field(default_factory=dict)  # of `loads`, those stopped midway
    prompts: Prompts | None = None  # conversations: prefill, saves and restores (if any)
    files: SimPageCache | None = None  # the host's page cache (if modelled)
    # Per principal: (service_s, load_s) charged by the scheduler's fair shares.
    charged: dict[str | None, tuple[float, float]] = field(default_factory=dict)


class Simulation:
    """Runs `config`'s policy over `trace`. It is the scheduler's `Effects`.

    `check=True` makes it verify, from its own books, that no model with requests in flight is
    evicted, that devices never hold more than fits, and that requests go only to ready models.
    """

    def __init__(
        self,
        config: Config,
        trace: Trace,
        *,
        check: bool = False,
        progress: Callable[[int, int], None] | None = None,
        policy: SimPolicyName | None = None,
    ) -> None:
        """`policy`: run this one rather than `config`'s (a baseline such as `lru-route` too)."""
        if policy is not None and policy != "lru-route" and policy != "llama-swap":
            config = config.with_policy(policy)
        self.config = config
        self.trace = trace
        self.now = 0.0
        self.check = check
        self._progress = progress
        self._heap: list[tuple[float, int, int, Any]] = []  # (time, kind, seq, payload)
        self._seq = 0
        self._requests = [SimRequest(x) for x in trace.lines]
        self._sessions: dict[str, list[SimRequest]] = defaultdict(list)
        self._open: list[SimRequest] = []
        starts: dict[str, float] = {}
        for src, r in zip(trace.lines, self._requests, strict=True):
            if src.session is None:
                self._open.append(r)
            else:
                if src.session not in self._sessions:
                    starts[src.session] = src.t or 0.0
                self._sessions[src.session].append(r)
        self._open_t = [x.t or 0.0 for x in trace.lines if x.session is None]
        order = sorted(range(len(self._open)), key=lambda i: (self._open_t[i], self._open[i].line))
        self._open = [self._open[i] for i in order]
        self._open_t = [self._open_t[i] for i in order]
        self._think = {r.line: x.think_s for x, r in zip(trace.lines, self._requests, strict=True)}
        self._next_in_session: dict[int, SimRequest] = {}
        for reqs in self._sessions.values():
            for a, b in itertools.pairwise(reqs):
                self._next_in_session[a.line] = b
        for name, reqs in self._sessions.items():
            self._push(starts[name], _ARRIVAL, reqs[0].line, reqs[0])
        self.scheduler: Scheduler | LruRoute = (
            LruRoute(config, self, lambda: self.now)
            if policy == "lru-route"
            else Scheduler(
                config, self, lambda: self.now, LlamaSwap() if policy == "llama-swap" else None
            )
        )
        # Copies are (model, device) pairs: a model may have a replica on a second device.
        self._where: dict[str, set[str]] = defaultdict(set)  # from load effects alone
        self._running: dict[tuple[str, str], int] = defaultdict(int)
        self._dev_running: dict[str, int] = defaultdict(int)
        self._busy_since: dict[str, float] = {}
        self._resident_since: dict[tuple[str, str], float] = {}
        self._ready: set[tuple[str, str]] = set()
        self._asleep: dict[tuple[str, str], bool] = {}  # (model, device) -> at level 2
        # Loads under way: (model, device) -> (event seq, when its evictions end, segment index)
        self._arriving: dict[tuple[str, str], tuple[int, float, int]] = {}
        self._cancelled: set[int] = set()  # load events of aborted loads
        self._run = Run(
            policy=self.scheduler.policy.name,
            config=config,
            trace=trace,
            requests=self._requests,
            segments=[],
            loads=defaultdict(int),
            busy_s=defaultdict(float),
            swap_s=defaultdict(float),
        )
        self._sizes = {d.name: d for d in self.scheduler.devices}
        talks = any(x.context_tokens for x in trace.lines)
        self._prompts = Prompts(config) if talks else None
        self._run.prompts = self._prompts
        self._on_finished: Callable[[Request], object] = self.scheduler.on_request_finished
        if self._prompts is not None:  # a finished request's conversation is held first
            self._on_finished = self._prompts.finishing(self._on_finished)
        self._free_at: dict[str, float] = defaultdict(float)  # its last swap or unload ends
        self._page_cache(config)
        self._remaining = len(self._requests)

    def _page_cache(self, config: Config) -> None:
        """The host's page cache, told to the scheduler, and its preparations read in."""
        ours = self.scheduler if isinstance(self.scheduler, Scheduler) else None
        told = ours.files.measured if ours is not None else None
        self._files = self._run.files = SimPageCache(config, told)
        self._wanted = ours.files.wanted if ours is not None and config.scheduler.prepare else None
        self._prepared_at: float | None = None  # the read under way ends (its event's time)

    # --- Effects ------------------------------------------------------------------------------
    def load(
        self,
        model: str,
        device: str,
        evict: Sequence[str],
        sleep: Sequence[str] = (),
        wake: bool = False,
        deep: Sequence[str] = (),
    ) -> None:
        now = self.now
        models = self.config.models
        if self.check:
            for v in (*evict, *sleep):
                if self._running[v, device]:
                    raise InvariantViolation(f"t={now}: evicting {v} with work in flight")
                if device not in self._where[v]:
                    raise InvariantViolation(f"t={now}: evicting {v}, not resident on {device}")
            if device in self._where[model]:
                raise InvariantViolation(f"t={now}: loading {model}, already on {device}")
            if wake != ((model, device) in self._asleep):
                raise InvariantViolation(f"t={now}: {model} woken={wake}, asleep on {device}?")
            allowed = models[model].devices
            if allowed and device not in allowed:
                raise InvariantViolation(f"t={now}: loading {model} on {device}, not its device")
        for v in (*evict, *sleep):
            self._files.leave(v)
            self._where[v].discard(device)
            self._ready.discard((v, device))
            since = self._resident_since.pop((v, device), now)
            self._run.segments.append(Segment(device, v, "resident", since, now))
        woke_deep = self._asleep.pop((model, device), False)
        self._asleep.update({(v, device): v in deep for v in sleep})
        if self.check and sleep:
            self._check_host(now)
        self._where[model].add(device)
        if self.check:
            dev = self._sizes[device]
            models_ = self.scheduler.models
            used = sum(dev.size_of(models_[m]) for m, ds in self._where.items() if device in ds)
            if used > dev.capacity + _EPS:
                raise InvariantViolation(
                    f"t={now}: {device} over capacity ({used} > {dev.capacity})"
                )
        leave_s = sum(models[v].unload_s for v in evict)
        leave_s += sum(_sleep_s(models[v]) for v in sleep)
        if self._prompts is not None:
            leave_s += sum(self._prompts.leave(v, device, True) for v in evict)
            leave_s += sum(self._prompts.leave(v, device, False) for v in sleep)
        if wake:
            back_s = models[model].deep_wake_s if woke_deep else _wake_s(models[model])
            self._files.woke(model)
        else:
            back_s = models[model].load_s + self._files.load(model, now)
        duration = leave_s + back_s
        start = max(now, self._free_at[device])
        end = self._free_at[device] = start + duration
        self._run.segments.append(Segment(device, model, "swap", start, end))
        self._run.swap_s[device] += duration
        self._run.loads[model] += 1
        if wake:
            self._run.wakes[model] = self._run.wakes.get(model, 0) + 1
        seq = self._next_seq()
        self._arriving[model, device] = (seq, start + leave_s, len(self._run.segments) - 1)
        # With a page cache, the load's time depends on it: told, as the live system measures.
        told_s = back_s if self._files.enabled and not wake else None
        self._push(end, _LOAD, seq, (model, device, told_s))

    def abort(self, model: str, device: str) -> None:
        """The load stops now (the evictions before it still take their time): the device is
        free from then, and its completion never comes."""
        now = self.now
        if self.check and (model, device) not in self._arriving:
            raise InvariantViolation(f"t={now}: aborting {model} on {device}, not loading there")
        seq, leave_end, index = self._arriving.pop((model, device))
        self._cancelled.add(seq)
        self._files.leave(model)
        self._where[model].discard(device)
        seg = self._run.segments[index]
        cut = max(now, leave_end)
        if self._free_at[device] == seg.end_s:  # nothing queued behind it on the device
            self._free_at[device] = cut
        self._run.swap_s[device] -= seg.end_s - cut
        self._run.segments[index] = Segment(device, model, "aborted", seg.start_s, cut)
        self._run.aborted[model] = self._run.aborted.get(model, 0) + 1

    def _check_host(self, now: float) -> None:
        limit = self.config.host.memory_gb
        held = sum(
            self.config.models[m].host_gb for (m, _), deep in self._asleep.items() if not deep
        )
        if limit is not None and held > limit + _EPS:
            raise InvariantViolation(f"t={now}: sleeping models hold {held} GB > host {limit}")

    def unload(self, model: str, device: str) -> None:
        now = self.now
        if (model, device) in self._asleep:  # its server stops: no device time
            del self._asleep[model, device]
            return
        if self.check:
            if self._running[model, device]:
                raise InvariantViolation(f"t={now}: unloading {model} with work in flight")
            if (model, device) not in self._ready:
                raise InvariantViolation(f"t={now}: unloading {model}, not ready on {device}")
        self._files.leave(model)
        self._where[model].discard(device)
        self._ready.discard((model, device))
        since = self._resident_since.pop((model, device), now)
        self._run.segments.append(Segment(device, model, "resident", since, now))
        duration = self.config.models[model].unload_s
        if self._prompts is not None:
            duration += self._prompts.leave(model, device, True)
        start = max(now, self._free_at[device])
        end = self._free_at[device] = start + duration
        self._run.segments.append(Segment(device, model, "unload", start, end))
        self._run.swap_s[device] += duration

    def dispatch(self, request: Request) -> None:
        assert isinstance(request, SimRequest)
        model = request.model
        device = request.device
        assert device is not None, "a dispatched request names its copy's device"
        if self.check and (model, device) not in self._ready:
            raise InvariantViolation(
                f"t={self.now}: dispatch to {model} on {device}, which is not ready there"
            )
        self._running[model, device] += 1
        if self._dev_running[device] == 0:
            self._busy_since[device] = self.now
        self._dev_running[device] += 1
        took_s = request.service_s
        if self._prompts is not None:
            took_s += self._prompts.start(request, device)
        self._push(self.now + took_s, _FINISH, self._next_seq(), request)

    def reject(self, request: Request, reason: str) -> None:
        assert isinstance(request, SimRequest)
        self._run.rejected.append((request, reason))
        self._remaining -= 1
        self._continue_session(request)

    def set_timer(self, at_s: float, key: str) -> None:
        self._push(max(at_s, self.now), _TIMER, self._next_seq(), key)

    # --- loop ---------------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push(self, at: float, kind: int, seq: int, payload: Any) -> None:
        heapq.heappush(self._heap, (at, kind, seq, payload))

    def _continue_session(self, r: SimRequest) -> None:
        nxt = self._next_in_session.get(r.line)
        if nxt is not None:
            self._push(self.now + self._think[nxt.line], _ARRIVAL, nxt.line, nxt)

    def run(self) -> Run:
        """Run to completion and return what happened."""
        heap = self._heap
        pop = heapq.heappop
        sched = self.scheduler
        on_request = sched.on_request if self._wanted is None else self._arrive
        on_finished = self._on_finished
        open_reqs, open_t = self._open, self._open_t
        n_open = len(open_reqs)
        ai = 0
        running = self._running
        dev_running = self._dev_running
        busy = self._run.busy_s
        busy_since = self._busy_since
        has_sessions = bool(self._sessions)
        progress = self._progress
        total = len(self._requests)
        done = 0
        tick = 1 << 15
        while self._remaining:
            if ai < n_open:
                t = open_t[ai]
                if heap:
                    top = heap[0]
                    if top[0] < t or (
                        top[0] == t
                        and (
                            top[1] < _ARRIVAL
                            or (top[1] == _ARRIVAL and top[2] < open_reqs[ai].line)
                        )
                    ):
                        ev = pop(heap)
                    else:
                        self.now = t
                        on_request(open_reqs[ai])
                        ai += 1
                        continue
                else:
                    self.now = t
                    on_request(open_reqs[ai])
                    ai += 1
                    continue
            elif heap:
                ev = pop(heap)
            else:
                break
            self.now = ev[0]
            kind = ev[1]
            if kind == _FINISH:
                r = ev[3]
                device = r.device
                running[r.model, device] -= 1
                dev_running[device] -= 1
                if dev_running[device] == 0:
                    busy[device] += self.now - busy_since[device]
                on_finished(r)
                self._remaining -= 1
                if has_sessions and r.session is not None:
                    self._continue_session(r)
                done += 1
                if progress is not None and done % tick == 0:
                    progress(done, total)
            elif kind == _ARRIVAL:
                r = ev[3]
                on_request(r)
            elif kind == _LOAD:
                if ev[2] in self._cancelled:
                    self._cancelled.discard(ev[2])
                    continue
                self._loaded(*ev[3])
            elif kind == _TIMER:
                sched.on_timer(ev[3])
            if self._wanted is not None:  # after every event: what to read in now
                self._prepare()
        if progress is not None:
            progress(total, total)
        return self._ended()

    def _loaded(self, model: str, device: str, load_s: float | None) -> None:
        del self._arriving[model, device]
        self._ready.add((model, device))
        self._resident_since[model, device] = self.now
        self.scheduler.on_load_finished(model, load_s=load_s, device=device)

    def _arrive(self, r: Request) -> None:
        self.scheduler.on_request(r)
        self._prepare()

    def _prepare(self) -> None:
        assert self._wanted is not None
        ends_at = self._files.prepare(self._wanted(self.now), self.now)
        if ends_at is not None and ends_at != self._prepared_at:
            self._prepared_at = ends_at
            self._push(ends_at, _PREPARED, self._next_seq(), None)

    def _ended(self) -> Run:
        """The run, once no event is left: residencies closed, every request checked."""
        if isinstance(self.scheduler, Scheduler):
            self._run.charged = self.scheduler.shares.charged()
        for (model, device), since in self._resident_since.items():
            self._run.segments.append(Segment(device, model, "resident", since, self.now))
        if self.check:
            stuck = [
                r
                for r in self._requests
                if r.finished_at is None and not any(r is x for x, _ in self._run.rejected)
            ]
            if stuck:
                raise InvariantViolation(f"{len(stuck)} requests never finished, e.g. {stuck[0]}")
        return self._run


def simulate(
    config: Config,
    trace: Trace,
    *,
    check: bool = False,
    progress: Callable[[int, int], None] | None = None,
    policy: SimPolicyName | None = None,
) -> Run:
    """Run `config`'s policy (or `policy`, a simulator baseline too) over `trace` on a virtual
    clock."""
    return Simulation(config, trace, check=check, progress=progress, policy=policy).run()


def _sleep_s(m: ModelConfig) -> float:
    assert m.sleep is not None, "only a model with `sleep:` is put to sleep"
    return m.sleep.sleep_s


def _wake_s(m: ModelConfig) -> float:
    assert m.sleep is not None, "only a model with `sleep:` wakes"
    return m.sleep.wake_s
