"""Scheduler invariants over random configurations and traces (hypothesis).

Every run uses `check=True`: the simulator keeps its own books and fails on any eviction of a model
with work in flight, any device over capacity, any dispatch to a model that is not ready, and any
request that never finishes.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.config import Config
from corral.core import Scheduler
from corral.core.stretch import MAX_STRETCH
from corral.sim.engine import Run, SimRequest, Simulation, simulate
from corral.sim.metrics import lower_bound_makespan_s
from corral.sim.trace import Trace
from tests.support.properties import EXAMPLES, SETTINGS, scenarios

pytestmark = pytest.mark.property


@SETTINGS
@given(scenarios())
def test_invariants_hold_and_every_request_finishes(case: tuple[Config, Trace]) -> None:
    config, trace = case
    run = simulate(config, trace, check=True)
    assert not run.rejected
    assert all(r.finished_at is not None for r in run.requests)


@SETTINGS
@given(scenarios())
def test_fifo_within_model_and_request_priority(case: tuple[Config, Trace]) -> None:
    config, trace = case
    run = simulate(config, trace, check=True)
    groups: dict[tuple[str, bool, int], list[tuple[int, float]]] = defaultdict(list)
    for r in run.requests:
        assert r.dispatched_at is not None
        groups[(r.model, r.background, r.priority)].append((r.seq, r.dispatched_at))
    for group in groups.values():
        by_arrival = [d for _, d in sorted(group)]
        assert by_arrival == sorted(by_arrival)


@SETTINGS
@given(scenarios(closed=False))
def test_makespan_is_never_below_the_lower_bound(case: tuple[Config, Trace]) -> None:
    config, trace = case
    run = simulate(config, trace, check=True)
    lb = lower_bound_makespan_s(config, trace)
    assert lb is not None
    first = min(r.arrived_at for r in run.requests)
    last = max(r.finished_at or 0.0 for r in run.requests)
    assert last - first >= lb - 1e-6


@SETTINGS
@given(
    # Equal request priorities, one class: cost may rightly split a model's work for a more
    # important one.
    scenarios(
        closed=False, at_zero=True, devices=1, max_wait=False, equal_priority=True, classes=False
    ),
    st.sampled_from(["grouped", "fifo-plus", "cost"]),
)
def test_all_work_at_zero_loads_each_model_once(case: tuple[Config, Trace], policy: str) -> None:
    config, trace = case
    run = simulate(config.with_policy(policy), trace, check=True)  # type: ignore[arg-type]
    assert dict(run.loads) == dict.fromkeys({x.model for x in trace.lines}, 1)


def wait_bound_s(config: Config, trace: Trace) -> float:
    """The bound of docs/design/scheduler.md for two models on one device:
    2·S + (2 + k)·(U + L), S the longest service, U/L the largest unload/load, k min_visit_swaps."""
    s = max(x.service_s for x in trace.lines)
    u = max(m.unload_s for m in config.models.values())
    lo = max(m.load_s for m in config.models.values())
    return 2 * s + (2 + config.scheduler.min_visit_swaps) * (u + lo)


def oldest_of_its_model_when_due(run: Run, max_wait_s: float) -> list[tuple[float, float]]:
    """(wait, arrival) of requests that were their model's oldest pending one at their deadline
    (the others also wait for their own model's backlog, which no schedule avoids)."""
    out = []
    by_model: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for r in run.requests:
        assert r.dispatched_at is not None
        by_model[r.model].append((r.seq, r.arrived_at, r.dispatched_at))
    for reqs in by_model.values():
        for seq, arrived, dispatched in reqs:
            due = arrived + max_wait_s
            if all(d <= due for s2, _, d in reqs if s2 < seq):
                out.append((dispatched - arrived, arrived))
    return out


@settings(max_examples=2 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenarios(closed=False, models=2, devices=1, max_wait=True, classes=False),
    st.sampled_from(["fifo-plus", "priority", "cost"]),
)
def test_waits_are_bounded_by_max_wait(case: tuple[Config, Trace], policy: str) -> None:
    """While the load leaves room (the bound never stretched), within the bound plus the swaps
    and services of docs/design/scheduler.md; once it stretched, within the stretched bound."""
    config, trace = case
    config = config.with_policy(policy)  # type: ignore[arg-type]
    sim = Simulation(config, trace, check=True)
    run = sim.run()
    max_wait = config.scheduler.max_wait_s
    assert max_wait is not None
    assert isinstance(sim.scheduler, Scheduler)
    if sim.scheduler.stretch.episodes:
        max_wait *= MAX_STRETCH
    bound = max_wait + wait_bound_s(config, trace) + 1e-6
    for wait, arrived in oldest_of_its_model_when_due(run, max_wait):
        assert wait <= bound, f"request arriving at {arrived} waited {wait} > {bound}"


# --- service classes --------------------------------------------------------------------------
CLASS_POLICIES = ["fifo-plus", "priority", "cost"]


def _pending_at(r: SimRequest, t: float) -> bool:
    """`r` was waiting at `t` (arrived strictly before: an arrival at the same instant may be
    processed after the decision taken then)."""
    assert r.dispatched_at is not None
    return r.arrived_at < t < r.dispatched_at


@SETTINGS
@given(scenarios(), st.sampled_from(CLASS_POLICIES))
def test_a_model_never_starts_batch_work_while_its_interactive_work_waits(
    case: tuple[Config, Trace], policy: str
) -> None:
    config, trace = case
    run = simulate(config.with_policy(policy), trace, check=True)  # type: ignore[arg-type]
    interactive = defaultdict(list)
    for r in run.requests:
        if not r.background:
            interactive[r.model].append(r)
    for b in run.requests:
        if b.background:
            assert b.dispatched_at is not None
            late = [i for i in interactive[b.model] if _pending_at(i, b.dispatched_at)]
            assert not late, f"batch {b} started while {late[0]} waited"


def one_model_at_a_time(config: Config) -> Config:
    """`config` on one device that holds one model at a time."""
    spec = config.model_dump(by_alias=True)
    spec["devices"] = [{"name": "g0"}]
    for m in spec["models"].values():
        m["memory_gb"] = None
        m["devices"] = []
    return Config.model_validate(spec)


@SETTINGS
@given(scenarios(batch_max_wait=False), st.sampled_from(CLASS_POLICIES))
def test_no_load_for_batch_work_while_interactive_work_waits(
    case: tuple[Config, Trace], policy: str
) -> None:
    """One model at a time, no batch bound: every load made while interactive work waited was
    for a model with interactive work waiting (or arriving then)."""
    config, trace = case
    config = one_model_at_a_time(config).with_policy(policy)  # type: ignore[arg-type]
    run = simulate(config, trace, check=True)
    before = None
    for seg in sorted(run.segments, key=lambda g: (g.start_s, g.kind != "unload")):
        prev, before = before, seg
        if seg.kind != "swap":
            continue
        t = seg.start_s
        if prev is not None and prev.kind == "unload" and prev.end_s == t:
            t = prev.start_s  # decided when the unload began; it ran once the unload was done
        waiting = [r for r in run.requests if not r.background and _pending_at(r, t)]
        mine = [
            r
            for r in run.requests
            if r.model == seg.model
            and not r.background
            and r.arrived_at <= t <= (r.dispatched_at or 0)
        ]
        assert mine or not waiting, f"loaded {seg.model} at {t} while {waiting[0]} waited"


@SETTINGS
@given(scenarios(batch_max_wait=True), st.sampled_from(CLASS_POLICIES))
def test_batch_work_is_never_starved(case: tuple[Config, Trace], policy: str) -> None:
    config, trace = case
    run = simulate(config.with_policy(policy), trace, check=True)  # type: ignore[arg-type]
    assert all(r.finished_at is not None for r in run.requests if r.background)
