"""`lru-route`, Ray Serve's model-multiplexing rule, as the simulator's multi-device baseline;
and what the multi-device scenarios show (`corral simulate -s devices-4 -p all`)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from corral.config import parse_config
from corral.policy_names import SimPolicyName
from corral.sim.engine import simulate
from corral.sim.metrics import summarize
from corral.sim.scenarios import get_scenario
from corral.sim.trace import parse_trace

TWO_DEVICES = parse_config(
    """
models:
  a: {load_s: 10, unload_s: 1, service_s: 1}
  b: {load_s: 10, unload_s: 1, service_s: 1}
  c: {load_s: 10, unload_s: 1, service_s: 1}
devices: [{name: g0}, {name: g1}]
""",
    "<test>",
)


# An hour-long simulation of a built-in multi-device scenario: seconds each, minutes on a busy CI.
SLOW_SIMULATION = pytest.mark.slow


def run_lines(lines: str) -> Any:
    trace = parse_trace(lines.strip().splitlines(), TWO_DEVICES.models, "<test>")
    return simulate(TWO_DEVICES, trace, policy="lru-route", check=True)


def test_a_request_goes_to_a_device_holding_its_model_else_the_least_loaded() -> None:
    run = run_lines(
        """
{"t": 0, "model": "a", "service_s": 1}
{"t": 0, "model": "b", "service_s": 1}
{"t": 0.5, "model": "a", "service_s": 1}
{"t": 30, "model": "c", "service_s": 1}
"""
    )
    assert run.policy == "lru-route"
    by_line = {r.line: r for r in run.requests}
    # a and b load side by side (each on the least loaded device); the second a joins a's
    # device rather than loading it again.
    assert dict(run.loads) == {"a": 1, "b": 1, "c": 1}
    assert by_line[3].dispatched_at == pytest.approx(11.0)  # after the first a, on a's device
    # c arrives when both devices are idle: the least loaded (the first) evicts its model.
    assert [(s.device, s.model) for s in run.segments if s.kind == "swap"][-1] == ("g0", "c")


def test_a_routed_request_never_moves_and_its_device_serves_in_arrival_order() -> None:
    """Head-of-line: g0 holds a, then b's request (routed there on a tie), then a's second;
    it swaps to b and back to a while g1 stands idle after c."""
    run = run_lines(
        """
{"t": 0, "model": "a", "service_s": 5}
{"t": 0, "model": "c", "service_s": 1}
{"t": 1, "model": "b", "service_s": 1}
{"t": 2, "model": "a", "service_s": 1}
"""
    )
    swaps = [(s.device, s.model, s.start_s) for s in run.segments if s.kind == "swap"]
    assert swaps == [("g0", "a", 0.0), ("g1", "c", 0.0), ("g0", "b", 15.0), ("g0", "a", 27.0)]
    assert dict(run.loads) == {"a": 2, "b": 1, "c": 1}
    by_line = {r.line: r for r in run.requests}
    assert by_line[3].dispatched_at == pytest.approx(26.0)  # a drained, 1 s unload, 10 s load
    assert by_line[4].dispatched_at == pytest.approx(38.0)  # the same again, back to a


@cache
def summary(name: str, policy: SimPolicyName, max_wait_s: float | None = -1.0) -> dict[str, Any]:
    sc = get_scenario(name)
    config = sc.config
    if max_wait_s != -1.0:
        sched = config.scheduler.model_copy(update={"max_wait_s": max_wait_s})
        config = config.model_copy(update={"scheduler": sched})
    return summarize(simulate(config, sc.trace, policy=policy, check=True))


@SLOW_SIMULATION
def test_on_four_devices_a_tighter_wait_bound_degrades_gracefully() -> None:
    """A bound that cannot be met for everyone must not make waits worse: an overdue
    model takes the next device whose model runs dry instead of forcing swaps."""
    loose = summary("devices-4", "cost", None)
    looser = loose
    for bound in (600.0, 120.0, 60.0):  # each against the next looser one, and against none
        tight = summary("devices-4", "cost", bound)
        for other in (loose, looser):
            # 20%: a bound buys its tail with some of the mean, and one trace's noise (since a
            # lingering model yields to a backlog that outweighs its hold, no bound's mean is
            # 70.8 s, from 102.7 s: 81.6 s at 120 s, 71.1 s at 600 s). What this guards
            # against was 4x: forced swaps made the mean 404 s against 109 s without a bound.
            assert tight["wait_mean_s"] <= 1.20 * other["wait_mean_s"], bound
            # The maximum is one sample: 15% (311 s at 60 against 272 s at 120).
            assert tight["wait_max_s"] <= 1.15 * other["wait_max_s"], bound
        looser = tight
    # 272 s against 571 s (before the linger was priced against the backlog, 262 s against
    # 1,137 s: the hold had lengthened the unbounded tail, not the bound shortened it more).
    assert summary("devices-4", "cost", 120.0)["wait_max_s"] < 0.6 * loose["wait_max_s"]


@SLOW_SIMULATION
def test_on_four_devices_cost_has_the_shortest_tail() -> None:
    """Under overload, EDF only for the queues whose deadline can still be kept: cost's p95
    wait is the lowest of all policies (its mean is not yet: grouped's, which has no bound)."""
    cost = summary("devices-4", "cost")
    for policy in ("grouped", "fifo-plus", "fifo", "lru-route"):
        assert cost["wait_p95_s"] < summary("devices-4", policy)["wait_p95_s"], policy
    assert cost["wait_mean_s"] < summary("devices-4", "fifo-plus")["wait_mean_s"]


@SLOW_SIMULATION
def test_on_four_devices_every_scheduler_beats_lru_route_by_far() -> None:
    lru = summary("devices-4", "lru-route")
    for policy in ("cost", "grouped", "fifo-plus"):
        s = summary("devices-4", policy)
        assert s["wait_mean_s"] < lru["wait_mean_s"] / 10, policy
        assert s["loads"] < lru["loads"] / 5, policy
