"""Aborted loads: a load or wake that no waiting request needs any more stops, so a
person never waits for a batch model's load and then a second swap. Events in by hand, effects
recorded, no sleeps."""

from __future__ import annotations

import pytest

from corral.core import Lifecycle
from tests.helpers import Harness

pytestmark = pytest.mark.unit

TWO = """
models:
  chat: {load_s: 10, unload_s: 1, service_s: 2}
  bulk: {load_s: 40, unload_s: 1, service_s: 2}
scheduler: {max_wait_s: 120}
"""


def test_a_load_whose_only_waiting_request_leaves_is_aborted() -> None:
    h = Harness(TWO)
    r = h.at(0).arrive("chat1")
    assert h.take() == [("load", "chat", ())]
    assert h.s.on_cancel(r)
    assert h.take() == [("abort", "chat")]
    chat = h.s.models["chat"]
    assert chat.state is Lifecycle.UNLOADED
    assert chat.device is None
    assert h.s.devices[0].loading is None
    assert h.s.decisions[-1].reason == "load aborted: its waiting requests left"


def test_a_load_still_wanted_by_another_request_goes_on() -> None:
    h = Harness(TWO)
    r = h.at(0).arrive("chat1")
    h.arrive("chat2")
    h.take()
    h.s.on_cancel(r)
    assert h.take() == []
    assert h.s.models["chat"].state is Lifecycle.LOADING


def test_an_operators_load_is_never_aborted() -> None:
    h = Harness(TWO)
    assert h.s.on_load_requested("chat") is None
    r = h.arrive("chat1")
    h.take()
    h.s.on_cancel(r)
    assert h.take() == []
    assert h.s.models["chat"].state is Lifecycle.LOADING


def test_after_an_abort_the_device_serves_the_next_model_that_waits() -> None:
    h = Harness(TWO)
    r = h.at(0).arrive("chat1")
    h.at(1).arrive("bulk1")  # waits: one device, chat is loading
    h.take()
    h.at(2).s.on_cancel(r)
    assert h.take() == [("abort", "chat"), ("load", "bulk", ())]
    h.loaded("bulk")
    assert h.take() == [("dispatch", "bulk1")]


def test_a_persons_request_aborts_a_load_begun_for_batch_work_only() -> None:
    h = Harness(TWO)
    h.at(0).arrive("bulk1", batch=True)
    h.arrive("bulk2", batch=True)
    assert h.take() == [("load", "bulk", ())]
    h.at(5).arrive("chat1")  # 35 s of bulk's load left, then a batch answer, then a swap
    assert h.take() == [("abort", "bulk"), ("load", "chat", ())]
    assert h.s.models["bulk"].count == 2  # the batch work waits; nothing is lost
    h.at(15).loaded("chat")
    assert h.take()[0] == ("dispatch", "chat1")
    h.at(17).finish("chat1")
    assert ("load", "bulk", ("chat",)) in h.take()


def test_a_batch_load_nearly_done_is_left_to_finish() -> None:
    h = Harness(TWO)
    h.at(0).arrive("bulk1", batch=True)
    h.take()
    h.at(39).arrive("chat1")  # 1 s left: finishing, one answer and a swap cost less
    assert ("abort", "bulk") not in h.take()
    assert h.s.models["bulk"].state is Lifecycle.LOADING


def test_a_load_with_interactive_work_waiting_is_not_aborted_for_another_person() -> None:
    h = Harness(TWO)
    h.at(0).arrive("bulk1")  # a person waits for bulk
    h.take()
    h.at(5).arrive("chat1")
    assert h.take() == []
    assert h.s.models["bulk"].state is Lifecycle.LOADING


def test_a_batch_load_past_the_batch_bound_goes_on() -> None:
    h = Harness(
        """
models:
  chat: {load_s: 10, unload_s: 1, service_s: 2}
  bulk: {load_s: 40, unload_s: 1, service_s: 2}
scheduler: {max_wait_s: 120}
batch: {max_wait_s: 30}
"""
    )
    h.at(0).arrive("chat1")
    h.at(1).arrive("bulk1", batch=True)
    h.at(10).loaded("chat")
    t, k = 10.0, 1
    while t < 40:  # people keep chat busy past bulk1's bound
        h.arrive(f"chat{k + 1}")
        t += 2
        h.at(t).finish(f"chat{k}")
        k += 1
        h.timers_due()
        if h.s.models["bulk"].state is Lifecycle.LOADING:
            break
    assert h.s.models["bulk"].state is Lifecycle.LOADING  # forced in by the batch bound
    assert h.s.models["bulk"].oldest(True) is h.requests["bulk1"]
    h.take()
    h.arrive("chat99")
    assert h.take() == []  # the bound keeps the load: no abort
    assert h.s.models["bulk"].state is Lifecycle.LOADING


def test_an_aborted_wake_stops_the_sleeping_server_too() -> None:
    h = Harness(
        """
devices: [{name: gpu0, memory_gb: 24}]
host: {memory_gb: 40}
models:
  a: {load_s: 50, memory_gb: 20, sleep: {wake_s: 2, sleep_s: 1}}
  b: {load_s: 40, memory_gb: 20, sleep: {wake_s: 1, sleep_s: 1}}
scheduler: {max_wait_s: null, sleepers: lru}
"""
    )
    h.at(0).arrive("a1")
    h.loaded("a")
    h.finish("a1")
    h.at(10).arrive("b1")
    h.loaded("b")
    h.finish("b1")
    h.take()
    r = h.at(20).arrive("a2")  # a wakes
    assert h.take() == [("load", "a", (), ("b",), True)]
    h.s.on_cancel(r)
    assert h.take() == [("abort", "a")]
    assert h.s.models["a"].state is Lifecycle.UNLOADED
    assert h.s.models["a"].device is None
    assert h.s.sleepers.all() == [h.s.models["b"]]


def test_a_batch_load_whose_work_became_overdue_while_it_loads_goes_on() -> None:
    h = Harness(
        """
models:
  chat: {load_s: 10, unload_s: 1, service_s: 2}
  bulk: {load_s: 40, unload_s: 1, service_s: 2}
scheduler: {max_wait_s: 120}
batch: {max_wait_s: 30}
"""
    )
    h.at(0).arrive("bulk1", batch=True)
    assert h.take() == [("load", "bulk", ())]
    assert h.s.decisions[-1].reason == "free room"
    h.at(31).arrive("chat1")  # 9 s of the load left, but bulk1 is past its 30 s bound
    assert h.take() == []
    assert h.s.models["bulk"].state is Lifecycle.LOADING
