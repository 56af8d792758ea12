"""Batched handlers (`batch_size`, `batch_wait_ms`) and bounded kinds (`max_queued`), on real
SQLite and PostgreSQL stores."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest

import corral
from corral.store import TaskStatus
from corral.worker.batching import calls, outcomes
from corral.worker.runtime import WorkerSettings

FAST = WorkerSettings(poll_s=0.02, retry_base_s=0.05, lease_s=3.0, shutdown_timeout_s=0.5)


@pytest.fixture
def url(store_url: str) -> str:
    return store_url


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batched_handler_gets_lists_and_each_task_its_own_result(url: str, kind: str) -> None:
    q = corral.Queue(url)
    sizes: list[int] = []

    def double(items: list[dict[str, int]]) -> list[int]:
        sizes.append(len(items))
        return [2 * p["i"] for p in items]

    if kind == "sync":
        q.handler("double", model="m", batch_size=16)(double)
    else:

        async def adouble(items: list[dict[str, int]]) -> list[int]:
            await asyncio.sleep(0)
            return double(items)

        q.handler("double", model="m", batch_size=16)(adouble)

    ids = q.submit_many("double", [{"i": i} for i in range(100)])
    q.run_worker(until_idle=True, settings=FAST)
    assert [q.result(t, timeout=5) for t in ids] == [2 * i for i in range(100)]
    assert sum(sizes) == 100
    assert max(sizes) == 16
    assert len(sizes) <= 8  # 7 batches would do; never one call per task
    assert all(q.get(t).attempts == 1 for t in ids)
    q.close()


def test_an_item_fails_alone_and_retries_alone(url: str) -> None:
    q = corral.Queue(url)
    seen: dict[int, int] = {}

    @q.handler("flaky", model="m", batch_size=8)
    def flaky(items: list[int]) -> list[Any]:
        out: list[Any] = []
        for i in items:
            seen[i] = seen.get(i, 0) + 1
            if i == 7:
                out.append(corral.Fail("item 7 is bad input"))  # no retry
            elif i % 5 == 0 and seen[i] == 1:
                out.append(ValueError(f"item {i} hiccuped"))  # retried alone
            else:
                out.append(i * 10)
        return out

    ids = q.submit_many("flaky", list(range(20)), max_attempts=3)
    q.run_worker(until_idle=True, settings=FAST)
    for i, tid in enumerate(ids):
        t = q.get(tid)
        if i == 7:
            assert (t.status, t.attempts, t.error) == (TaskStatus.FAILED, 1, "item 7 is bad input")
        elif i % 5 == 0:
            assert (t.status, t.attempts, t.result) == (TaskStatus.SUCCEEDED, 2, i * 10)
            assert "ValueError: item" in str(q.store.get(tid).errors)
        else:
            assert (t.status, t.attempts, t.result) == (TaskStatus.SUCCEEDED, 1, i * 10)
    assert seen[1] == 1
    assert seen[5] == 2
    q.close()


def test_a_call_that_raises_or_answers_the_wrong_shape_fails_each_task_clearly(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("boom", model="m", batch_size=4)
    def boom(items: list[int]) -> list[int]:
        raise RuntimeError("the GPU fell over")

    @q.handler("short", model="n", batch_size=4)
    def short(items: list[int]) -> list[int]:
        return items[:-1]

    boom_ids = q.submit_many("boom", [1, 2, 3], max_attempts=2)
    short_ids = q.submit_many("short", [1, 2, 3], max_attempts=2)
    q.run_worker(until_idle=True, settings=FAST)
    for tid in boom_ids:
        t = q.get(tid)
        assert (t.status, t.attempts) == (TaskStatus.FAILED, 2)  # each retried on its own count
        assert t.error == "RuntimeError: the GPU fell over"
    for tid in short_ids:
        t = q.get(tid)
        assert (t.status, t.attempts) == (TaskStatus.FAILED, 1)  # a retry cannot help
        assert "must return a list of 3 results" in str(t.error)
        assert "returned a list of 2" in str(t.error)
    q.close()


def test_a_batch_waits_up_to_batch_wait_ms_for_more_tasks(url: str) -> None:
    q = corral.Queue(url)
    sizes: list[int] = []

    # A 6 s window: a full batch runs at once, seconds before the window ends, so a busy
    # machine that slows the submissions down cannot blur the two (1.5 s left 0.1 s).
    @q.handler("embed", model="m", batch_size=8, batch_wait_ms=6000)
    def embed(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    w = q.worker(FAST)
    runner = threading.Thread(target=lambda: asyncio.run(w.run()))
    runner.start()
    try:
        time.sleep(0.3)  # the worker is idle, waiting
        first = time.monotonic()
        ids = [q.submit("embed", i) for i in range(8)]  # arriving one by one
        assert [q.result(t, timeout=10) for t in ids] == list(range(8))
        full_s = time.monotonic() - first
        assert sizes == [8]  # collected into one call, which ran once it was full ...
        assert full_s < 5.0  # ... not at the end of the wait
        lone = q.submit("embed", 99)
        started = time.monotonic()
        assert q.result(lone, timeout=30) == 99
        assert time.monotonic() - started >= 5.9  # alone: it waited the whole window
        assert sizes == [8, 1]
    finally:
        w.stop()
        runner.join(10)
    q.close()


def test_a_batch_window_longer_than_the_lease_keeps_its_tasks_leases(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The first task of a batch is started when the window opens; a window three leases long
    # once let its lease lapse, the worker claim it again into the same batch ([99, 99]), and
    # drop both results as "lease lost". Its lease is renewed while the batch fills.
    q = corral.Queue(url)
    ran: list[list[int]] = []

    @q.handler("embed", model="m", batch_size=8, batch_wait_ms=3000)
    def embed(items: list[int]) -> list[int]:
        ran.append(list(items))
        return items

    w = q.worker(dataclasses.replace(FAST, lease_s=1.0))
    runner = threading.Thread(target=lambda: asyncio.run(w.run()))
    runner.start()
    try:
        lone = q.submit("embed", 99)
        assert q.result(lone, timeout=30) == 99
    finally:
        w.stop()
        runner.join(10)
    assert ran == [[99]]  # once, alone, after the whole window
    task = q.get(lone)
    assert (task.status, task.attempts) == (TaskStatus.SUCCEEDED, 1)
    assert "lease lost" not in caplog.text
    q.close()


def test_the_scheduler_learns_what_a_batch_costs(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("slow", model="m", batch_size=10)
    def slow(items: list[int]) -> list[int]:
        time.sleep(0.1)  # per call, whatever its size
        return items

    q.submit_many("slow", list(range(60)))
    w = q.run_worker(until_idle=True, settings=FAST)
    assert w.scheduler is not None
    # One proxy per batch: the estimate is a batch's 0.1 s, not a tenth of it per task.
    assert 0.07 <= w.scheduler.models["m"].est.service_s <= 0.5
    q.close()


def test_batched_and_plain_kinds_share_a_model(url: str) -> None:
    q = corral.Queue(url)
    sizes: list[int] = []

    @q.handler("many", model="m", batch_size=5)
    def many(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return [-i for i in items]

    @q.handler("one", model="m")
    def one(p: int) -> int:
        return p + 1000

    ids = []
    for i in range(12):
        ids += [q.submit("many", i), q.submit("one", i)]
    q.run_worker(until_idle=True, settings=FAST)
    assert [q.result(t, timeout=5) for t in ids] == [x for i in range(12) for x in (-i, i + 1000)]
    assert sum(sizes) == 12
    assert max(sizes) <= 5
    q.close()


def test_cancelling_one_task_of_a_running_batch_drops_only_its_result(url: str) -> None:
    q = corral.Queue(url)
    running = threading.Event()

    @q.handler("long", model="m", batch_size=4)
    def long(items: list[int]) -> list[int]:
        running.set()
        time.sleep(2.5)  # a heartbeat (every second) hears of the cancellation meanwhile
        return items

    ids = q.submit_many("long", [0, 1, 2, 3])
    w = q.worker(FAST)
    runner = threading.Thread(target=lambda: asyncio.run(w.run(until_idle=True)))
    runner.start()
    assert running.wait(10)
    q.cancel(ids[1])
    runner.join(20)
    statuses = [q.get(t).status for t in ids]
    assert statuses == [
        TaskStatus.SUCCEEDED,
        TaskStatus.CANCELLED,
        TaskStatus.SUCCEEDED,
        TaskStatus.SUCCEEDED,
    ]
    assert q.get(ids[2]).result == 2
    q.close()


def test_max_queued_refuses_submits_past_the_bound_and_stores_nothing(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("bounded", model="m", max_queued=3)
    def bounded(p: int) -> int:
        return p

    q.submit_many("bounded", [1, 2])
    with pytest.raises(corral.QueueFull, match=r"'bounded' is full: 2 queued, max_queued is 3"):
        q.submit_many("bounded", [3, 4])
    q.submit("bounded", 3)
    with pytest.raises(corral.QueueFull, match="raise max_queued"):
        q.submit("bounded", 4)
    assert len(q.store.list()) == 3
    q.run_worker(until_idle=True, settings=FAST)
    q.submit("bounded", 5)  # drained: room again
    q.close()


def test_bad_batch_settings_are_refused_when_registered() -> None:
    q = corral.Queue("sqlite:///:memory:")

    def h(items: list[int]) -> list[int]:
        return items

    for kw, message in [
        ({"batch_size": 0}, "batch_size must be an integer >= 1; got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer >= 1"),
        ({"batch_size": 4, "batch_wait_ms": -1}, "batch_wait_ms must be between 0 and 60000"),
        ({"batch_size": 4, "split_on_failure": True}, "do not combine"),
        ({"max_queued": 0}, "max_queued must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            q.handler("k", model="m", **kw)(h)  # type: ignore[arg-type]


# --- batch assembly (pure) ----------------------------------------------------------------------
def test_calls_group_each_kind_into_batches_in_claim_order() -> None:
    from corral.store import Task
    from corral.worker.registry import Registry

    reg = Registry()
    reg.add_handler("a", "m", lambda items: items, batch_size=2)
    reg.add_handler("b", "m", lambda p: p)

    def task(i: int, kind: str) -> Task:
        return Task(str(i), i, kind, "m", i, 0, None, TaskStatus.RUNNING, 1, 3, 0.0, 0.0)

    tasks = [task(0, "a"), task(1, "b"), task(2, "a"), task(3, "a"), task(4, "b")]
    got = [[t.id for t in call] for call in calls(tasks, reg.handlers)]
    assert got == [["0", "2"], ["3"], ["1"], ["4"]]


def test_outcomes_take_exceptions_per_item_and_refuse_other_shapes() -> None:
    err = ValueError("x")
    assert outcomes([1, err, 3], 3, "k") == [(1, None), (None, err), (3, None)]
    assert outcomes((1, 2), 2, "k") == [(1, None), (2, None)]
    for bad, said in [([1], "a list of 1"), ({"a": 1}, "dict"), (None, "NoneType")]:
        out = outcomes(bad, 2, "k")
        assert len(out) == 2
        assert all(isinstance(e, corral.Fail) for _, e in out)
        assert f"it returned {said}" in str(out[0][1])
