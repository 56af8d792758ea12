"""`LoopWatch` sees a blocked event loop and names what blocked it: the function running on the
loop's thread at the time is in the stall it records and logs; a loop that keeps running
records none and feeds every lag to the histogram."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from corral.gateway.servers.loopwatch import STALL_S, LoopWatch

pytestmark = pytest.mark.unit


def block_the_loop_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_blocked_loop_is_logged_once_with_the_function_that_blocked_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()

    async def run() -> LoopWatch:
        watch = LoopWatch(asyncio.get_running_loop(), registry)
        watch.start()
        await asyncio.sleep(0.2)
        block_the_loop_here(STALL_S * 4)
        await asyncio.sleep(0.2)
        watch.stop()
        return watch

    with caplog.at_level(logging.WARNING, "corral.gateway"):
        watch = asyncio.run(run())
    # Once per stall however long; a busy machine may starve the loop at other moments too,
    # and those stalls name other code.
    blamed = [s for s in watch.stalls if any("block_the_loop_here" in f for f in s[1])]
    assert len(blamed) == 1
    assert blamed[0][0] >= STALL_S
    logged = [r for r in caplog.records if "block_the_loop_here" in r.getMessage()]
    assert len(logged) == 1
    counts = [
        s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == "corral_event_loop_lag_seconds_count"
    ]
    assert counts[0] >= 5  # every lag was observed, the stalled one too


def test_a_loop_that_keeps_running_blames_nothing_of_its_own() -> None:
    """Awaiting never blocks: whatever a busy machine makes the loop wait for, no stall names
    the coroutine that only awaits."""

    async def only_awaits() -> None:
        for _ in range(40):
            await asyncio.sleep(0.01)

    async def run() -> LoopWatch:
        watch = LoopWatch(asyncio.get_running_loop(), CollectorRegistry())
        watch.start()
        await only_awaits()
        watch.stop()
        return watch

    stalls = asyncio.run(run()).stalls
    assert [s for s in stalls if any("only_awaits" in f for f in s[1])] == []


def test_the_loops_task_count_is_taken() -> None:
    """`corral_event_loop_tasks` counts the tasks alive on the loop: a long run's leak shows."""
    registry = CollectorRegistry()

    def counted() -> float:
        return registry.get_sample_value("corral_event_loop_tasks") or 0.0

    async def run() -> float:
        watch = LoopWatch(asyncio.get_running_loop(), registry)
        idle = [asyncio.ensure_future(asyncio.sleep(30)) for _ in range(25)]
        watch.start()
        for _ in range(300):  # the first count is taken at the watch's first callback
            await asyncio.sleep(0.01)
            if counted() > 0:
                break
        watch.stop()
        for t in idle:
            t.cancel()
        return counted()

    assert asyncio.run(run()) >= 26  # the 25 sleepers and the main task
