"""The eviction planner is a pure function: table-tested."""

from __future__ import annotations

import dataclasses

import pytest

from corral.core.placement import DeviceView, Plan, ResidentView, overflow, plan_placement


def dev(
    name: str, capacity: float, target: float, *residents: ResidentView, busy: bool = False
) -> DeviceView:
    return DeviceView(name, capacity, target, tuple(residents), busy)


def res(
    name: str,
    size: float,
    in_flight: int = 0,
    pending: int = 0,
    keep: float = 0.0,
    lingering: bool = False,
) -> ResidentView:
    return ResidentView(name, size, in_flight, pending, keep, lingering)


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
        pytest.param(
            [dev("g0", 1, 1, res("a", 1, lingering=True)), dev("g1", 1, 1, res("b", 1))],
            Plan("g1", ("b",)),
            id="an idle model that does not linger goes before one that does",
        ),
        pytest.param(
            [dev("g", 24, 10, res("a", 10, lingering=True), res("b", 10, keep=7))],
            Plan("g", ("b",)),
            id="lingering outweighs value among idle models",
        ),
        pytest.param(
            [dev("g0", 1, 1, res("a", 1, lingering=True)), dev("g1", 1, 1, res("b", 1, 1))],
            Plan("g0", ("a",)),
            id="a lingering model goes before one with work in flight",
        ),
        pytest.param([dev("g", 1, 1, busy=True)], None, id="busy device takes no swap"),
        pytest.param([dev("g", 8, 10)], None, id="too big for the device"),
    ],
)
def test_plan_placement(devices: list[DeviceView], expected: Plan | None) -> None:
    assert plan_placement(devices) == expected


def test_the_kv_cache_estimate_counts_layers_heads_and_context() -> None:
    from pathlib import Path

    from corral.modelfiles.gguf import GgufModel, estimate_memory

    m = GgufModel(Path("x.gguf"), "llama", "x", 8_000_000_000, "Q4_K_M", 131072, 32, 4096,
                  14336, 32, 8, 128, 128, 128256, None, None, 4_900_000_000)  # fmt: skip
    e = estimate_memory(m, 8192)
    assert e.kv_bytes == 32 * 8192 * 8 * (128 + 128) * 2  # 1 GiB, as llama.cpp prints it
    assert e.weights_bytes == 4_900_000_000
    swa = GgufModel(Path("g.gguf"), "gemma3", "g", 1, "Q8_0", 32768, 18, 640, 2048, 4, 1, 256,
                    256, 262144, 512, None, 1)  # fmt: skip
    # 3 of 18 layers are full: they hold the whole context; 15 hold 4 windows and a batch.
    assert estimate_memory(swa, 32768).kv_bytes == 1024 * (3 * 32768 + 15 * 2560)


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        pytest.param(dev("g", 24, 0, res("m", 12), res("a", 10)), (), id="still fits"),
        pytest.param(dev("g", 24, 0, res("m", 16), res("a", 10)), ("a",), id="idle one goes"),
        pytest.param(
            dev("g", 24, 0, res("m", 16), res("a", 10, in_flight=1), res("b", 4)),
            ("b", "a"),
            id="idle first, then busy, until it fits",
        ),
        pytest.param(
            dev("g", 24, 0, res("m", 16), res("a", 6, pending=2), res("b", 6)),
            ("b",),
            id="the fewest that make room",
        ),
        pytest.param(
            dev("g", 24, 0, res("m", 22), dataclasses.replace(res("p", 4), held=True)),
            None,
            id="a held one never goes",
        ),
        pytest.param(dev("g", 24, 0, res("m", 30)), None, id="too big alone"),
    ],
)
def test_overflow_sends_away_what_a_measured_figure_no_longer_leaves_room_for(
    device: DeviceView, expected: tuple[str, ...] | None
) -> None:
    assert overflow(device, "m") == expected
