"""`corral replay`'s books: busy and swap time per device, from what the live gateway told."""

from __future__ import annotations

import dataclasses

import pytest

from corral.config import parse_config
from corral.sim.parity import (
    Divergence,
    at_live_load_times,
    at_live_times,
    simulated_beside,
    slow_loads,
    slow_services,
)
from corral.sim.replay import _run, _Swap, _Timing
from corral.sim.trace import parse_trace

CONFIG = parse_config(
    "models:\n  a: {load_s: 10, memory_gb: 24}\n  b: {load_s: 10, memory_gb: 24}\n"
    "devices:\n  - {name: gpu0, memory_gb: 24}\n  - {name: gpu1, memory_gb: 24}\n"
)
T0 = 1000.0  # epoch seconds of the trace's zero
SPEED = 2.0  # live seconds are trace seconds / 2


def test_two_devices_serving_at_once_are_both_busy() -> None:
    trace = parse_trace(
        ['{"t": 0, "model": "a", "service_s": 10}', '{"t": 0, "model": "b", "service_s": 10}'],
        "ab",
    )
    timings = {
        x.line: _Timing(arrived=T0, dispatched=T0 + 5, finished=T0 + 10, device=f"gpu{i}")
        for i, x in enumerate(trace.lines)
    }
    starts = [_Swap(T0, "a", "gpu0"), _Swap(T0, "b", "gpu1")]
    ends = [_Swap(T0 + 5, "b", "gpu1"), _Swap(T0 + 5, "a", "gpu0")]
    run, summary = _run(CONFIG, trace, SPEED, T0, timings, starts, ends)
    # 20 trace seconds on two devices: each swapped 10 s and served 10 s.
    assert summary["makespan_s"] == pytest.approx(20.0)
    assert run.busy_s == pytest.approx({"gpu0": 10.0, "gpu1": 10.0})
    assert run.swap_s == pytest.approx({"gpu0": 10.0, "gpu1": 10.0})
    assert summary["busy_frac"] == pytest.approx(0.5)
    assert summary["swap_frac"] == pytest.approx(0.5)
    assert summary["idle_frac"] == pytest.approx(0.0)
    assert summary["loads"] == 2


def test_lines_without_a_device_count_on_their_model_and_a_failed_load_ends_a_swap() -> None:
    trace = parse_trace(
        [
            '{"t": 0, "model": "a", "service_s": 4, "class": "batch"}',
            '{"t": 0, "model": "a", "service_s": 4, "class": "batch"}',
        ],
        "ab",
    )
    # Both batch lines ran on a's one copy, one after the other: 4 live seconds of service.
    first, second = (x.line for x in trace.lines)
    timings = {
        first: _Timing(arrived=T0, dispatched=T0 + 2, finished=T0 + 4),
        second: _Timing(arrived=T0, dispatched=T0 + 4, finished=T0 + 6),
    }
    starts = [_Swap(T0, "b", "gpu1"), _Swap(T0 + 0.5, "a", "gpu0")]
    ends = [_Swap(T0 + 1, "b", "gpu1"), _Swap(T0 + 2, "a", "gpu0")]  # b failed after 1 s
    run, summary = _run(CONFIG, trace, SPEED, T0, timings, starts, ends)
    assert run.busy_s == pytest.approx({"model a": 8.0})
    assert run.swap_s == pytest.approx({"gpu0": 3.0, "gpu1": 2.0})
    # Each load is a swap on its device's lane, in trace seconds (the plot draws these).
    lanes = [(s.device, s.model, s.kind, s.start_s, s.end_s) for s in run.segments]
    assert lanes == [("gpu1", "b", "swap", 0.0, 2.0), ("gpu0", "a", "swap", 1.0, 4.0)]
    assert summary["loads"] == 2


def test_live_load_times_are_kept_and_the_simulation_can_use_them() -> None:
    trace = parse_trace(['{"t": 0, "model": "a", "service_s": 2}'], "a")
    (x,) = trace.lines
    timings = {x.line: _Timing(arrived=T0, dispatched=T0 + 6, finished=T0 + 7, device="gpu0")}
    starts = [_Swap(T0, "a", "gpu0"), _Swap(T0 + 8, "a", "gpu0")]
    # two cold loads measured at 5 and 7 live seconds; a wake or a failure carries no load_s
    ends = [_Swap(T0 + 5, "a", "gpu0", 5.0), _Swap(T0 + 15, "a", "gpu0", 7.0)]
    _, live = _run(CONFIG, trace, SPEED, T0, timings, starts, ends)
    assert live["load_s_live"] == {"a": pytest.approx(12.0)}  # trace seconds: 6 x 2
    assert slow_loads(CONFIG, live) == ["a 12.00 s (configured 10 s)"]
    measured = at_live_load_times(CONFIG, live)
    assert measured.models["a"].load_s == pytest.approx(12.0)
    assert measured.models["b"].load_s == 10  # never loaded live: as configured
    assert CONFIG.models["a"].load_s == 10  # the caller's configuration is left as it was
    assert slow_loads(measured, live) == []


def test_the_simulations_range_covers_the_waits_behind_the_slowest_live_load() -> None:
    one = parse_config(
        "models:\n  a: {load_s: 10, unload_s: 1, memory_gb: 24}\n"
        "  b: {load_s: 10, unload_s: 1, memory_gb: 24}\n"
        "devices:\n  - {name: gpu0, memory_gb: 24}\n"
    )
    trace = parse_trace(
        [
            '{"t": 0, "model": "a", "service_s": 2}',
            '{"t": 30, "model": "b", "service_s": 2}',
            '{"t": 60, "model": "a", "service_s": 2}',
        ],
        "abc",
    )
    first, second, third = (x.line for x in trace.lines)
    # Live seconds (trace / 2): a loads in 5 s, then b in 5 s, then a again in 8 s (a busy
    # machine started it late): waits of 10, 11 and 17 trace seconds.
    timings = {
        first: _Timing(arrived=T0, dispatched=T0 + 5, finished=T0 + 6, device="gpu0"),
        second: _Timing(arrived=T0 + 15, dispatched=T0 + 20.5, finished=T0 + 21.5, device="gpu0"),
        third: _Timing(arrived=T0 + 30, dispatched=T0 + 38.5, finished=T0 + 39.5, device="gpu0"),
    }
    starts = [_Swap(T0, "a", "gpu0"), _Swap(T0 + 15, "b", "gpu0"), _Swap(T0 + 30, "a", "gpu0")]
    ends = [
        _Swap(T0 + 5, "a", "gpu0", 5.0),
        _Swap(T0 + 20.5, "b", "gpu0", 5.0, 0.5, "a"),
        _Swap(T0 + 38.5, "a", "gpu0", 8.0, 0.5, "b"),
    ]
    run, live = _run(one, trace, SPEED, T0, timings, starts, ends)
    assert live["load_s_live_range"] == {"a": [10.0, 16.0], "b": [10.0, 10.0]}
    _, diffs = simulated_beside(one, run, live)
    (wait,) = [d for d in diffs if d.figure == "interactive wait p95 s"]
    assert wait.ok, wait
    assert wait.high is not None
    assert wait.high >= 16.0  # a simulation with a's slowest load
    # The mean load (13 s) alone puts the slowest wait out of reach.
    means = {k: v for k, v in live.items() if not k.endswith("_range")}
    _, diffs = simulated_beside(one, run, means)
    (wait,) = [d for d in diffs if d.figure == "interactive wait p95 s"]
    assert not wait.ok, wait


def test_live_times_replace_arrivals_and_the_services_of_lines_served_alone() -> None:
    trace = parse_trace(
        [
            '{"t": 0, "model": "a", "service_s": 2}',
            '{"session": "c", "model": "a", "service_s": 1, "context_tokens": 500}',
            '{"t": 1, "model": "b", "service_s": 3}',
            '{"t": 1, "model": "b", "service_s": 3, "class": "batch"}',
            '{"t": 2, "model": "a", "service_s": 1}',
            '{"t": 2, "model": "b", "service_s": 1}',
        ],
        "abcdef",
    )
    one, conversation, lost, batch, shared_a, shared_b = trace.lines
    timings = {
        one.line: _Timing(arrived=T0, dispatched=T0 + 6, finished=T0 + 7.5, device="gpu0"),
        conversation.line: _Timing(arrived=T0, dispatched=T0 + 8, finished=T0 + 9, device="gpu0"),
        lost.line: _Timing(arrived=T0, error="502"),
        batch.line: _Timing(arrived=T0, dispatched=T0 + 10, finished=T0 + 12, device="gpu1"),
        # these two overlap: their live times measure the sharing, not the machine
        shared_a.line: _Timing(arrived=T0, dispatched=T0 + 20, finished=T0 + 22, device="gpu0"),
        shared_b.line: _Timing(arrived=T0, dispatched=T0 + 21, finished=T0 + 23, device="gpu1"),
    }
    run, _ = _run(CONFIG, trace, SPEED, T0, timings, [], [])
    live = at_live_times(run)
    # 1.5 live seconds at 2x: 3 trace seconds, where the trace said 2; the rest as they were
    assert [x.service_s for x in live.lines] == [pytest.approx(3.0), 1, 3, 3, 1, 1]
    assert [x.line for x in live.lines] == [x.line for x in trace.lines]
    # open-loop interactive lines arrive when the live run sent them (all at T0 here: trace 0);
    # a session's line, a batch line and one with no answer keep their times
    assert [x.t for x in live.lines] == [0, None, 1, 1, 0, 0]
    assert trace.lines[0].service_s == 2  # the caller's trace is left as it was
    assert slow_services(run) == pytest.approx(12 / 11)
    assert slow_services(run, margin=0.1) is None


def test_a_figure_agrees_within_its_tolerance_of_the_simulations_range() -> None:
    one = Divergence("loads", simulated=10, live=13.5, tolerance=2)
    assert not one.ok  # 3.5 from the one simulation
    assert dataclasses.replace(one, low=9, high=12).ok  # 1.5 past the range's top
    assert not dataclasses.replace(one, low=9, high=11).ok
    assert not dataclasses.replace(one, live=6.5, low=9, high=12).ok
