"""A backlog's work by count (core/backlog.py): the scheduler keeps a request per slot of an
adapter's work and decides when its model is idle. Events in by hand, effects recorded."""

from __future__ import annotations

import pytest

from corral.core import Request, RequestState
from corral.core.backlog import MAX_CHANGES
from tests.helpers import Harness

pytestmark = pytest.mark.unit

TWO = """
models:
  a: {load_s: 4, unload_s: 1}
  b: {load_s: 4, unload_s: 1}
scheduler: {max_wait_s: null}
"""
NOW = (True, 0)  # interactive, priority 0
LATER = (False, 0)  # batch


class Grants:
    """The adapter's side (here the recorded effects see the dispatches)."""

    def granted(self, request: Request) -> None:
        pass

    def refused(self, request: Request, reason: str) -> None:
        raise AssertionError(f"refused: {reason}")


def pending(h: Harness, model: str) -> dict[tuple[bool, int], int]:
    out: dict[tuple[bool, int], int] = {}
    for r in h.s.models[model].pending():
        level = (not r.background, r.priority)
        out[level] = out.get(level, 0) + 1
    return out


def test_a_report_keeps_one_pending_request_per_slot_and_cancels_the_rest() -> None:
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {"a": {NOW: 3}})
    assert h.take() == [("load", "a", ())]
    h.at(4).loaded("a")
    assert h.take() == [("dispatch", None)]  # concurrency 1: one slot runs, two wait
    assert pending(h, "a") == {NOW: 2}
    h.s.on_backlog(adapter, {"a": {NOW: 1, LATER: 2}})
    assert pending(h, "a") == {NOW: 1, LATER: 2}
    h.s.on_backlog(adapter, {"a": {}})
    assert pending(h, "a") == {}


def test_new_requests_come_in_level_order_across_models() -> None:
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {"a": {LATER: 1}, "b": {NOW: 1}})
    # b's interactive slot reached the scheduler first: it loads first.
    assert h.take() == [("load", "b", ())]


def test_a_bound_cancels_the_lowest_levels_first_and_adds_nothing() -> None:
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {"a": {NOW: 2, LATER: 2}})
    h.s.on_backlog(adapter, {"a": 3})
    assert pending(h, "a") == {NOW: 2, LATER: 1}
    h.s.on_backlog(adapter, {"a": 9})
    assert pending(h, "a") == {NOW: 2, LATER: 1}


def test_an_unsettled_models_last_slot_stays_taken_until_an_exact_count() -> None:
    """Tasks moved while the adapter counted: the model must not look idle with work left (it
    was swapped out and loaded again for it)."""
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {"a": {NOW: 1}})
    h.at(4).loaded("a")
    h.take()
    (slot,) = [r for r in h.s.backlog._pending["a", NOW] if r.state is RequestState.RUNNING]
    h.s.on_backlog_moved("a")  # a claim under way: the count may be off
    h.arrive("b1")
    assert h.take() == []  # a is busy: b waits
    assert h.s.on_request_finished(slot) is True  # the last slot stays taken...
    assert h.s.models["a"].in_flight == 1
    assert h.take() == []  # ... so a is not swapped out for b
    h.at(5).s.on_backlog(adapter, {"a": {NOW: 1}})
    # Exact again: the claimed tasks' slot came first, then the parked slot ended: a serves it.
    assert h.take() == [("dispatch", None)]
    assert slot.state is RequestState.DONE
    (nxt,) = [r for r in h.s.backlog._pending["a", NOW] if r.state is RequestState.RUNNING]
    assert h.s.on_request_finished(nxt) is False  # settled: it ends as any request
    assert h.take() == [("load", "b", ("a",))]


def test_a_settled_models_last_slot_ends_at_once() -> None:
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {"a": {NOW: 1}})
    h.at(4).loaded("a")
    h.take()
    (slot,) = [r for r in h.s.backlog._pending["a", NOW] if r.state is RequestState.RUNNING]
    h.arrive("b1")
    assert h.s.on_request_finished(slot) is False
    assert h.take() == [("load", "b", ("a",))]


def test_a_request_of_nobody_s_backlog_is_never_parked() -> None:
    h, adapter = Harness(TWO), Grants()
    h.s.on_backlog(adapter, {})
    h.arrive("a1")
    h.at(4).loaded("a")
    assert h.take() == [("load", "a", ()), ("dispatch", "a1")]
    h.s.on_backlog_moved("a")
    assert h.s.on_request_finished(h.requests["a1"]) is False


def test_a_large_report_is_taken_a_bounded_number_of_requests_at_a_time() -> None:
    # Each request is a scheduler event on the adapter's loop: 50,000 lines at once would hold
    # it for seconds. A report changes at most MAX_CHANGES; the adapter reports again at once.
    h, adapter = Harness(TWO), Grants()
    big = 2 * MAX_CHANGES + 10
    reports = 0
    while h.s.on_backlog(adapter, {"a": {LATER: big}}):
        reports += 1
        assert sum(pending(h, "a").values()) == reports * MAX_CHANGES
    assert reports == 2
    assert pending(h, "a") == {LATER: big}  # whole once a report is not behind
    while h.s.on_backlog(adapter, {"a": {LATER: 5}}):  # cancels are bounded the same way
        assert sum(pending(h, "a").values()) > 5
    assert pending(h, "a") == {LATER: 5}
    while h.s.on_backlog(adapter, {"a": big}):  # an upper bound trims nothing below it
        pass
    assert pending(h, "a") == {LATER: 5}
