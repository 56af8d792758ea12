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
from tests.unit.test_properties import EXAMPLES, configs

pytestmark = pytest.mark.property


class Books:
    """The adapter's side: what is loading, running and dead, kept independently."""

    def __init__(self) -> None:
        self.t = 0.0
        self.loading: list[str] = []
        self.running: list[Request] = []
        self.dead: set[str] = set()  # lost, and not loaded again since
        self.resident: set[str] = set()  # loaded or loading, by the effects alone
        self.unloads = 0
        self.timers: list[tuple[float, str]] = []
        self.scheduler: Scheduler | None = None

    def clock(self) -> float:
        return self.t

    # Effects
    def load(self, model: str, device: str, evict: Sequence[str]) -> None:
        for v in evict:
            assert not any(r.model == v for r in self.running), f"evicted {v} with work in flight"
        self.loading.append(model)
        self.dead.discard(model)
        self.resident.difference_update(evict)
        self.resident.add(model)

    def unload(self, model: str, device: str) -> None:
        assert not any(r.model == model for r in self.running), f"unloaded {model} while busy"
        assert model in self.resident, f"unloaded {model}, which is not resident"
        assert model not in self.loading, f"unloaded {model} while it loads"
        self.resident.discard(model)
        self.unloads += 1

    def dispatch(self, r: Request) -> None:
        assert r.model not in self.dead, f"dispatched {r.id} to {r.model}, whose server died"
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


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), OPS)
def test_lost_servers_get_no_work_and_every_request_still_ends(
    config: Config, ops: list[tuple[str, int]]
) -> None:
    books = Books()
    sched = Scheduler(config, books, books.clock)
    names = list(config.models)
    requests: list[Request] = []

    def step(op: str, k: int) -> None:
        if op == "arrive":
            r = Request(len(requests), names[k % len(names)], k % 3)
            requests.append(r)
            sched.on_request(r)
        elif op == "finish" and books.running:
            sched.on_request_finished(books.running.pop(k % len(books.running)))
        elif op == "loaded" and books.loading:
            sched.on_load_finished(books.loading.pop(k % len(books.loading)))
        elif op == "lose":
            model = names[k % len(names)]
            if sched.models[model].state.value == "ready":
                books.dead.add(model)
            sched.on_model_lost(model)
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
    unfinished = [r for r in requests if r.state not in (RequestState.DONE, RequestState.REJECTED)]
    assert not unfinished, unfinished[:3]
