"""The eviction planner is a pure function: table-tested."""

from __future__ import annotations

import pytest

from corral.core.placement import DeviceView, Plan, ResidentView, plan_placement


def dev(
    name: str, capacity: float, target: float, *residents: ResidentView, busy: bool = False
) -> DeviceView:
    return DeviceView(name, capacity, target, tuple(residents), busy)


def res(
    name: str, size: float, in_flight: int = 0, pending: int = 0, keep: float = 0.0
) -> ResidentView:
    return ResidentView(name, size, in_flight, pending, keep)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        pytest.param([dev("g", 1, 1)], Plan("g", ()), id="empty device"),
        pytest.param([dev("g", 1, 1, res("a", 1))], Plan("g", ("a",)), id="whole-device swap"),
        pytest.param(
            [dev("g", 24, 8, res("a", 8), res("b", 8))], Plan("g", ()), id="fits beside others"
        ),
        pytest.param(
            [dev("g0", 1, 1, res("a", 1)), dev("g1", 1, 1)],
            Plan("g1", ()),
            id="free device preferred over eviction",
        ),
        pytest.param(
            [dev("g", 24, 10, res("a", 10, pending=3), res("b", 10))],
            Plan("g", ("b",)),
            id="evict the model without work",
        ),
        pytest.param(
            [dev("g", 24, 10, res("a", 10, in_flight=1), res("b", 10, pending=2))],
            Plan("g", ("a",)),
            id="queued work outweighs work in flight",
        ),
        pytest.param(
            [dev("g", 24, 10, res("a", 10, keep=5), res("b", 10, keep=1))],
            Plan("g", ("b",)),
            id="least value goes",
        ),
        pytest.param(
            [dev("g", 24, 16, res("a", 8), res("b", 8), res("c", 8, pending=1))],
            Plan("g", ("a", "b")),
            id="several victims until it fits",
        ),
        pytest.param(
            [dev("g0", 1, 1, res("a", 1, pending=4)), dev("g1", 1, 1, res("b", 1))],
            Plan("g1", ("b",)),
            id="device whose eviction hurts least",
        ),
        pytest.param([dev("g", 1, 1, busy=True)], None, id="busy device takes no swap"),
        pytest.param([dev("g", 8, 10)], None, id="too big for the device"),
    ],
)
def test_plan_placement(devices: list[DeviceView], expected: Plan | None) -> None:
    assert plan_placement(devices) == expected
