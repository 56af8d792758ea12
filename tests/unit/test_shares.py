"""Fair shares between principals inside a class (core/shares.py): events in by hand, the
scheduler's decisions recorded."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.config import Config
from corral.core.shares import Shares
from corral.core.types import Request
from corral.sim.engine import simulate
from corral.sim.trace import Trace
from tests.helpers import Harness
from tests.support.properties import SETTINGS, scenarios

pytestmark = pytest.mark.unit

ONE = """
models:
  a: {load_s: 4, unload_s: 1, service_s: 2}
  b: {load_s: 4, unload_s: 1, service_s: 2}
scheduler: {max_wait_s: 120}
"""


def dispatched(h: Harness) -> list[object]:
    return [c[1] for c in h.take() if c[0] == "dispatch"]


def flood(h: Harness, n: int, who: str = "heavy", model: str = "a") -> None:
    for i in range(n):
        h.arrive(f"{who}{i}", model, principal=who)


def test_a_light_principal_goes_before_a_heavy_backlog_on_the_same_model() -> None:
    h = Harness(ONE)
    flood(h, 10)
    h.at(4).loaded("a")
    assert dispatched(h) == ["heavy0"]
    h.at(5).arrive("light0", "a", principal="light")
    h.at(6).finish("heavy0")
    assert dispatched(h) == ["light0"]  # not heavy1..heavy9, which came first


def test_without_fair_shares_a_level_is_served_oldest_first() -> None:
    h = Harness(ONE.replace("max_wait_s: 120", "max_wait_s: 120, fair_shares: false"))
    flood(h, 3)
    h.at(4).loaded("a")
    h.at(5).arrive("light0", "a", principal="light")
    for t, rid in ((6, "heavy0"), (7, "heavy1"), (8, "heavy2")):
        h.at(t).finish(rid)
    assert dispatched(h) == ["heavy0", "heavy1", "heavy2", "light0"]


def test_a_principal_past_its_share_cannot_jump_with_its_overdue_backlog() -> None:
    h = Harness(ONE.replace("max_wait_s: 120", "max_wait_s: 10"))
    flood(h, 30)
    h.at(4).loaded("a")
    t = 4.0
    for i in range(5):  # heavy's queue waits past the bound meanwhile
        t += 2
        h.at(t).finish(f"heavy{i}")
    h.take()
    h.at(t + 0.5).arrive("light0", "a", principal="light")
    h.at(t + 2).finish("heavy5")
    assert dispatched(h) == ["light0"]


def test_one_principal_alone_is_served_as_before() -> None:
    h = Harness(ONE)
    for i in range(3):
        h.arrive(f"x{i}", "a", principal="solo")
    h.at(4).loaded("a")
    for t, rid in ((6, "x0"), (8, "x1")):
        h.at(t).finish(rid)
    assert dispatched(h) == ["x0", "x1", "x2"]
    assert not h.s.shares.enabled


def test_a_load_is_charged_to_the_principals_whose_work_waited_for_it() -> None:
    h = Harness(ONE)
    h.arrive("p0", "a", principal="p")
    h.arrive("p1", "a", principal="p")
    h.arrive("q0", "a", principal="q")
    h.at(6).loaded("a")  # took 6 s: p waited with two requests, q with one
    charged = h.s.shares.charged()
    assert charged["p"][1] == pytest.approx(4.0)
    assert charged["q"][1] == pytest.approx(2.0)


def test_service_is_charged_at_dispatch_and_corrected_at_the_end() -> None:
    h = Harness(ONE)
    h.arrive("p0", "a", principal="p")
    h.arrive("q0", "b", principal="q")
    h.at(4).loaded("a")
    assert h.s.shares.charged()["p"][0] == pytest.approx(2.0)  # the estimate, service_s
    h.at(9).finish("p0")
    assert h.s.shares.charged()["p"][0] == pytest.approx(5.0)  # what it took


def test_an_idle_principal_banks_no_credit() -> None:
    shares = Shares()
    busy = Request(1, "a", principal="busy")
    shares.arrived(busy)
    shares.arrived(Request(2, "a", principal="busy"))
    busy.dispatched_at = 0.0
    shares.dispatched(busy, 100.0)
    shares.ended(busy, 100.0, 1)  # still active (its second request), 100 s charged
    back = Request(3, "a", principal="idle")
    shares.arrived(back)
    assert shares.vtimes[False]["idle"] == pytest.approx(100.0)  # the clock, not 0


def test_weights_share_the_device_in_proportion() -> None:
    h = Harness(ONE + "server: {principals: {big: {weight: 2}, small: {weight: 1}}}\n")
    for i in range(40):
        h.arrive(f"big{i}", "a", principal="big")
        h.arrive(f"small{i}", "a", principal="small")
    h.at(4).loaded("a")
    order: list[object] = dispatched(h)
    t = 4.0
    while len(order) < 30:
        t += 2
        rid = order[-1]
        assert isinstance(rid, str)
        h.at(t).finish(rid)
        order += dispatched(h)
    big = sum(1 for rid in order[:30] if str(rid).startswith("big"))
    assert big == 20  # two to one


def test_a_principal_owed_its_share_takes_the_device_from_anothers_backlog() -> None:
    h = Harness(ONE.replace("max_wait_s: 120", "max_wait_s: null"))
    flood(h, 100)  # heavy's backlog on a, resident
    h.at(4).loaded("a")
    h.take()
    h.at(5).arrive("light0", "b", principal="light")
    t = 4.0
    loads = []
    for i in range(40):
        t += 2
        h.at(t).finish(f"heavy{i}")
        loads += [c for c in h.take() if c[0] == "load"]
        if loads:
            break
    # b comes in once heavy is ahead of light by more than the round trip (1 + 4 + 1 + 4 s)
    # and long before heavy's 100 requests ran dry; without shares, never until then.
    assert loads == [("load", "b", ("a",))]
    assert t < 4 + 2 * 20


def light_takes_the_device(h: Harness, heavy: int) -> float:
    """`heavy` requests flood model a, loaded at 4 s; a light request for b arrives at 5 s; the
    heavy ones finish every 2 s until b's load is issued. When the last one finished."""
    flood(h, heavy)
    h.at(4).loaded("a")
    h.take()
    h.at(5).arrive("light0", "b", principal="light")
    t = 4.0
    for i in range(heavy):
        t += 2
        h.at(t).finish(f"heavy{i}")
        if any(c[0] == "load" for c in h.take()):
            break
    return t


def test_the_swap_back_is_charged_to_the_principal_whose_load_evicted_the_waiting_model() -> None:
    """A light request takes the device from a flooded model: its load is the light user's,
    and so is the flooded model's way back (the heavy user's work waited across the eviction).
    A principal that alternates models pays for its round trips, not the ones it evicts."""
    h = Harness(ONE.replace("max_wait_s: 120", "max_wait_s: null"))
    t = light_takes_the_device(h, 100)
    h.at(t + 5).loaded("b")
    assert h.s.shares.charged()["light"][1] == pytest.approx(5.0)
    h.at(t + 7).finish("light0")
    h.at(t + 12).loaded("a")
    assert h.s.shares.charged()["heavy"][1] == pytest.approx(4.0)  # its first load only
    assert h.s.shares.charged()["light"][1] == pytest.approx(5.0 + 5.0)


def test_a_model_reloaded_for_work_that_came_after_its_eviction_is_that_works_load() -> None:
    """The way back is owed only to work that waited across the eviction: a model that left
    with nothing waiting is loaded again at the charge of whoever asks for it next."""
    h = Harness(ONE.replace("max_wait_s: 120", "max_wait_s: null"))
    t = light_takes_the_device(h, 3)
    assert t == 4.0 + 2 * 3  # every heavy request finished first: a left with nothing waiting
    h.at(t + 5).loaded("b")
    h.at(t + 7).finish("light0")
    h.at(t + 8).arrive("late", "a", principal="heavy")
    h.take()
    h.at(t + 12).loaded("a")
    assert h.s.shares.charged()["light"][1] == pytest.approx(5.0)
    assert h.s.shares.charged()["heavy"][1] == pytest.approx(4.0 + 4.0)


@SETTINGS
@given(scenarios(), st.integers(min_value=2, max_value=4), st.randoms(use_true_random=False))
def test_with_principals_every_rule_holds_and_each_principal_is_served_in_order(
    case: tuple[Config, Trace], n_principals: int, rng: random.Random
) -> None:
    """Random traces with their lines spread over principals: the simulator's own books find
    no broken rule, every request finishes, and inside a model, class, priority and principal
    requests start in arrival order."""
    config, trace = case
    lines = [
        dataclasses.replace(x, principal=f"p{rng.randrange(n_principals)}") for x in trace.lines
    ]
    run = simulate(config, Trace(lines, trace.source), check=True)
    assert not run.rejected
    groups: dict[tuple[str, bool, int, str | None], list[tuple[int, float]]] = defaultdict(list)
    for r in run.requests:
        assert r.dispatched_at is not None
        assert r.finished_at is not None
        groups[(r.model, r.background, r.priority, r.principal)].append((r.seq, r.dispatched_at))
    for group in groups.values():
        by_arrival = [d for _, d in sorted(group)]
        assert by_arrival == sorted(by_arrival)
