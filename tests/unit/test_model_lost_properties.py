"""`Scheduler.on_model_lost` and the operator's load/unload requests under random event orders
(hypothesis): servers crash and operators load and unload models at any moment, and the
scheduler must never dispatch to a dead server, never evict or unload a model with work in flight
or one that is not ready, and still finish or reject every request."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.config import Config
from corral.core import Request, RequestState, Scheduler
from tests.support.properties import EXAMPLES, configs

pytestmark = pytest.mark.property


Copy = tuple[str, str]  # (model, device): a model may run on two devices at once (a replica)


class Books:
    """The adapter's side: what is loading, running and dead, kept independently, per copy."""

    def __init__(self) -> None:
        self.t = 0.0
        self.loading: list[Copy] = []
        self.running: list[Request] = []
        self.dead: set[Copy] = set()  # lost, and not loaded again since
        self.resident: set[Copy] = set()  # loaded or loading, by the effects alone
        self.unloads = 0
        self.timers: list[tuple[float, str]] = []
        self.scheduler: Scheduler | None = None

    def clock(self) -> float:
        return self.t

    # Effects
    def busy(self, copy: Copy) -> bool:
        return any((r.model, r.device) == copy for r in self.running)

    def load(
        self,
        model: str,
        device: str,
        evict: Sequence[str],
        sleep: Sequence[str] = (),
        wake: bool = False,
        deep: Sequence[str] = (),
    ) -> None:
        assert not sleep, "no model here sleeps"
        assert not wake, "no model here sleeps"
        for v in evict:
            assert not self.busy((v, device)), f"evicted {v} on {device} with work in flight"
            assert (v, device) in self.resident, f"evicted {v}, which is not on {device}"
        copy = (model, device)
        assert copy not in self.resident or copy in self.dead, f"{model} twice on {device}"
        self.loading.append(copy)
        self.dead.discard(copy)
        self.resident.difference_update((v, device) for v in evict)
        self.resident.add((model, device))

    def unload(self, model: str, device: str) -> None:
        copy = (model, device)
        assert not self.busy(copy), f"unloaded {model} on {device} while busy"
        assert copy in self.resident, f"unloaded {model}, which is not on {device}"
        assert copy not in self.loading, f"unloaded {model} on {device} while it loads"
        self.resident.discard(copy)
        self.unloads += 1

    def abort(self, model: str, device: str) -> None:
        copy = (model, device)
        assert copy in self.loading, f"aborted {model} on {device}, which is not loading"
        self.loading.remove(copy)
        self.resident.discard(copy)

    def dispatch(self, r: Request) -> None:
        copy = (r.model, r.device or "")
        assert copy not in self.dead, f"dispatched {r.id} to {copy}, whose server died"
        assert copy in self.resident, f"{copy} is not loaded"
        assert copy not in self.loading, f"{copy} is still loading"
        self.running.append(r)

    def reject(self, r: Request, reason: str) -> None:
        pass

    def set_timer(self, at_s: float, key: str) -> None:
        self.timers.append((at_s, key))


# Weighted toward arrivals and loads, so crashes often meet a loaded model with free slots.
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                *("arrive", "arrive", "arrive", "loaded", "loaded", "finish", "lose", "tick"),
                *("load_request", "unload_request"),
            ]
        ),
        st.integers(0, 99),
    ),
    min_size=1,
    max_size=80,
)


# Bursts of arrivals on few models and several devices: the cost policy makes second copies.
HOT_OPS = st.lists(
    st.tuples(
        st.sampled_from([*("arrive",) * 6, "loaded", "loaded", "finish", "lose", "tick"]),
        st.integers(0, 99),
    ),
    min_size=30,
    max_size=150,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), OPS)
def test_lost_servers_get_no_work_and_every_request_still_ends(
    config: Config, ops: list[tuple[str, int]]
) -> None:
    run_ops(config, ops)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(models=2, devices=3), HOT_OPS)
def test_replicas_lost_or_not_never_get_work_they_cannot_do(
    config: Config, ops: list[tuple[str, int]]
) -> None:
    """The same invariants per copy, with replicas: a lost primary hands its place to a replica,
    a lost replica takes no work, and every request ends."""
    run_ops(config.with_policy("cost"), ops)


# People give up while their model loads, beside batch work (every fourth arrival): loads
# nobody waits for are aborted, and a person's request aborts loads begun for batch work only.
CANCEL_OPS = st.lists(
    st.tuples(
        st.sampled_from([*("arrive",) * 4, "loaded", "loaded", "finish", "cancel", "cancel"]),
        st.integers(0, 99),
    ),
    min_size=10,
    max_size=100,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), CANCEL_OPS)
def test_cancelled_requests_abort_only_loading_copies_and_the_rest_still_end(
    config: Config, ops: list[tuple[str, int]]
) -> None:
    run_ops(config.with_policy("cost"), ops)


def test_the_cancel_operations_do_abort_loads() -> None:
    """The property above is not vacuous: a lone request cancelled while its model loads."""
    config = Config.model_validate({"models": {"m0": {"load_s": 9}, "m1": {"load_s": 9}}})
    sched = Scheduler(config, Books(), lambda: 0.0)
    r = Request(0, "m0")
    sched.on_request(r)
    sched.on_cancel(r)
    assert sched.decisions[-1].reason.startswith("load aborted")


def run_ops(config: Config, ops: list[tuple[str, int]]) -> int:
    """Play `ops`, drain, check every request ended; returns how many replica loads there were."""
    books = Books()
    sched = Scheduler(config, books, books.clock)
    names = list(config.models)
    requests: list[Request] = []

    def step(op: str, k: int) -> None:
        if op == "arrive":
            r = Request(len(requests), names[k % len(names)], k % 3, background=k % 4 == 0)
            requests.append(r)
            sched.on_request(r)
        elif op == "finish" and books.running:
            sched.on_request_finished(books.running.pop(k % len(books.running)))
        elif op == "loaded" and books.loading:
            model, device = books.loading.pop(k % len(books.loading))
            sched.on_load_finished(model, device=device)
        elif op == "lose":
            m = sched.models[names[k % len(names)]]
            copies = [c for c in (m, *m.copies) if c.device is not None]
            if not copies:
                sched.on_model_lost(m.name)  # not loaded: ignored
                return
            c = copies[k % len(copies)]
            assert c.device is not None
            if c.state.value == "ready":
                books.dead.add((m.name, c.device.name))
            sched.on_model_lost(m.name, c.device.name)
        elif op == "cancel":
            waiting = [r for r in requests if r.state is RequestState.PENDING]
            if waiting:
                assert sched.on_cancel(waiting[k % len(waiting)])
        elif op == "load_request":
            sched.on_load_requested(names[k % len(names)], evict=k % 2 == 0)
        elif op == "unload_request":
            sched.on_unload_requested(names[k % len(names)])
        elif op == "tick":
            books.t += k / 10
            due = sorted(t for t in books.timers if t[0] <= books.t)
            for timer in due:
                books.timers.remove(timer)
                sched.on_timer(timer[1])

    for op, k in ops:
        step(op, k)
    # Drain: the adapter fails or finishes what runs, loads what is loading, time moves on.
    for _ in range(10_000):
        if books.running:
            step("finish", 0)
        elif books.loading:
            step("loaded", 0)
        elif books.timers:
            books.t = max(books.t, min(t for t, _ in books.timers))
            step("tick", 0)
        else:
            break
    ended = (RequestState.DONE, RequestState.REJECTED, RequestState.CANCELLED)
    unfinished = [r for r in requests if r.state not in ended]
    assert not unfinished, unfinished[:3]
    return sum(1 for d in sched.decisions if d.reason == "replica")


def test_the_hot_operations_do_make_replicas() -> None:
    """The property above is not vacuous: a plain burst on two devices makes a second copy."""
    config = Config.model_validate(
        {
            "models": {"m0": {"load_s": 1, "service_s": 2}, "m1": {"load_s": 1}},
            "devices": [{"name": "g0"}, {"name": "g1"}, {"name": "g2"}],
        }
    )
    ops = [("arrive", 0)] * 40 + [("loaded", 0), ("tick", 0)] + [("arrive", 0)] * 40
    ops += [("loaded", 0), ("finish", 0)] * 10
    assert run_ops(config, ops) >= 1
