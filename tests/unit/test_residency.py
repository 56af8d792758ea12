"""Residency tiers, one rule per test: sleeping instead of stopping, waking instead
of loading, host memory, pins, soft pins and `min_resident_s`. Events in by hand, effects
recorded, no sleeps."""

from __future__ import annotations

import psutil
import pytest

from corral.config import parse_config
from corral.core import Lifecycle
from corral.core.placement import DeviceView, ResidentView, plan_placement
from corral.errors import ConfigError
from corral.gateway.servers.naps import host_memory_gb
from tests.helpers import Harness

pytestmark = pytest.mark.unit

# Each model fills the device; two of them fit asleep in host memory.
SLEEPY = """
devices: [{name: gpu0, memory_gb: 24}]
host: {memory_gb: 40}
models:
  a: {load_s: 50, memory_gb: 20, sleep: {wake_s: 2, sleep_s: 1}}
  b: {load_s: 40, memory_gb: 20, sleep: {wake_s: 1, sleep_s: 1}}
  c: {load_s: 60, memory_gb: 20, sleep: {wake_s: 3, sleep_s: 1}}
  d: {load_s: 30, memory_gb: 20}
scheduler: {max_wait_s: null, sleepers: SLEEPERS}
"""


def sleepy(sleepers: str = "predicted", policy: str = "cost") -> Harness:
    return Harness(SLEEPY.replace("SLEEPERS", sleepers), policy)


def serve(h: Harness, rid: str, t: float) -> None:
    """`rid` arrives at `t`, its model comes in if it must, and it is served at once."""
    model = rid.rstrip("0123456789")
    h.at(t).arrive(rid)
    if h.s.models[model].state is not Lifecycle.READY:
        h.loaded(model)
    h.finish(rid)


def test_an_evicted_model_with_sleep_falls_asleep_and_comes_back_by_waking() -> None:
    h = sleepy("lru")  # always sleeps: `predicted` stops models with a single arrival
    serve(h, "a1", 0)
    serve(h, "b1", 10)
    assert h.take() == [
        ("load", "a", ()),
        ("dispatch", "a1"),
        ("load", "b", (), ("a",), False),  # a sleeps; b loads cold
        ("dispatch", "b1"),
    ]
    a = h.s.models["a"]
    assert a.state is Lifecycle.SLEEPING
    assert a.device is not None
    assert not a.resident
    h.at(20).arrive("a2")
    assert h.take() == [("load", "a", (), ("b",), True)]  # b sleeps, a wakes
    assert h.s.models["a"].state is Lifecycle.WAKING
    assert h.s.decisions[-1].woke
    assert h.s.decisions[-1].asleep == ("b",)
    h.loaded("a")
    assert h.take() == [("dispatch", "a2")]


def test_a_model_without_sleep_is_stopped_as_before() -> None:
    h = sleepy()
    serve(h, "d1", 0)
    serve(h, "a1", 10)
    assert h.take()[2] == ("load", "a", ("d",))
    assert h.s.models["d"].state is Lifecycle.UNLOADED


def test_a_measured_wake_refines_the_wake_estimate_not_the_load_estimate() -> None:
    h = sleepy("lru")
    serve(h, "a1", 0)
    serve(h, "b1", 10)
    h.at(20).arrive("a2")
    h.s.on_load_finished("a", load_s=4.0)
    a = h.s.models["a"]
    assert a.est.load_s == 50
    assert 2.0 < a.est.wake_s < 4.0
    assert a.return_s == a.est.load_s  # awake: leaving and coming back is a sleep and a wake
    assert a.comeback_s == a.est.wake_s


@pytest.mark.parametrize("sleepers", ["predicted", "lru"])
def test_host_memory_is_never_overcommitted(sleepers: str) -> None:
    h = sleepy(sleepers)
    for t, rid in enumerate(["a1", "b1", "c1", "d1", "a2", "c2", "b2"]):
        serve(h, rid, 10.0 * t)
        assert h.s.sleepers.used_gb() <= 40
    assert len([s for s in h.s.sleepers.all() if not s.deep]) <= 2


def test_lru_stops_the_least_recently_used_sleeper() -> None:
    h = sleepy("lru")
    serve(h, "a1", 0)
    serve(h, "b1", 10)  # a asleep
    serve(h, "c1", 20)  # b asleep: host full (a, b)
    h.take()
    serve(h, "d1", 30)  # c must sleep: the oldest sleeper, a, stops
    assert h.take()[:1] == [("unload", "a")]
    assert {s.name for s in h.s.sleepers.all()} == {"b", "c"}


def test_predicted_sleeps_a_victim_at_level_2_when_host_memory_is_short() -> None:
    h = sleepy("predicted")
    # a comes back every 5 s for a while; b was used twice, 60 s apart.
    serve(h, "b1", 0)
    serve(h, "b2", 60)
    for i in range(3, 30):
        serve(h, f"a{i}", 60 + 5 * (i - 2))
    serve(h, "c1", 199)
    serve(h, "c2", 200)  # a sleeps beside b: host full
    h.take()
    h.at(201).arrive("d1")  # c must leave: it sleeps at level 2 (no host memory); nobody stops
    assert h.take() == [("load", "d", (), ("c",), False, ("c",))]
    c = h.s.models["c"]
    assert c.asleep
    assert c.deep
    assert {s.name for s in h.s.sleepers.all()} == {"a", "b", "c"}
    assert h.s.sleepers.used_gb() == 40
    assert c.return_s == c.est.wake2_s == 9  # 3x its level-1 wake of 3 s
    h.loaded("d")
    h.finish("d1")
    h.at(300).arrive("c3")  # it wakes from level 2; its measured wake refines wake2_est only
    assert h.take()[-1] == ("load", "c", ("d",), (), True)  # d cannot sleep: it stops
    h.s.on_load_finished("c", load_s=7.0)
    assert 7.0 < c.est.wake2_s < 9.0
    assert c.est.wake_s == 3
    assert not c.deep


def test_predicted_sleeps_a_model_not_expected_back_only_while_there_is_room() -> None:
    h = sleepy("predicted")
    serve(h, "a1", 0)  # one arrival: no gap to expect a next one by
    serve(h, "b1", 10)
    assert h.s.models["a"].asleep  # room for it: it sleeps
    serve(h, "b2", 11)
    serve(h, "c1", 20)
    serve(h, "c2", 21)  # b sleeps beside a: host full
    h.take()
    h.at(30).arrive("d1")  # c must sleep: a, not expected back, stops to make room
    assert h.take() == [("unload", "a"), ("load", "d", (), ("c",), False)]
    assert {s.name for s in h.s.sleepers.all()} == {"b", "c"}
    assert h.s.models["a"].state is Lifecycle.UNLOADED


def test_the_cost_policy_prices_a_sleeping_model_by_its_wake() -> None:
    h = sleepy()
    serve(h, "a1", 0)
    serve(h, "a2", 1)
    serve(h, "b1", 10)  # a asleep (its arrivals came 1 s apart: it is expected back)
    h.take()
    a, c = h.s.models["a"], h.s.models["c"]
    assert a.asleep
    assert a.return_s == a.est.wake_s == 2
    assert c.return_s == c.est.load_s == 60


def test_a_stopped_sleeper_can_be_unloaded_and_loaded_on_request() -> None:
    h = sleepy()
    serve(h, "a1", 0)
    serve(h, "a2", 1)
    serve(h, "b1", 10)
    h.take()
    assert h.s.on_unload_requested("a") is None
    assert h.take() == [("unload", "a")]
    assert h.s.models["a"].state is Lifecycle.UNLOADED
    assert h.s.sleepers.used_gb() == 0


# --- pins and minimum residency -----------------------------------------------------------------
PINNED = """
devices: [{name: gpu0, memory_gb: 40}]
models:
  p: {load_s: 10, memory_gb: 20, pin: true, ttl_s: 5}
  a: {load_s: 5, memory_gb: 20}
  b: {load_s: 5, memory_gb: 20}
scheduler: {max_wait_s: 60}
"""


@pytest.mark.parametrize("policy", ["fifo", "grouped", "cost"])
def test_a_pinned_model_is_never_evicted_nor_unloaded_when_idle(policy: str) -> None:
    h = Harness(PINNED, policy)
    serve(h, "p1", 0)
    for i, t in enumerate(range(10, 200, 10)):
        serve(h, f"{'ab'[i % 2]}{i}", t)
        h.timers_due()
    loads = [c for c in h.take() if c[0] in ("load", "unload")]
    assert all(c[2] == () or "p" not in c[2] for c in loads if c[0] == "load")  # type: ignore[operator]
    assert ("unload", "p") not in loads
    assert h.s.models["p"].state is Lifecycle.READY


def test_a_model_that_cannot_fit_beside_the_pins_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model 'big' cannot fit on gpu0 beside the pinned p"):
        parse_config(
            """
devices: [{name: gpu0, memory_gb: 24}]
models:
  p: {memory_gb: 10, pin: true}
  big: {memory_gb: 20}
"""
        )
    with pytest.raises(ConfigError, match=r"cannot fit on device0 beside the pinned p"):
        parse_config("models:\n  p: {pin: true}\n  q: {}\n")  # a device without memory_gb


def test_placement_never_picks_a_held_resident_and_takes_soft_pins_last() -> None:
    held = ResidentView("p", 20, 0, 0, 0.0, held=True)
    soft = ResidentView("s", 20, 0, 0, 0.0, soft_pin=True)
    idle = ResidentView("i", 20, 0, 0, 5.0)
    plan = plan_placement([DeviceView("g", 60, 20, (held, soft, idle), busy=False)])
    assert plan is not None
    assert plan.evict == ("i",)
    plan = plan_placement([DeviceView("g", 40, 20, (held, soft), busy=False)])
    assert plan is not None
    assert plan.evict == ("s",)
    assert plan_placement([DeviceView("g", 40, 30, (held,), busy=False)]) is None


def test_keep_alive_forever_is_a_soft_pin_evicted_only_when_nothing_else_makes_room() -> None:
    h = Harness(
        """
devices: [{name: gpu0, memory_gb: 40}]
models:
  k: {load_s: 5, memory_gb: 20}
  a: {load_s: 5, memory_gb: 20}
  b: {load_s: 5, memory_gb: 20}
  big: {load_s: 5, memory_gb: 40}
scheduler: {max_wait_s: null}
""",
        "fifo",
    )
    serve(h, "k1", 0)
    h.s.on_keep_alive("k", float("inf"))
    serve(h, "a1", 10)
    serve(h, "b1", 20)  # a goes, not k
    assert h.s.models["k"].resident
    assert not h.s.models["a"].resident
    serve(h, "big1", 30)  # only both make room: k goes too
    assert not h.s.models["k"].resident
    assert h.s.models["big"].resident


def test_min_resident_s_holds_an_eviction_until_it_ends() -> None:
    h = Harness(
        """
models:
  a: {load_s: 5, min_resident_s: 30}
  b: {load_s: 5}
scheduler: {max_wait_s: 10}
""",
        "cost",
    )
    serve(h, "a1", 0)  # ready at 0
    h.take()
    h.at(5).arrive("b1")
    h.at(20).timers_due()  # b1 is overdue by now, but a stays for its 30 s
    assert h.take() == []
    h.at(30).timers_due()  # the min_resident_s timer: decided again
    assert h.take() == [("load", "b", ("a",))]


def test_the_default_host_memory_for_sleepers_is_the_machines_less_a_margin() -> None:
    total_gb = psutil.virtual_memory().total / 1e9
    got = host_memory_gb()
    assert 0 <= got <= total_gb - 4.0
    assert got >= min(total_gb * 0.9, total_gb - 4.0) - 1e-6


TWO_DEVICES = """
devices: [{name: gpu0, memory_gb: 24}, {name: gpu1, memory_gb: 24}]
host: {memory_gb: 100}
models:
  a: {load_s: 50, memory_gb: 20, sleep: {wake_s: 2, sleep_s: 1}}
  c: {load_s: 5, memory_gb: 20, devices: [gpu0]}
scheduler: {max_wait_s: null}
"""


def test_a_sleeper_waits_for_its_own_device_as_long_as_a_load_elsewhere_would_cost() -> None:
    h = Harness(TWO_DEVICES)
    serve(h, "a1", 0)  # a on gpu0
    h.at(10).arrive("c1")  # c may only use gpu0: a falls asleep there
    h.loaded("c")
    a = h.s.models["a"]
    assert a.asleep
    assert a.device is not None
    assert a.device.name == "gpu0"
    h.take()
    h.at(20).arrive("a2")  # gpu0 is busy with c1; gpu1 is free, but a load there costs 50 s
    assert h.take() == []
    h.at(67).timers_due()  # waited 47 s: still cheaper to wait for its wake
    assert not [c for c in h.take() if c[0] == "load"]
    h.at(68).timers_due()  # waited the load less the wake (48 s): it loads afresh on gpu1
    assert h.take() == [("unload", "a"), ("load", "a", ())]
    assert a.device is not None
    assert a.device.name == "gpu1"
    assert h.s.decisions[-2].reason == "asleep, loads on another device"


def test_a_sleeper_whose_device_frees_in_time_wakes_there() -> None:
    h = Harness(TWO_DEVICES)
    serve(h, "a1", 0)
    h.at(10).arrive("c1")
    h.loaded("c")
    h.take()
    h.at(20).arrive("a2")
    h.at(30).finish("c1")  # gpu0 frees before the load elsewhere would pay off
    assert h.take() == [("load", "a", ("c",), (), True)]


def test_a_victim_worth_less_than_the_level_1_sleepers_sleeps_at_level_2_despite_room() -> None:
    h = Harness(
        """
devices: [{name: gpu0, memory_gb: 24}]
host: {memory_gb: 60}
models:
  a: {load_s: 50, memory_gb: 20, sleep: {wake_s: 3, sleep_s: 1}}
  b: {load_s: 50, memory_gb: 20, sleep: {wake_s: 3, sleep_s: 1}}
  rare: {load_s: 50, memory_gb: 20, sleep: {wake_s: 1, sleep_s: 1}}
  d: {load_s: 50, memory_gb: 20, sleep: {wake_s: 3, sleep_s: 1}}
scheduler: {max_wait_s: null}
"""
    )
    t = 0.0
    for _ in range(6):  # a and b come back every 20 s; rare came twice, 200 s apart
        for rid in ("a", "b"):
            serve(h, f"{rid}{int(t)}", t)
            t += 10
    serve(h, "rare1", 200)
    serve(h, "rare2", 400)
    h.take()
    serve(h, "d1", 401)  # rare leaves with room for it at level 1 (a asleep, b asleep)...
    rare = h.s.models["rare"]
    assert rare.asleep
    assert rare.deep  # ...but a and b are worth that room more: it sleeps at level 2
    assert not h.s.models["a"].deep
    assert not h.s.models["b"].deep
