"""Scheduler properties over the wide random families of `corral.sim.families`: the
scenarios `make bench-robust` measures, shortened to a few hundred requests, drawn by seed.

- every request finishes once arrivals stop, under every policy;
- no device idles while a model it could hold waits with no copy anywhere, beyond a linger
  (a reload's round trip: what the rent-or-buy rule may wait);
- while the load leaves room for the switches the bound forces, no interactive wait exceeds
  the bound plus two swaps and a service;
- a tighter bound is never worse than a looser one (or none) beyond that same slack: the oldest
  request waits no longer than 1.1x the looser bound's worst, plus two swaps and a service.

CORRAL_EXAMPLES=5000 for a long hunt (docs/design/scheduler.md); CI runs the default.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.config import Config
from corral.core.stretch import Demand, swap_rate
from corral.sim.engine import Run, simulate
from corral.sim.families import random_scenario, random_sleep_scenario
from corral.sim.scenarios import Scenario

pytestmark = pytest.mark.property
POLICIES = ["fifo", "grouped", "fifo-plus", "priority", "cost"]
BOUNDED = ["fifo-plus", "priority", "cost"]  # the policies that keep `max_wait_s`
HUNT = "CORRAL_EXAMPLES" in os.environ
EXAMPLES = max(1, int(os.environ.get("CORRAL_EXAMPLES", "200")) // 2)
REQUESTS = 300
# `make test` draws the same seeds every run (a new failing seed is a finding for the long
# hunt, not a coin that turns CI red); the hunt draws fresh ones.
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not HUNT,
)
SEEDS = st.integers(0, 2**31 - 1)

Intervals = list[tuple[float, float]]


def merged(spans: Intervals) -> Intervals:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + 1e-9:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def gaps(spans: Intervals, end: float) -> Intervals:
    """The stretches of [0, end] that `spans` leave uncovered."""
    out, at = [], 0.0
    for a, b in merged(spans):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if end > at:
        out.append((at, end))
    return out


def overlap(xs: Intervals, ys: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def with_bound(config: Config, max_wait_s: float | None) -> Config:
    sched = config.scheduler.model_copy(update={"max_wait_s": max_wait_s})
    return config.model_copy(update={"scheduler": sched})


def slack_s(sc: Scenario) -> float:
    """Two of the longest swaps and the longest service: the granularity of a wait bound."""
    swap_s = max(m.load_s + m.unload_s for m in sc.config.models.values())
    return 2 * swap_s + max((x.service_s for x in sc.trace.lines), default=0.0)


def interactive_waits(run: Run) -> list[float]:
    return [r.dispatched_at - r.arrived_at for r in run.requests if not r.background]  # type: ignore[operator]


@SETTINGS
@given(SEEDS, st.sampled_from(POLICIES))
def test_every_request_finishes_once_arrivals_stop(seed: int, policy: str) -> None:
    sc = random_scenario(seed, REQUESTS)
    run = simulate(sc.config.with_policy(policy), sc.trace, check=True)  # type: ignore[arg-type]
    assert not run.rejected
    assert all(r.finished_at is not None for r in run.requests), sc.summary


@SETTINGS
@given(SEEDS, st.sampled_from(POLICIES))
def test_no_device_idles_while_a_model_with_no_copy_waits_beyond_a_linger(
    seed: int, policy: str
) -> None:
    sc = random_scenario(seed, REQUESTS)
    run = simulate(sc.config.with_policy(policy), sc.trace, check=True)  # type: ignore[arg-type]
    linger_s = max(max(m.load_s + m.unload_s, m.unload_delay_s) for m in sc.config.models.values())
    end = max((r.finished_at or 0.0 for r in run.requests), default=0.0)
    busy: dict[str, Intervals] = defaultdict(list)
    hosted: dict[str, Intervals] = defaultdict(list)
    waiting: dict[str, Intervals] = defaultdict(list)
    for r in run.requests:
        assert r.dispatched_at is not None
        assert r.finished_at is not None
        assert r.device is not None
        busy[r.device].append((r.dispatched_at, r.finished_at))
        waiting[r.model].append((r.arrived_at, r.dispatched_at))
    for s in run.segments:
        if s.kind in ("swap", "unload"):
            busy[s.device].append((s.start_s, s.end_s))
        if s.kind in ("swap", "resident"):
            hosted[s.model].append((s.start_s, s.end_s))
    for d in sc.config.devices:
        idle = gaps(busy[d.name], end)
        for model, spans in waiting.items():
            for a, b in overlap(overlap(idle, merged(spans)), gaps(hosted[model], end)):
                assert b - a <= linger_s + 1e-6, (sc.summary, d.name, model, a, b)


def leaves_room(sc: Scenario, max_wait_s: float, copies: bool) -> bool:
    """The scenario's true load leaves room, with a margin, for the switches the bound forces
    (core/stretch.py's rule with HEADROOM 0.5 instead of 1.5), and, for a policy that keeps one
    copy per model, no model alone needs more than 0.7 of a device."""
    lines = sc.trace.lines
    span_s = max((x.t or 0.0 for x in lines), default=0.0) or 1.0
    demands = []
    for name, spec in sc.config.models.items():
        mine = [x.service_s for x in lines if x.model == name]
        if mine:
            rate = len(mine) / span_s
            swap_s = spec.load_s + spec.unload_s
            demands.append(Demand(rate, sum(mine) / len(mine), spec.concurrency, swap_s, 1))
    devices = len(sc.config.devices)
    load = sum(d.load for d in demands)
    if not copies and any(d.load > 0.7 for d in demands):
        return False
    return load <= 0.7 * devices and swap_rate(demands, max_wait_s) <= 0.5 * (devices - load)


@SETTINGS
@given(SEEDS, st.sampled_from(BOUNDED))
def test_while_the_load_leaves_room_no_wait_exceeds_the_bound_plus_two_swaps_and_a_service(
    seed: int, policy: str
) -> None:
    sc = random_scenario(seed, 2 * REQUESTS, steady=True)
    bound_s = 60.0  # the defaults' 120 s is longer than many shortened scenarios
    if not leaves_room(sc, bound_s, copies=policy == "cost"):
        return  # about a fifth of the draws leave room; the rest are the other tests' cases
    config = with_bound(sc.config, bound_s).with_policy(policy)  # type: ignore[arg-type]
    run = simulate(config, sc.trace, check=True)
    assert max(interactive_waits(run), default=0.0) <= bound_s + slack_s(sc), sc.summary


@SETTINGS
@given(
    SEEDS,
    st.sampled_from([(30.0, 60.0), (60.0, 240.0), (120.0, 480.0), (60.0, None), (120.0, None)]),
)
def test_a_tighter_bound_is_never_worse_than_a_looser_one_beyond_the_slack(
    seed: int, bounds: tuple[float, float | None]
) -> None:
    sc = random_scenario(seed, 2 * REQUESTS)
    tight, loose = (
        max(interactive_waits(simulate(with_bound(sc.config, b), sc.trace, check=True)), default=0)
        for b in bounds
    )
    assert tight <= 1.1 * loose + slack_s(sc), (seed, sc.summary, bounds, tight, loose)


def test_cost_never_keeps_an_idle_device_while_a_model_with_no_copy_waits() -> None:
    """Found by a loaded CI run's draw (seed 435814, 300 requests): six devices at load 0.22,
    m07's two interactive requests waited 47 s while d4 held m03 idle from 104 s to 153 s.
    Placement saw a lingering idle model and one that was not as equals, planned every
    challenger over the lingering one (the lower index), and the policy refused each time."""
    test_no_device_idles_while_a_model_with_no_copy_waits_beyond_a_linger.hypothesis.inner_test(  # type: ignore[attr-defined]
        435814, "cost"
    )


def test_copies_leave_room_for_waiting_models_that_have_seen_few_arrivals() -> None:
    """Found by a hunt (`CORRAL_EXAMPLES=1500`, seed 5384953: three devices, three models):
    three copies of m00 held all three devices, idle between its requests, while m01 and m02
    waited 57 s. The room a copy leaves counted the others' demand, which says 0 until 20
    arrivals; a waiting model's demand now counts from its first gap."""
    test_no_device_idles_while_a_model_with_no_copy_waits_beyond_a_linger.hypothesis.inner_test(  # type: ignore[attr-defined]
        5384953, "cost"
    )


@SETTINGS
@given(SEEDS, st.sampled_from(["predicted", "lru"]))
def test_with_every_model_able_to_sleep_every_request_finishes(seed: int, sleepers: str) -> None:
    """The same family with sleep: the books hold (sleepers within host memory,
    aborted loads) and every request finishes, under both sleeper rules."""
    sc = random_sleep_scenario(seed, REQUESTS)
    config = sc.config.model_copy(
        update={"scheduler": sc.config.scheduler.model_copy(update={"sleepers": sleepers})}
    )
    run = simulate(config, sc.trace, check=True)
    assert all(r.finished_at is not None for r in run.requests)


def test_the_sleep_family_found_the_replica_abort_loop() -> None:
    """Seed 2804 of the sleep family (2,000 requests, `lru`) once made the scheduler abort a
    replica's load for a person and copy it again at once, without end."""
    sc = random_sleep_scenario(2804, 2000)
    config = sc.config.model_copy(
        update={"scheduler": sc.config.scheduler.model_copy(update={"sleepers": "lru"})}
    )
    run = simulate(config, sc.trace, check=True)
    assert all(r.finished_at is not None for r in run.requests)


def test_the_narrower_shapes_are_what_they_say() -> None:
    """The families' shapes (corral.sim.families.SHAPES), deterministic from their seed."""
    for seed in range(5):
        packed = random_scenario(seed, shape="packed")
        assert [d.memory_gb for d in packed.config.devices] == [80] * 4
        sizes = [m.memory_gb for m in packed.config.models.values()]
        assert len(sizes) == 8
        assert all(s is not None and 10 <= s <= 80 for s in sizes)
        assert packed.config.scheduler.max_wait_s == 120
        crowded = random_scenario(seed, shape="crowded")
        assert len(crowded.config.devices) == 2
        assert all(d.memory_gb is None for d in crowded.config.devices)  # one model each
        assert len(crowded.config.models) == 3
        assert all(15 <= m.load_s <= 35 for m in crowded.config.models.values())
        assert crowded.config.scheduler.max_wait_s == 300
        again = random_scenario(seed, shape="crowded")
        assert again.trace.lines == crowded.trace.lines
