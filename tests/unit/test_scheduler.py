"""Scheduler rules, one test each: events in by hand, effects recorded, no sleeps."""

from __future__ import annotations

import math

import pytest

from corral.config import parse_config
from corral.core import RequestState, SchedulerBug
from tests.helpers import Harness

TWO = """
models:
  a: {load_s: 4, unload_s: 1}
  b: {load_s: 12, unload_s: 2}
scheduler: {max_wait_s: null}
"""
THREE = """
models:
  a: {load_s: 4, unload_s: 1}
  b: {load_s: 5, unload_s: 1}
  c: {load_s: 6, unload_s: 1}
scheduler: {max_wait_s: 100}
"""
ALL = ["fifo", "grouped", "fifo-plus", "priority", "cost"]


# --- rules shared by every policy ---------------------------------------------------------------
@pytest.mark.parametrize("policy", ALL)
def test_requests_during_a_load_join_it(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.arrive("a2")
    assert h.take() == [("load", "a", ())]
    h.at(4).loaded("a")
    assert h.take() == [("dispatch", "a1")]
    h.finish("a1")
    assert h.take() == [("dispatch", "a2")]


@pytest.mark.parametrize("policy", ALL)
def test_unknown_model_is_rejected(policy: str) -> None:
    h = Harness(TWO, policy)
    r = h.arrive("x1", "nope")
    (call,) = h.take()
    assert call[:2] == ("reject", "x1")
    assert "unknown model 'nope'" in str(call[2])
    assert r.state is RequestState.REJECTED


@pytest.mark.parametrize("policy", ALL)
def test_nothing_pending_keeps_the_resident_model(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.at(4).loaded("a")
    h.at(9).finish("a1")
    h.at(10_000).timers_due()
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]


@pytest.mark.parametrize("policy", ALL)
def test_never_evicts_a_model_with_work_in_flight(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.at(4).loaded("a")
    h.take()
    h.arrive("b1")
    assert h.take() == []  # a1 still runs
    h.at(9).finish("a1")
    assert h.take() == [("load", "b", ("a",))]


@pytest.mark.parametrize("policy", ALL)
def test_request_priority_first_then_fifo_within_a_model(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.arrive("a2")
    h.arrive("a3", priority=1)
    h.arrive("a4", priority=1)
    h.at(4).loaded("a")
    for rid in ("a3", "a4", "a1"):
        h.finish(rid)
    assert [c[1] for c in h.take() if c[0] == "dispatch"] == ["a3", "a4", "a1", "a2"]


@pytest.mark.parametrize("policy", ALL)
def test_cancelled_request_never_triggers_a_load(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.at(4).loaded("a")
    b1 = h.arrive("b1")
    assert h.s.on_cancel(b1)
    h.at(9).finish("a1")
    assert [c for c in h.take() if c[0] == "load"] == [("load", "a", ())]
    assert b1.state is RequestState.CANCELLED
    assert not h.s.on_cancel(b1)


def test_load_failure_rejects_the_waiting_requests() -> None:
    h = Harness(TWO)
    h.arrive("a1")
    h.arrive("a2")
    h.take()
    h.s.on_load_failed("a", "exit code 1")
    calls = h.take()
    assert [c[:2] for c in calls] == [("reject", "a1"), ("reject", "a2")]
    assert "failed to load: exit code 1" in str(calls[0][2])
    h.arrive("a3")  # the next request tries again
    assert h.take() == [("load", "a", ())]


def test_overdue_request_goes_first_inside_its_model() -> None:
    h = Harness("models: {a: {load_s: 1}}\nscheduler: {max_wait_s: 10}\n", "cost")
    h.arrive("a1")
    h.at(1).loaded("a")
    h.arrive("a2")  # low priority, waits behind a stream of priority-1 requests
    h.at(5).arrive("a3", priority=1)
    h.at(6).finish("a1")
    h.at(8).arrive("a4", priority=1)
    h.at(12).finish("a3")  # a2 has waited 11 s > max_wait_s: it goes before a4
    assert [c[1] for c in h.take() if c[0] == "dispatch"] == ["a1", "a3", "a2"]


# --- several devices and memory ----------------------------------------------------------------
def test_dual_gpu_runs_both_models_side_by_side() -> None:
    h = Harness("devices: [{name: g0}, {name: g1}]\nmodels: {a: {load_s: 4}, b: {load_s: 5}}\n")
    for rid in ("a1", "b1", "a2", "b2"):
        h.arrive(rid)
    assert h.take() == [("load", "a", ()), ("load", "b", ())]
    h.at(4).loaded("a")
    h.at(5).loaded("b")
    assert h.take() == [("dispatch", "a1"), ("dispatch", "b1")]


def test_memory_decides_what_fits_and_evicts_the_idle_model() -> None:
    h = Harness(
        "devices: [{name: g, memory_gb: 24}]\n"
        "models: {a: {memory_gb: 10}, b: {memory_gb: 10}, c: {memory_gb: 10}}\n"
        "scheduler: {policy: fifo-plus}\n"
    )
    h.arrive("a1")
    h.arrive("b1")
    assert h.take() == [("load", "a", ())]  # one swap at a time per device
    h.loaded("a")
    assert h.take() == [("load", "b", ()), ("dispatch", "a1")]  # b fits beside a
    h.loaded("b")
    assert h.take() == [("dispatch", "b1")]
    h.finish("a1")
    h.arrive("c1")  # a is idle, b still serves b1: a is evicted
    assert h.take() == [("load", "c", ("a",))]
    resident = sorted(m.name for m in h.s.board.residents())
    assert resident == ["b", "c"]


# --- a model's measured memory (what its server reported once loaded) -------------
MEASURED = (
    "devices: [{name: g, memory_gb: 24}]\n"
    "models: {a: {memory_gb: 10}, b: {memory_gb: 10}, c: {memory_gb: 4, pin: true}}\n"
    "scheduler: {policy: fifo-plus}\n"
)


def test_a_measured_figure_that_overfills_the_device_sends_an_idle_neighbour_away() -> None:
    h = Harness(MEASURED)
    h.arrive("a1")
    h.loaded("a")
    h.finish("a1")
    h.arrive("b1")
    h.s.on_load_finished("b", memory_gb=12.0)  # a 10 + b 12: still fits 24
    assert h.take() == [("load", "a", ()), ("dispatch", "a1"), ("load", "b", ()),
                        ("dispatch", "b1")]  # fmt: skip
    assert h.s.models["b"].memory_gb == 12.0
    assert h.s.models["b"].spec.memory_gb != 12.0  # kept beside the configuration, not in it
    h.finish("b1")
    assert h.s.on_restart_requested("b")  # b's server starts again and reports 16 GB
    h.take()
    h.arrive("b2")
    h.s.on_load_finished("b", memory_gb=16.0)
    assert h.take() == [("load", "b", ()), ("unload", "a"), ("dispatch", "b2")]
    assert h.s.decisions[-1].reason == "memory: b takes 16 GB"
    assert sorted(m.name for m in h.s.board.residents()) == ["b"]


def test_a_busy_neighbour_finishes_its_requests_then_leaves() -> None:
    h = Harness(MEASURED)
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    h.s.on_load_finished("b", memory_gb=20.0)
    assert h.take() == [("load", "a", ()), ("dispatch", "a1"), ("load", "b", ()),
                        ("dispatch", "b1")]  # fmt: skip
    h.arrive("a2")  # a is leaving: it takes no new work
    assert h.take() == []
    h.finish("a1")
    assert h.take()[0] == ("unload", "a")
    assert h.s.decisions[-1].reason == "memory: b takes 20 GB"


def test_a_model_that_fits_only_past_a_pinned_one_leaves_itself() -> None:
    h = Harness(MEASURED)
    assert h.s.on_load_requested("c") is None
    h.loaded("c")
    h.arrive("a1")
    h.loaded("a")
    h.finish("a1")
    h.arrive("b1")
    h.take()
    h.s.on_load_finished("b", memory_gb=21.0)  # c (pinned) 4 + b 21 > 24 even without a
    assert h.take() == [("unload", "b")]
    assert h.s.decisions[-1].reason == "memory: b takes 21 GB"
    assert sorted(m.name for m in h.s.board.residents()) == ["a", "c"]
    assert h.requests["b1"].state is RequestState.PENDING  # placed again by 21 GB


def test_a_model_too_big_for_its_device_alone_stays() -> None:
    h = Harness(MEASURED)
    h.arrive("a1")
    h.s.on_load_finished("a", memory_gb=30.0)
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]
    assert h.s.models["a"].state.value == "ready"


# --- fifo -------------------------------------------------------------------------------------
def test_fifo_swaps_on_every_model_change() -> None:
    h = Harness(TWO, "fifo")
    for rid in ("a1", "b1", "a2", "b2"):
        h.arrive(rid)
    h.loaded("a")
    h.finish("a1")
    h.loaded("b")
    h.finish("b1")
    h.loaded("a")
    h.finish("a2")
    loads = [c[1] for c in h.take() if c[0] == "load"]
    assert loads == ["a", "b", "a", "b"]


# --- grouped ----------------------------------------------------------------------------------
def test_grouped_switches_to_the_longest_queue_only_when_dry() -> None:
    h = Harness(THREE, "grouped")
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    h.arrive("c1")
    h.arrive("c2")
    h.arrive("a2")
    h.finish("a1")  # a still has a2: no switch, even though b1 is older
    assert h.take()[-1] == ("dispatch", "a2")
    h.at(500).finish("a2")  # max_wait_s is ignored by grouped
    assert h.take() == [("load", "c", ("a",))]


# --- fifo-plus --------------------------------------------------------------------------------
def test_fifo_plus_switches_to_the_oldest_request_when_dry() -> None:
    h = Harness(THREE, "fifo-plus")
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    h.arrive("c1")
    h.arrive("c2")
    h.finish("a1")
    assert h.take()[-1] == ("load", "b", ("a",))


def test_fifo_plus_max_wait_stops_new_work_then_switches() -> None:
    h = Harness(THREE, "fifo-plus")
    h.arrive("a1")
    h.at(4).loaded("a")
    h.at(5).arrive("b1")
    h.at(10).arrive("a2")
    h.at(20).finish("a1")
    assert h.take()[-1] == ("dispatch", "a2")  # b1 not overdue yet
    h.at(104).arrive("a3")
    h.at(105).timers_due()  # b1 has waited 100 s: a takes no new work
    h.at(110).finish("a2")
    assert h.take() == [("load", "b", ("a",))]
    assert h.requests["a3"].state is RequestState.PENDING


def test_fifo_plus_without_max_wait_is_exhaustive() -> None:
    h = Harness(TWO, "fifo-plus")
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    for i in range(2, 50):
        h.arrive(f"a{i}")
        h.at(i * 10.0).finish(f"a{i - 1}")
        h.timers_due()
    assert [c for c in h.take() if c[0] == "load"] == [("load", "a", ())]
    assert h.fx.timers == []


# --- priority ---------------------------------------------------------------------------------
PRIO = """
models:
  low: {load_s: 4, priority: 0}
  high: {load_s: 4, priority: 1, unload_delay_s: 30}
scheduler: {policy: priority, max_wait_s: 300}
"""


def test_priority_higher_model_preempts_between_requests() -> None:
    h = Harness(PRIO)
    h.arrive("low1")
    h.loaded("low")
    h.arrive("low2")
    h.arrive("high1")
    h.finish("low1")  # low2 waits; high takes over
    assert h.take()[-1] == ("load", "high", ("low",))


def test_priority_unload_delay_keeps_the_model_and_restarts() -> None:
    h = Harness(PRIO)
    h.arrive("high1")
    h.loaded("high")
    h.at(10).finish("high1")
    h.arrive("low1")
    assert h.take()[-1] == ("dispatch", "high1")  # lingers: unload delay 30 s
    h.at(25).arrive("high2")  # within the delay: runs at once, delay restarts after it
    assert h.take() == [("dispatch", "high2")]
    h.at(30).finish("high2")
    h.at(45).timers_due()
    assert h.take() == []
    h.at(60).timers_due()
    assert h.take() == [("load", "low", ("high",))]


def test_priority_strictly_higher_work_ends_the_delay() -> None:
    h = Harness("""
models:
  a: {load_s: 4, priority: 1, unload_delay_s: 60}
  b: {load_s: 4, priority: 2}
scheduler: {policy: priority}
""")
    h.arrive("a1")
    h.loaded("a")
    h.finish("a1")
    h.arrive("b1")
    assert h.take()[-1] == ("load", "b", ("a",))


# --- cost -------------------------------------------------------------------------------------
CHAT = """
models:
  batch: {load_s: 10, unload_s: 2, service_s: 1}
  chat: {load_s: 3, unload_s: 1, service_s: 3}
scheduler: {policy: cost, max_wait_s: 120}
"""


def test_cost_high_priority_request_interrupts_a_busy_queue() -> None:
    h = Harness(CHAT)
    for i in range(50):
        h.arrive(f"batch{i}", "batch")
    h.loaded("batch")
    h.arrive("chat1", "chat", priority=2)
    h.finish("batch0")
    assert h.take()[-1] == ("load", "chat", ("batch",))


def test_cost_equal_priority_never_interrupts_a_busy_queue() -> None:
    h = Harness(CHAT)
    for i in range(50):
        h.arrive(f"batch{i}", "batch")
    h.loaded("batch")
    for i in range(200):
        h.arrive(f"chat{i}", "chat")
    h.finish("batch0")
    assert h.take()[-1] == ("dispatch", "batch1")


def closed_loop(h: Harness, gap_s: float) -> float:
    """chat in a closed loop: six 3 s requests, each next one `gap_s` after the last answer;
    the time the sixth is answered (left in flight)."""
    t = 0.0
    h.arrive("chat0", "chat")
    h.loaded("chat")
    for i in range(1, 6):
        t += 3
        h.at(t).finish(f"chat{i - 1}")
        t += gap_s
        h.at(t).arrive(f"chat{i}", "chat")
    return t + 3


def test_cost_lingers_for_a_predictable_next_request() -> None:
    h = Harness(CHAT)
    t = closed_loop(h, 0.5)
    h.take()
    h.at(t).arrive("batch0", "batch")
    h.finish("chat5")  # idle; a batch request waits, but chat's next one is due in ~0.5 s
    assert h.take() == []
    h.at(t + 0.5).arrive("chat6", "chat")
    assert h.take() == [("dispatch", "chat6")]
    h.at(t + 3.5).finish("chat6")
    h.at(t + 20).timers_due()  # no next chat request: the linger ends, batch goes in
    assert h.take() == [("load", "batch", ("chat",))]


def test_cost_lingers_against_one_waiting_request_but_not_a_backlog_that_outweighs_it() -> None:
    """The hold is priced like a queue (its next request: due in ~0.5 s, then 3 s of service)
    against the waiting work by the interchange test: one waiting request (the test above)
    does not outweigh it; forty (40 x 3.5 s against 1.5 x (11 s in + 40 s + 5 s back)) do, so
    the device does not idle while they wait (the crowded family, docs/benchmarks.md)."""
    h = Harness(CHAT)
    t = closed_loop(h, 0.5)
    for i in range(10):
        h.at(t).arrive(f"batch{i}", "batch")
    h.take()
    h.finish("chat5")
    assert h.take() == []  # ten: 35 against 39, it holds
    for i in range(10, 40):
        h.arrive(f"batch{i}", "batch")
    assert h.take() == [("load", "batch", ("chat",))]


def test_cost_lingers_against_a_backlog_no_longer_than_a_round_trip() -> None:
    """Rent-or-buy from the waiting side: each of chat's requests renews its linger, and two
    waiting batch requests are too light to outweigh one hold (2 x 3.5 s against 1.5 x 18 s),
    so the holds used to add up while the backlog waited. Once it has waited chat's round trip
    (1 s out, 3 s back) it goes in. One waiting step of another loop, waiting as long, still
    holds: only the time chat idled counts against it (0.3 s gaps: 2.1 s of its visit)."""
    for n, holds in ((1, True), (2, False)):
        h = Harness(CHAT)
        t = closed_loop(h, 0.3)
        for i in range(n):
            h.at(t).arrive(f"batch{i}", "batch")
        h.take()
        h.finish("chat5")
        assert h.take() == []
        h.at(t + 0.3).arrive("chat6", "chat")
        h.at(t + 3.3).finish("chat6")
        assert h.take() == [("dispatch", "chat6")]  # waited 3.3 s: both hold
        h.at(t + 3.6).arrive("chat7", "chat")
        h.take()
        h.at(t + 6.6).finish("chat7")
        assert h.take() == ([] if holds else [("load", "batch", ("chat",))]), n


def test_cost_lingers_through_jitter_in_very_short_gaps() -> None:
    """An agent loop whose next request comes ~10 ms after each answer; one late by 0.3 s (a
    client thread not scheduled) still finds its model: the linger lasts at least a quarter of
    a reload (4 s here), not just the learned 10 ms plus deviation."""
    h = Harness(CHAT)
    t = closed_loop(h, 0.01)
    h.at(t).arrive("batch0", "batch")
    h.finish("chat5")
    h.take()
    h.at(t + 0.3).timers_due()
    assert h.take() == []  # still lingering
    h.arrive("chat6", "chat")
    assert h.take() == [("dispatch", "chat6")]
    h.at(t + 3.3).finish("chat6")
    h.at(t + 5).timers_due()  # a quarter of the 4 s reload has passed: batch goes in
    assert h.take() == [("load", "batch", ("chat",))]


SHARED = """
models:
  a: {load_s: 5, unload_s: 1, service_s: 10, memory_gb: 8}
  b: {load_s: 5, unload_s: 1, service_s: 1, memory_gb: 8}
  big: {load_s: 5, unload_s: 1, service_s: 1, memory_gb: 20}
  s: {load_s: 2, unload_s: 1, service_s: %s, memory_gb: 8}
devices: [{name: g0, memory_gb: 24}]
scheduler: {policy: cost, max_wait_s: 600}
"""


@pytest.mark.parametrize("s_service_s", [60, 1])
def test_a_worse_candidate_backfills_only_what_it_frees_before_the_better_one_gets_its_room(
    s_service_s: float,
) -> None:
    """EASY backfilling. big (ten requests) ranks first and needs the whole device: idle b's
    room and busy a's, whose queue holds 30 s of work. s (one request) fits the room free now.
    With a minute of work s would still hold that room when a runs dry, so it waits: worse
    candidates used to take it each time, and a model that needed the whole device waited
    for their queues until its stretched bound (default family, seed 5216). With a second of
    work it goes in: it is done before a is."""
    h = Harness(SHARED % s_service_s)
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    h.loaded("b")
    h.finish("b1")
    for i in range(2, 5):
        h.arrive(f"a{i}")
    h.take()
    for i in range(10):
        h.arrive(f"big{i}")
    assert h.take() == []  # a has work: big waits for it
    h.arrive("s1")
    assert h.take() == ([] if s_service_s == 60 else [("load", "s", ())])


def test_cost_prefers_the_queue_worth_most_per_second() -> None:
    h = Harness(THREE, "cost")
    h.arrive("a1")
    h.loaded("a")
    h.arrive("b1")
    for i in range(1, 6):
        h.arrive(f"c{i}")
    h.finish("a1")
    assert h.take()[-1] == ("load", "c", ("a",))


# --- progress and the max_wait quantum ---------------------------------------------------------
def test_a_swapped_in_model_serves_one_round_before_yielding() -> None:
    h = Harness(PRIO)
    h.arrive("low1")
    h.arrive("low2")
    h.arrive("high1")  # arrives during low's load
    h.at(4).loaded("low")
    assert h.take()[-1] == ("dispatch", "low1")
    h.at(5).finish("low1")
    assert h.take() == [("load", "high", ("low",))]


def test_max_wait_cannot_end_a_visit_before_its_quantum() -> None:
    h = Harness(
        "models: {a: {load_s: 20}, b: {load_s: 20}}\n"
        "scheduler: {policy: fifo-plus, max_wait_s: 10, min_visit_swaps: 1}\n"
    )
    h.arrive("a1")
    h.arrive("a2")
    h.at(1).arrive("b1")
    h.at(20).loaded("a")  # b1 is overdue, but a loaded 0 s ago after a 20 s swap
    h.at(21).finish("a1")
    assert h.take()[-1] == ("dispatch", "a2")
    h.at(40).timers_due()
    h.at(41).finish("a2")
    assert h.take() == [("load", "b", ("a",))]


def test_lifecycle_moves_follow_the_transition_table() -> None:
    h = Harness(TWO)
    h.arrive("a1")  # a is loading; b never started
    with pytest.raises(SchedulerBug, match="b: unloaded -> ready is not a lifecycle move"):
        h.s.on_load_finished("b")


# --- a loaded model's server dies ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ALL)
def test_a_lost_model_takes_no_work_and_reloads_after_its_requests_end(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.at(0).take()
    h.at(4).loaded("a")
    assert h.take() == [("dispatch", "a1")]
    h.arrive("a2")
    h.s.on_model_lost("a")
    h.arrive("a3")
    assert h.take() == []  # nothing goes to a dead server, and no load while a1 is in flight
    assert h.s.models["a"].state.value == "ready"
    h.at(5).finish("a1")  # the adapter failed a1
    assert h.take() == [("load", "a", ())]  # nothing to evict: the server is already gone
    h.at(9).loaded("a")
    assert h.take() == [("dispatch", "a2")]
    assert h.s.models["a"].lost is False


@pytest.mark.parametrize("policy", ALL)
def test_a_lost_idle_model_is_unloaded_at_once_and_others_may_take_the_room(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.at(4).loaded("a")
    h.finish("a1")
    h.take()
    h.s.on_model_lost("a")
    assert h.take() == []
    assert h.s.models["a"].state.value == "unloaded"
    assert h.s.devices[0].residents == []
    h.s.on_model_lost("a")  # a second report changes nothing
    h.arrive("b1")
    assert h.take() == [("load", "b", ())]


# --- ttl_s, the operator's load and unload, device pinning ---------------------------------------
@pytest.mark.parametrize("policy", ALL)
def test_ttl_unloads_an_idle_model_and_a_new_request_restarts_the_clock(policy: str) -> None:
    h = Harness("models:\n  a: {load_s: 4, ttl_s: 30}\n  b: {load_s: 4}\n", policy)
    h.arrive("a1")
    h.at(4).loaded("a")
    h.at(10).finish("a1")  # idle from 10: due at 40
    h.at(20).arrive("a2")  # busy again: the first timer goes stale
    h.at(25).finish("a2")  # idle from 25: due at 55
    h.at(45).timers_due()
    assert ("unload", "a") not in h.take()
    h.at(55).timers_due()
    assert h.take() == [("unload", "a")]
    assert h.s.models["a"].state.value == "unloaded"
    assert h.s.decisions[-1].model is None
    assert h.s.decisions[-1].reason == "ttl_s"
    h.at(60).arrive("a3")
    assert h.take() == [("load", "a", ())]


def test_without_ttl_an_idle_model_stays() -> None:
    h = Harness("models:\n  a: {load_s: 4}\n")
    h.arrive("a1")
    h.at(4).loaded("a")
    h.at(5).finish("a1")
    h.at(1e6).timers_due()
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]


def test_keep_alive_from_a_request_overrides_ttl_until_the_next_one_says_otherwise() -> None:
    """Ollama's keep_alive: 0 unloads once idle, a duration replaces ttl_s, math.inf keeps the
    model; set while a request runs, the clock starts when the model goes idle."""
    h = Harness("models:\n  a: {load_s: 4, ttl_s: 30}\n")
    h.arrive("a1")
    h.at(4).loaded("a")
    h.s.on_keep_alive("a", 0.0)  # busy: nothing yet
    h.at(5).timers_due()
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]
    h.at(6).finish("a1")
    h.timers_due()
    assert h.take() == [("unload", "a")]
    h.at(10).arrive("a2")
    h.at(14).loaded("a")
    h.s.on_keep_alive("a", math.inf)
    h.at(15).finish("a2")
    h.at(1e6).timers_due()  # ttl_s 30 no longer applies
    assert h.take() == [("load", "a", ()), ("dispatch", "a2")]
    h.s.on_keep_alive("a", 60.0)  # idle: the clock starts now
    h.at(1e6 + 59).timers_due()
    assert h.take() == []
    h.at(1e6 + 60).timers_due()
    assert h.take() == [("unload", "a")]


def test_a_changed_command_restarts_the_model_after_its_requests_end() -> None:
    """`corral serve --watch`: the running copy takes no new work, unloads once its requests
    end, and the queue loads it again (with the new command, the gateway's side)."""
    h = Harness("models:\n  a: {load_s: 4, concurrency: 2}\n")
    h.arrive("a1")
    h.at(4).loaded("a")
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]
    assert h.s.on_restart_requested("a")
    h.at(5).arrive("a2")  # waits: the old server takes no new work
    assert h.take() == []
    h.at(6).finish("a1")
    assert h.take() == [("unload", "a"), ("load", "a", ())]
    assert h.s.decisions[-2].reason == "restart"
    h.at(10).loaded("a")
    assert h.take() == [("dispatch", "a2")]


def test_a_model_added_and_removed_while_serving() -> None:
    h = Harness("models:\n  a: {load_s: 4}\n")
    h.s.on_model_added("b", parse_config("models: {b: {load_s: 2}}\n").models["b"])
    h.arrive("b1")
    h.at(2).loaded("b")
    assert h.take() == [("load", "b", ()), ("dispatch", "b1")]
    assert not h.s.on_model_removed("b")  # busy: it unloads once idle
    h.at(3).finish("b1")
    h.timers_due()
    assert h.take() == [("unload", "b")]
    assert h.s.on_model_removed("b")
    assert "b" not in h.s.models
    h.s.on_model_changed("a", parse_config("models: {a: {load_s: 4, priority: 5}}\n").models["a"])
    assert h.s.models["a"].priority == 5


def test_operator_load_evicts_only_an_idle_model() -> None:
    h = Harness(TWO)
    assert h.s.on_load_requested("a") is None
    assert h.take() == [("load", "a", ())]
    assert h.s.on_load_requested("a") is None  # already loading: nothing more
    assert "swap is under way" in str(h.s.on_load_requested("b"))
    h.at(4).loaded("a")
    h.arrive("a1")
    h.take()
    reason = h.s.on_load_requested("b")
    assert reason == "it would evict a (0 queued, 1 in flight)"
    h.finish("a1")
    assert h.s.on_load_requested("b", evict=False) == "no free room: it would evict a"
    assert h.s.on_load_requested("b") is None
    assert h.take() == [("load", "b", ("a",))]
    assert h.s.decisions[-1].reason == "requested"


def test_operator_unload_only_of_an_idle_ready_model() -> None:
    h = Harness(TWO)
    h.arrive("a1")
    assert h.s.on_unload_requested("a") == "it is loading; unload it once it is ready"
    h.at(4).loaded("a")
    assert h.s.on_unload_requested("a") == "it has 0 queued and 1 in flight requests"
    h.finish("a1")
    h.take()
    assert h.s.on_unload_requested("a") is None
    assert h.take() == [("unload", "a")]
    assert h.s.devices[0].residents == []
    assert h.s.on_unload_requested("a") is None  # already unloaded
    assert h.take() == []


def test_an_unload_frees_room_for_a_waiting_model() -> None:
    # a lingers after its last request (unload_delay_s) while b waits; unloading a lets b in.
    h = Harness(
        "models:\n  a: {load_s: 4, priority: 1, unload_delay_s: 600}\n  b: {load_s: 4}\n",
        "priority",
    )
    h.arrive("a1")
    h.at(4).loaded("a")
    h.arrive("b1")
    h.finish("a1")
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]  # b waits out a's delay
    assert h.s.on_unload_requested("a") is None
    assert h.take() == [("unload", "a"), ("load", "b", ())]


def test_a_model_pinned_to_a_device_never_loads_elsewhere() -> None:
    h = Harness(
        "devices: [{name: g0}, {name: g1}]\n"
        "models:\n  a: {load_s: 4, devices: [g1]}\n  b: {load_s: 4, devices: [g1]}\n"
    )
    h.arrive("a1")
    h.arrive("b1")
    assert h.take() == [("load", "a", ())]  # g0 is free, but neither may use it
    assert h.s.models["a"].device is not None
    assert h.s.models["a"].device.name == "g1"
    h.at(4).loaded("a")
    h.at(5).finish("a1")
    assert h.take() == [("dispatch", "a1"), ("load", "b", ("a",))]


# --- service classes ----------------------------------------------------------------------------
CLASSED = ["fifo-plus", "priority", "cost"]
TWO_SLOTS = """
models:
  a: {load_s: 4, unload_s: 1, concurrency: 2}
  b: {load_s: 12, unload_s: 2}
scheduler: {max_wait_s: 120}
"""


@pytest.mark.parametrize("policy", CLASSED)
def test_batch_yields_to_interactive_work_at_its_next_request_boundary(policy: str) -> None:
    h = Harness(TWO_SLOTS, policy)
    for i in range(1, 7):
        h.arrive(f"a{i}", batch=True)
    h.at(4).loaded("a")
    assert h.take() == [("load", "a", ()), ("dispatch", "a1"), ("dispatch", "a2")]
    h.at(5).arrive("b1")  # a person waits: a takes no new batch line
    assert h.take() == []
    h.at(6).finish("a1")
    assert h.take() == []  # a2 still runs: nothing is aborted
    h.at(7).finish("a2")
    assert h.take() == [("load", "b", ("a",))]
    h.at(21).loaded("b")
    h.at(22).finish("b1")
    assert h.take() == [("dispatch", "b1"), ("load", "a", ("b",))]  # then the batch again


@pytest.mark.parametrize("policy", CLASSED)
def test_interactive_work_goes_first_whatever_the_batch_priority(policy: str) -> None:
    h = Harness(THREE, policy)
    h.arrive("c1")
    h.at(6).loaded("c")
    h.take()
    h.arrive("a1", batch=True, priority=9)
    h.at(7).arrive("b1")
    h.at(8).finish("c1")
    assert h.take() == [("load", "b", ("c",))]
    h.at(14).loaded("b")
    h.at(15).finish("b1")
    assert h.take() == [("dispatch", "b1"), ("load", "a", ("b",))]


@pytest.mark.parametrize("policy", CLASSED)
def test_interactive_requests_go_before_batch_lines_inside_a_model(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1", batch=True)
    h.arrive("a2", batch=True)
    h.arrive("a3")
    h.at(4).loaded("a")
    h.finish("a3")
    h.finish("a1")
    assert [c[1] for c in h.take() if c[0] == "dispatch"] == ["a3", "a1", "a2"]


@pytest.mark.parametrize("policy", CLASSED)
def test_batch_work_never_displaces_interactive_work(policy: str) -> None:
    h = Harness(TWO, policy)
    h.arrive("a1")
    h.arrive("a2")
    h.at(4).loaded("a")
    h.take()
    for i in range(1, 100):
        h.arrive(f"b{i}", batch=True, priority=5)
    h.at(5).finish("a1")
    assert h.take() == [("dispatch", "a2")]
    h.at(6).finish("a2")
    assert h.take() == [("load", "b", ("a",))]  # idle now: the batch fills the device


@pytest.mark.parametrize("policy", CLASSED)
def test_batch_fills_an_idle_device_beside_interactive_work(policy: str) -> None:
    h = Harness(
        "devices: [{name: g0}, {name: g1}]\n"
        "models: {a: {load_s: 4, devices: [g0]}, b: {load_s: 6, devices: [g1]}}\n",
        policy,
    )
    h.arrive("a1")
    h.arrive("b1", batch=True)
    assert h.take() == [("load", "a", ()), ("load", "b", ())]


@pytest.mark.parametrize("policy", CLASSED)
def test_batch_max_wait_brings_batch_work_in_past_fresh_interactive_work(policy: str) -> None:
    h = Harness(
        "models: {a: {load_s: 1, unload_s: 0}, b: {load_s: 1, unload_s: 0}}\n"
        "scheduler: {max_wait_s: 100}\nbatch: {max_wait_s: 30}\n",
        policy,
    )
    h.arrive("a1")
    h.at(1).loaded("a")
    h.take()
    h.arrive("b1", batch=True)
    t, k = 1.0, 2
    while t < 40:  # a person keeps model a busy, one request after the other
        h.arrive(f"a{k}")
        t += 2
        h.at(t).timers_due()
        h.finish(f"a{k - 1}")
        k += 1
    loads = [c for c in h.take() if c[0] == "load"]
    assert loads == [("load", "b", ("a",))]  # b1 waited 30 s: its turn came


def test_without_classes_the_baselines_keep_arrival_order() -> None:
    h = Harness(TWO, "fifo")
    h.arrive("a1", batch=True)
    h.arrive("b1")
    assert h.take() == [("load", "a", ())]
    h.at(4).loaded("a")
    h.at(5).finish("a1")
    assert h.take() == [("dispatch", "a1"), ("load", "b", ("a",))]
