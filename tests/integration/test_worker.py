"""The worker and the `corral.Queue` API on real SQLite and PostgreSQL stores."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.store import BadTask, NewTask, TaskStatus
from corral.worker.runtime import Worker, WorkerSettings

FAST = WorkerSettings(poll_s=0.02, retry_base_s=0.05, lease_s=3.0, shutdown_timeout_s=0.5)


@pytest.fixture
def url(store_url: str) -> str:
    return store_url


def two_model_queue(url: str, log: list[Any]) -> corral.Queue:
    q = corral.Queue(url)
    for name in ("cover-writer", "research-8b"):
        q.model(
            name,
            load=functools.partial(log.append, ("load", name)),
            unload=functools.partial(log.append, ("unload", name)),
        )

    @q.handler("cover_letter", model="cover-writer")
    def cover(p: dict[str, int]) -> str:
        log.append(("cover", p["job"]))
        return f"letter {p['job']}"

    @q.handler("research", model="research-8b")
    async def research(p: dict[str, int]) -> dict[str, int]:
        log.append(("research", p["job"]))
        return {"facts": p["job"]}

    return q


def test_alternating_tasks_load_each_model_once(url: str) -> None:
    log: list[Any] = []
    q = two_model_queue(url, log)
    ids = []
    for job in range(10):
        ids += [q.submit("cover_letter", {"job": job}), q.submit("research", {"job": job})]
    w = q.run_worker(until_idle=True, settings=FAST)
    assert [m for m, _ in w.loads] == ["cover-writer", "research-8b"]
    assert [e for e in log if e[0] in ("load", "unload")] == [
        ("load", "cover-writer"),
        ("unload", "cover-writer"),
        ("load", "research-8b"),
    ]
    work = [e for e in log if e[0] in ("cover", "research")]
    assert [e[1] for e in work[:10]] == list(range(10))  # FIFO within the model
    assert {e[0] for e in work[:10]} == {"cover"}
    assert q.result(ids[4], timeout=10) == "letter 2"
    assert q.result(ids[5], timeout=10) == {"facts": 2}
    assert q.store.counts() == {
        "cover-writer": {TaskStatus.SUCCEEDED: 10},
        "research-8b": {TaskStatus.SUCCEEDED: 10},
    }
    q.close()


def test_failures_retry_with_backoff_and_keep_every_error(url: str) -> None:
    q = corral.Queue(url)
    calls: dict[int, int] = {}

    @q.handler("flaky", model="m")
    def flaky(p: dict[str, int]) -> str:
        calls[p["n"]] = calls.get(p["n"], 0) + 1
        if calls[p["n"]] < p["n"]:
            raise RuntimeError(f"try {calls[p['n']]}")
        return "ok"

    ok = q.submit("flaky", {"n": 3}, max_attempts=3)
    bad = q.submit("flaky", {"n": 9}, max_attempts=2)
    q.run_worker(until_idle=True, settings=FAST)
    assert q.result(ok, timeout=10) == "ok"
    t = q.get(ok)
    assert t.attempts == 3
    assert [e["error"] for e in t.errors] == ["RuntimeError: try 1", "RuntimeError: try 2"]
    with pytest.raises(
        corral.TaskFailed, match="failed after 2 attempt\\(s\\): RuntimeError: try 2"
    ):
        q.result(bad, timeout=10)
    q.close()


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_cancelling_a_running_task_reaches_its_handler_within_a_second(url: str, kind: str) -> None:
    q = corral.Queue(url)
    started = threading.Event()
    stopped_at: list[float] = []

    @q.handler("slow_async", model="m")
    async def slow_async(p: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped_at.append(time.monotonic())
            raise

    @q.handler("slow_sync", model="m")
    def slow_sync(p: Any) -> str:
        started.set()
        while not corral.current_task().cancelled:
            time.sleep(0.01)
        stopped_at.append(time.monotonic())
        return "stopped"

    tid = q.submit(f"slow_{kind}")
    runner = threading.Thread(target=q.run_worker, kwargs={"until_idle": True, "settings": FAST})
    runner.start()
    assert started.wait(10)
    cancelled_at = time.monotonic()
    assert q.cancel(tid) is TaskStatus.RUNNING
    runner.join(15)
    assert not runner.is_alive()
    assert stopped_at
    assert stopped_at[0] - cancelled_at < 1.5
    assert q.get(tid).status is TaskStatus.CANCELLED
    with pytest.raises(corral.TaskCancelled):
        q.result(tid, timeout=10)
    q.close()


def test_serial_keys_never_overlap_and_run_in_order(url: str, tmp_path: Path) -> None:
    q = corral.Queue(url, config=corral.parse_config("models: {m: {concurrency: 4}}"))
    spans: dict[str, list[tuple[int, float, float]]] = {"a": [], "b": []}
    lock = threading.Lock()

    @q.handler("note", model="m")
    async def note(p: dict[str, Any]) -> None:
        start = time.monotonic()
        await asyncio.sleep(0.03)
        with lock:
            spans[p["group"]].append((p["i"], start, time.monotonic()))

    for i in range(5):
        for g in ("a", "b"):
            q.submit("note", {"group": g, "i": i}, serial_key=f"tag-{g}")
    q.run_worker(until_idle=True, settings=FAST)
    for g, s in spans.items():
        assert [i for i, _, _ in s] == list(range(5)), g  # FIFO within the key
        assert all(a[2] <= b[1] for a, b in itertools.pairwise(s)), g  # never overlap
    overlap = any(a[1] < b[2] and b[1] < a[2] for a in spans["a"] for b in spans["b"])
    assert overlap  # different keys do run in parallel
    q.close()


def test_bad_input_is_refused_with_what_and_where(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("known", model="m")
    def known(p: Any) -> None:
        return None

    with pytest.raises(
        corral.UnknownKind, match="no handler for task kind 'nope'; registered: known"
    ):
        q.submit("nope", {})
    with pytest.raises(BadTask, match="payload of a 'known' task is not JSON-serialisable"):
        q.submit("known", {"when": object()})
    orphan = q.store.enqueue(NewTask("ghost", "m", {}))  # stored by some other app
    q.run_worker(until_idle=True, settings=FAST)
    t = q.get(orphan)
    assert t.status is TaskStatus.FAILED
    assert t.error == "no handler for task kind 'ghost' (registered: known)"
    assert q.store.counts() == {"m": {TaskStatus.FAILED: 1}}
    q.close()


def test_payloads_json_would_change_or_too_large_are_refused_naming_the_item(url: str) -> None:
    q = corral.Queue(url, max_payload_mb=1)
    q.handler("known", model="m")(lambda p: p)
    with pytest.raises(BadTask, match=r"payload\['ids'\] of a 'known' task is a tuple"):
        q.submit("known", {"ids": (1, 2)})
    with pytest.raises(BadTask, match=r"has the key 1 \(int\); .* come back as \"1\""):
        q.submit("known", {"a": [{1: "x"}]})
    with pytest.raises(BadTask, match=r"is 2\.0 MB of JSON; the limit is 1 MB \(max_payload_mb\)"):
        q.submit("known", "x" * (2 * 1048576))
    with pytest.raises(BadTask, match=r"^payloads\[2\]: payload of a 'known' task is a tuple"):
        q.submit_many("known", [{"ok": 1}, {"ok": 2}, ("bad",), {"ok": 4}])
    assert q.store.counts() == {}  # all or none: nothing was queued
    task_id = q.submit("known", {"ids": [1, 2], "nested": {"k": None}})
    assert q.get(task_id).payload == {"ids": [1, 2], "nested": {"k": None}}
    q.close()


def test_the_default_payload_limit_is_16_mb(url: str) -> None:
    q = corral.Queue(url)
    q.handler("known", model="m")(lambda p: p)
    with pytest.raises(BadTask, match=r"the limit is 16 MB"):
        q.submit("known", "x" * (17 * 1048576))
    q.close()


def test_a_handler_model_missing_from_the_config_is_a_clear_error(url: str) -> None:
    q = corral.Queue(url, config=corral.parse_config("models: {other: {}}"))

    @q.handler("letter", model="cover-writer")
    def letter(p: Any) -> None:
        return None

    with pytest.raises(
        corral.CorralError,
        match=r"defines no model 'cover-writer', which handlers use \('letter' -> 'cover-writer'\)",
    ):
        q.worker()
    q.close()


def test_stop_releases_tasks_that_outlive_the_shutdown_timeout(url: str) -> None:
    q = corral.Queue(url)
    started = threading.Event()

    @q.handler("forever", model="m")
    async def forever(p: Any) -> None:
        started.set()
        await asyncio.sleep(60)

    tid = q.submit("forever")

    async def main() -> None:
        w = q.worker(FAST)
        run = asyncio.ensure_future(w.run())
        await asyncio.to_thread(started.wait, 10)
        w.stop()
        await asyncio.wait_for(run, 10)

    asyncio.run(main())
    t = q.get(tid)
    assert t.status is TaskStatus.QUEUED
    assert t.attempts == 0
    q.close()


def test_tasks_claimed_ahead_go_back_when_their_model_is_evicted(url: str) -> None:
    config = corral.parse_config(
        # A small service-time prior: the worker claims low tasks ahead from the first claim.
        "models: {low: {priority: 0, service_s: 0.001}, high: {priority: 1}}\n"
        "scheduler: {policy: priority}\n"
    )
    q = corral.Queue(url, config=config)
    order: list[str] = []
    workers: list[Worker] = []  # the worker, made once the handlers are known

    @q.handler("low_job", model="low")
    def low_job(p: dict[str, int]) -> int:
        if p["i"] == 0:  # while the first low task runs, urgent work for the other model arrives
            q.submit("high_job", {"i": 0})
            # Running until the worker's scheduler has it: on a busy machine the store's
            # wake-up and scan came after the 29 quick low tasks had all run.
            deadline = time.monotonic() + 30
            while (sched := workers[0].scheduler) is None or not sched.models["high"].count:
                assert time.monotonic() < deadline, "the high task never reached the scheduler"
                time.sleep(0.01)
        order.append(f"low{p['i']}")
        return p["i"]

    @q.handler("high_job", model="high")
    def high_job(p: dict[str, int]) -> int:
        order.append("high")
        return p["i"]

    ids = q.submit_many("low_job", [{"i": i} for i in range(30)])
    w = q.worker(dataclasses.replace(FAST, prefetch=16))
    workers.append(w)
    asyncio.run(w.run(until_idle=True))
    assert [m for m, _ in w.loads] == ["low", "high", "low"]
    assert order.index("high") <= 2  # it did not wait behind the 29 low tasks claimed ahead
    tasks = [q.get(i) for i in ids]
    assert all(t.status is TaskStatus.SUCCEEDED for t in tasks)
    assert all(t.attempts == 1 for t in tasks)  # going back to the queue is not an attempt
    assert sorted(t.result for t in tasks) == list(range(30))
    q.close()


def test_split_on_failure_keeps_successes_and_isolates_bad_items(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("consolidate", model="m", split_on_failure=True)
    def consolidate(notes: list[str]) -> list[str]:
        if any("corrupt" in n for n in notes):
            raise ValueError("model returned garbage")
        return [n.title() for n in notes]

    tid = q.submit("consolidate", ["alpha", "corrupt beta", "gamma", "delta"])
    doomed = q.submit("consolidate", ["corrupt", "corrupt too"], max_attempts=1)
    with pytest.raises(BadTask, match="payload must be a non-empty list; got dict"):
        q.submit("consolidate", {"not": "a list"})
    q.run_worker(until_idle=True, settings=FAST)
    assert q.result(tid, timeout=10) == {
        "results": ["Alpha", None, "Gamma", "Delta"],
        "failed": {"1": "ValueError: model returned garbage"},
    }
    with pytest.raises(corral.TaskFailed, match="all 2 items failed"):
        q.result(doomed, timeout=10)
    q.close()


def test_async_api_submits_and_awaits_results(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("double", model="m")
    async def double(p: dict[str, int]) -> int:
        return p["n"] * 2

    async def main() -> int:
        tid = await q.asubmit("double", {"n": 21})
        worker = asyncio.ensure_future(q.arun_worker(until_idle=True, settings=FAST))
        result = await q.aresult(tid, timeout=10)
        await worker
        return int(result)

    assert asyncio.run(main()) == 42
    q.close()


ANOTHER_PROCESS_SUBMIT = """
import sys, time
from corral.store import NewTask, open_store
open_store(sys.argv[1]).enqueue(NewTask("job", "m", "another process"))
print(time.time())
"""


def test_an_idle_worker_wakes_on_new_work_without_waiting_for_its_poll(url: str) -> None:
    """Polling every 30 s, the worker still starts new work at once: an in-process submit wakes
    it on every store; on PostgreSQL, so does a submit from another process (LISTEN/NOTIFY)."""
    q = corral.Queue(url)
    started: dict[str, float] = {}
    got = threading.Event()

    @q.handler("job", model="m")
    def job(p: str) -> str:
        started[p] = time.time()
        got.set()
        return p

    # No poll and no lease sweep (every lease_s / 2) within the test's time.
    slow_poll = dataclasses.replace(FAST, poll_s=30.0, idle_poll_s=30.0, lease_s=60.0)

    def in_process() -> float:
        q.submit("job", "this process")
        return time.time()

    def from_another_process() -> float:
        done = subprocess.run(
            [sys.executable, "-c", ANOTHER_PROCESS_SUBMIT, url],
            check=True,
            timeout=30,
            capture_output=True,
            text=True,
        )
        return float(done.stdout)

    submitters: dict[str, Callable[[], float]] = {"this process": in_process}
    if url.startswith("postgresql"):
        submitters["another process"] = from_another_process

    async def main() -> None:
        w = q.worker(slow_poll)
        run = asyncio.ensure_future(w.run())
        await asyncio.sleep(0.5)  # past the first scan: the worker is idle, waiting
        for name, submit in submitters.items():
            got.clear()
            submitted = await asyncio.to_thread(submit)
            assert await asyncio.to_thread(got.wait, 5), f"no start after a submit from {name}"
            # A poll would take 30 s; the wake itself takes milliseconds (bench_wakeups.py), but
            # a loaded CI machine can add a second of thread hand-offs.
            assert started[name] - submitted < 3.0
        w.stop()
        await asyncio.wait_for(run, 10)

    asyncio.run(main())
    q.close()


def test_ttl_unloads_an_idle_in_process_model_through_its_hook(url: str) -> None:
    log: list[Any] = []
    config = corral.Config.model_validate({"models": {"m": {"load_s": 0, "ttl_s": 0.3}}})
    q = corral.Queue(url, config=config)
    q.model(
        "m",
        load=functools.partial(log.append, "load"),
        unload=functools.partial(log.append, "unload"),
    )

    @q.handler("echo", model="m")
    def echo(p: Any) -> Any:
        log.append("run")
        return p

    async def main() -> None:
        w = q.worker(FAST)
        run = asyncio.ensure_future(w.run())
        tid = q.submit("echo", 1)
        assert await asyncio.to_thread(q.result, tid, 10) == 1
        for _ in range(200):  # the model idles from here; its ttl is 0.3 s
            if "unload" in log:
                break
            await asyncio.sleep(0.02)
        assert log == ["load", "run", "unload"]
        tid = q.submit("echo", 2)  # the next task loads it again
        assert await asyncio.to_thread(q.result, tid, 10) == 2
        w.stop()
        await asyncio.wait_for(run, 10)

    asyncio.run(main())
    assert log[:5] == ["load", "run", "unload", "load", "run"]
    q.close()


def test_fail_ends_a_task_without_its_retries(url: str) -> None:
    q = corral.Queue(url)
    calls: list[int] = []

    @q.handler("strict", model="m")
    def strict(p: Any) -> None:
        calls.append(1)
        raise corral.Fail('{"status_code": 400}')

    tid = q.submit("strict", None, max_attempts=3)
    q.run_worker(until_idle=True, settings=FAST)
    t = q.get(tid)
    assert (t.status, t.attempts, len(calls)) == (TaskStatus.FAILED, 1, 1)
    assert t.error == '{"status_code": 400}'  # the message as given, for callers to parse
    q.close()


def short_tasks_queue(url: str) -> tuple[corral.Queue, list[str]]:
    """Two models "a" and "b" (no load time, four slots each) whose kinds "ta" and "tb" take
    about a millisecond; the list of loads, in order."""
    config = corral.Config.model_validate(
        {"models": {m: {"load_s": 0, "concurrency": 4} for m in ("a", "b")}}
    )
    q = corral.Queue(url, config=config)
    loads: list[str] = []
    for m in ("a", "b"):
        q.model(m, load=functools.partial(loads.append, m))

    @q.handler("ta", model="a")
    async def ta(p: Any) -> None:
        await asyncio.sleep(0.001)

    @q.handler("tb", model="b")
    async def tb(p: Any) -> None:
        await asyncio.sleep(0.001)

    return q, loads


def test_prefetch_under_concurrency_keeps_each_model_to_one_load(url: str) -> None:
    # Concurrent claims of one model race: one takes the last tasks into its buffer while the
    # other finds the queue empty. Its proxy must take them from the buffer rather than end
    # empty, or the model looks idle with work left and is swapped out and back.
    q, loads = short_tasks_queue(url)
    for i in range(150):
        q.submit("ta", i)
        q.submit("tb", i)
    q.run_worker(until_idle=True, settings=FAST)
    assert loads in (["a", "b"], ["b", "a"])
    assert q.store.counts() == {"a": {TaskStatus.SUCCEEDED: 150}, "b": {TaskStatus.SUCCEEDED: 150}}
    q.close()


def test_a_claim_that_returns_late_with_the_last_tasks_keeps_its_model_loaded(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A busy machine (stop 34's CI): the claim that took a model's last queued tasks, some to
    # run and the rest ahead into the buffer, came back a second and a half late. The model's
    # other slots ended meanwhile; the one slot of the late claim then ended before a reconcile
    # had mirrored the buffered tasks, the model looked idle with work in the worker's hands,
    # and it was swapped out, its buffer given back, and loaded again: ['a', 'b', 'a'].
    q, loads = short_tasks_queue(url)
    for i in range(150):
        q.submit("ta", i)
        q.submit("tb", i)
    store = q.store
    claim = store.claim
    stalled: list[int] = []

    def late_claim(model: str, *args: Any, **kwargs: Any) -> Any:
        got = claim(model, *args, **kwargs)
        last = got and not stalled and model == loads[0]
        if last and not store.counts()[model].get(TaskStatus.QUEUED):  # it took the last ones
            stalled.append(len(got))
            time.sleep(1.5)
        return got

    monkeypatch.setattr(store, "claim", late_claim)
    q.run_worker(until_idle=True, settings=FAST)
    assert stalled  # the late claim happened
    assert loads in (["a", "b"], ["b", "a"])
    assert q.store.counts() == {"a": {TaskStatus.SUCCEEDED: 150}, "b": {TaskStatus.SUCCEEDED: 150}}
    q.close()


def test_a_model_whose_tasks_came_back_while_its_last_claim_ran_stays_loaded(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tasks of a model can come back to the queue while a claim is under way and the worker's
    # mirror of the store is held still (a give-back, a lapsed lease reclaimed, another worker
    # releasing them). Here another worker holds five tasks of "a" and releases them while this
    # worker's claim of the last queued ones stalls. The model's last slot ended before the
    # next reconcile, so the model looked idle with five tasks queued and was swapped out and
    # back (a 3.5 s stall beside a 3 s lease did so, by hand).
    q, loads = short_tasks_queue(url)
    for i in range(40):
        q.submit("ta", i)
    for i in range(40):
        q.submit("tb", i)
    store = q.store
    held = store.claim("a", "another-worker", 5, 60.0, start=0)
    assert len(held) == 5
    claim = store.claim
    released: list[int] = []
    once = threading.Lock()

    def stalled_claim(model: str, *args: Any, **kwargs: Any) -> Any:
        got = claim(model, *args, **kwargs)
        emptied = model == "a" and not store.counts()["a"].get(TaskStatus.QUEUED)
        if emptied and once.acquire(blocking=False):  # it took the last queued ones
            released.append(sum(store.release(t.id, t.lease_token or "") for t in held))
            time.sleep(0.5)  # the other slots of "a" end meanwhile
        return got

    monkeypatch.setattr(store, "claim", stalled_claim)
    q.run_worker(until_idle=True, settings=FAST)
    assert released == [5]
    assert loads == ["a", "b"]
    assert q.store.counts() == {"a": {TaskStatus.SUCCEEDED: 40}, "b": {TaskStatus.SUCCEEDED: 40}}
    q.close()


def test_interactive_tasks_run_before_batch_tasks_of_any_model(url: str) -> None:
    log: list[Any] = []
    q = two_model_queue(url, log)
    batch = [q.submit("cover_letter", {"job": job}) for job in range(6)]
    urgent = q.submit("research", {"job": 99}, interactive=True)
    more = q.submit_many("research", [{"job": j} for j in range(100, 103)], interactive=True)
    assert q.get(urgent).interactive
    assert not q.get(batch[0]).interactive
    w = q.run_worker(until_idle=True, settings=FAST)
    # The interactive research tasks first, though the batch's model was asked for first.
    assert [m for m, _ in w.loads] == ["research-8b", "cover-writer"]
    work = [e for e in log if e[0] in ("cover", "research")]
    assert [e[1] for e in work[:4]] == [99, 100, 101, 102]
    assert [e[0] for e in work[4:]] == ["cover"] * 6
    assert all(q.result(t, timeout=10) for t in [*batch, urgent, *more])
    q.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_every_task_knows_its_attempt_claimed_ahead_or_not(url: str, kind: str) -> None:
    # Short tasks are claimed ahead and started later, by a commit or a claim; the handler,
    # the backoff and `last_attempt` must see the attempt the start counted.
    config = corral.Config.model_validate({"models": {"m": {"load_s": 0, "concurrency": 2}}})
    q = corral.Queue(url, config=config)
    seen: dict[int, list[tuple[int, bool]]] = {}
    q.model("m")

    def record(p: int) -> None:
        ctx = corral.current_task()
        seen.setdefault(p, []).append((ctx.attempt, ctx.last_attempt))
        if p % 10 == 0 and ctx.attempt == 1:
            raise RuntimeError("first try fails")

    if kind == "sync":
        q.handler("t", model="m")(record)
    else:

        @q.handler("t", model="m")
        async def t(p: int) -> None:
            record(p)

    q.submit_many("t", list(range(200)), max_attempts=2)
    q.run_worker(until_idle=True, settings=dataclasses.replace(FAST, retry_base_s=0.01))
    assert len(seen) == 200
    for p, tries in seen.items():  # before: 0 for most tasks claimed ahead
        expected = [(1, False), (2, True)] if p % 10 == 0 else [(1, False)]
        assert tries == expected, (p, tries)
    assert q.store.counts() == {"m": {TaskStatus.SUCCEEDED: 200}}
    q.close()


def test_an_async_handler_that_blocks_the_loop_keeps_its_lease_and_is_named(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    q = corral.Queue(url)
    q.model("m")
    runs: list[int] = []

    @q.handler("blocks_the_loop", model="m")
    async def blocks(p: int) -> int:
        runs.append(p)
        time.sleep(3)  # the mistake under test: it blocks the worker's loop
        return p

    task_id = q.submit("blocks_the_loop", 7)
    with caplog.at_level("WARNING", logger="corral.worker"):
        q.run_worker(until_idle=True, settings=dataclasses.replace(FAST, lease_s=1.0))
    # before: heartbeats ran on the blocked loop, the lease lapsed, the task ran three times
    # and ended failed, every result dropped ("lease lost before commit")
    assert runs == [7]
    t = q.get(task_id)
    assert (t.status, t.result, t.attempts) == (TaskStatus.SUCCEEDED, 7, 1)
    assert "'blocks_the_loop'" in caplog.text
    assert "event loop has not run" in caplog.text
    assert "lease lost" not in caplog.text
    q.close()


def sleeps(p: dict[str, Any]) -> str:
    """A sync handler that ignores cancellation (module level: `timeout_s` runs it in a child
    process); it leaves a mark if it ever gets past its sleep."""
    Path(p["dir"], f"started-{corral.current_task().attempt}").touch()
    time.sleep(p["sleep_s"])
    Path(p["dir"], "finished").touch()
    return "woke"


def test_timeout_s_stops_a_sync_handler_and_an_async_one(url: str, tmp_path: Path) -> None:
    q = corral.Queue(url)
    q.model("m")
    # Its timeout counts from when the handler begins: its child process imports this module
    # first, which took longer than 2 s on a loaded 2-core machine (the handler never began).
    q.handler("sync_sleeps", model="m", timeout_s=2)(sleeps)

    @q.handler("async_sleeps", model="m", timeout_s=2)
    async def async_sleeps(p: dict[str, Any]) -> str:
        await asyncio.sleep(p["sleep_s"])
        return "woke"

    payload = {"dir": str(tmp_path), "sleep_s": 30}
    ids = [q.submit(k, payload, max_attempts=2) for k in ("sync_sleeps", "async_sleeps")]
    began = time.monotonic()
    q.run_worker(until_idle=True, settings=FAST)
    assert time.monotonic() - began < 25  # before: 30 s a try, nothing stopped them
    for task_id in ids:
        t = q.get(task_id)
        assert (t.status, t.attempts) == (TaskStatus.FAILED, 2)
        assert [e["error"] for e in t.errors] == [
            "HandlerTimeout: the handler ran past its timeout_s of 2 s"
        ] * 2
    assert (tmp_path / "started-2").exists()  # the sync one ran (twice) in its process ...
    assert not (tmp_path / "finished").exists()  # ... and was killed mid-sleep
    q.close()


def test_cancel_stops_a_sync_handler_that_never_checks_when_it_has_timeout_s(
    url: str, tmp_path: Path
) -> None:
    q = corral.Queue(url)
    q.model("m")
    q.handler("sync_sleeps", model="m", timeout_s=600)(sleeps)
    tid = q.submit("sync_sleeps", {"dir": str(tmp_path), "sleep_s": 20})
    runner = threading.Thread(target=q.run_worker, kwargs={"until_idle": True, "settings": FAST})
    runner.start()
    deadline = time.monotonic() + 20
    while not (tmp_path / "started-1").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancelled_at = time.monotonic()
    assert q.cancel(tid) is TaskStatus.RUNNING
    with pytest.raises(corral.TaskCancelled):
        q.result(tid, timeout=10)
    assert time.monotonic() - cancelled_at < 2.5  # before: it ran its full 20 s
    runner.join(10)
    assert not runner.is_alive()
    assert not (tmp_path / "finished").exists()
    q.close()


def test_timeout_s_on_a_sync_handler_it_cannot_stop_is_refused_at_once(url: str) -> None:
    q = corral.Queue(url)

    def local(p: Any) -> None:
        pass

    with pytest.raises(ValueError, match=r"defined at module level; .*local is not"):
        q.handler("local", model="m", timeout_s=1)(local)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        q.handler("zero", model="m", timeout_s=0)(sleeps)
    q.close()


def test_a_drain_of_short_tasks_reports_no_lease_lost(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Heartbeats run in their own thread: one in flight while a task commits finds the lease
    # ended by the commit, which is not a lost lease (before: a false warning every few rounds).
    # Leases of 2 s (a heartbeat every 0.67 s, so several land in the drain): with 0.3 s, a
    # loaded CI machine that left the heartbeat thread unscheduled for 1.2 s lost leases for
    # real, and the test could not tell those from false warnings.
    q = corral.Queue(url)
    q.handler("noop", model="m")(lambda p: None)
    q.submit_many("noop", list(range(3000)))
    with caplog.at_level("WARNING", logger="corral.worker"):
        q.run_worker(until_idle=True, settings=dataclasses.replace(FAST, lease_s=2.0))
    assert q.store.counts() == {"m": {TaskStatus.SUCCEEDED: 3000}}
    assert "lease lost" not in caplog.text
    q.close()


def test_short_tasks_run_in_group_runs_each_committed_exactly_once(url: str) -> None:
    """Plain sync handlers run in runs committed together (group commit): every task still
    gets its own status, result, attempt and error, and a run's failure fails only its task."""
    q = corral.Queue(url)
    seen: list[int] = []

    @q.handler("sq", model="m")
    def sq(p: dict[str, int]) -> int:
        seen.append(p["i"])
        if p["i"] % 50 == 7:
            raise corral.Fail(f"bad {p['i']}")
        if p["i"] % 50 == 8:
            return {1, 2}  # type: ignore[return-value]  # not JSON: fails, names why
        return p["i"] ** 2

    commits: list[int] = []
    finish_many = q.store.finish_many

    def spy(done: Any, then_start: Any = ()) -> list[str]:
        commits.append(len(done))
        return finish_many(done, then_start)

    q.store.finish_many = spy  # type: ignore[method-assign]
    n = 600
    ids = q.submit_many("sq", [{"i": i} for i in range(n)])
    q.run_worker(until_idle=True, settings=FAST)
    assert sorted(seen) == list(range(n))  # each ran once
    assert max(commits) > 10  # commits grouped many tasks (the first run measures one)
    assert sum(commits) < n
    tasks = [q.get(t) for t in ids]
    for i, t in enumerate(tasks):
        if i % 50 == 7:
            assert (t.status, t.error) == (TaskStatus.FAILED, f"bad {i}")
        elif i % 50 == 8:
            assert t.status is TaskStatus.FAILED
            assert "not JSON-serialisable" in (t.error or "")
        else:
            assert (t.status, t.result, t.attempts) == (TaskStatus.SUCCEEDED, i * i, 1)
    q.close()


def test_keep_result_false_stores_no_result_and_retention_purges_old_tasks(url: str) -> None:
    q = corral.Queue(url)

    @q.handler("fire", model="m", keep_result=False)
    def fire(p: int) -> dict[str, str]:
        return {"big": "x" * 1000}

    @q.handler("fire_async", model="n", keep_result=False)  # the path of single commits
    async def fire_async(p: int) -> dict[str, str]:
        return {"big": "x" * 1000}

    @q.handler("keep", model="n")
    async def keep(p: int) -> int:
        return p

    fired = q.submit_many("fire", list(range(40))) + q.submit_many("fire_async", [1, 2])
    kept = q.submit("keep", 5)
    q.run_worker(until_idle=True, settings=FAST)
    assert {(q.get(t).status, q.get(t).result) for t in fired} == {(TaskStatus.SUCCEEDED, None)}
    assert q.result(kept, timeout=5) == 5
    # A worker with a retention period deletes what finished before it (2 s: longer than
    # this run lasts, so what it runs itself stays, however slow the machine).
    time.sleep(2.1)
    later = q.submit("keep", 6)
    settings = dataclasses.replace(FAST, retention_s=2.0)
    q.run_worker(until_idle=True, settings=settings)
    assert [t.id for t in q.store.list(limit=100)] == [later]
    q.close()


def test_a_load_whose_only_task_is_cancelled_is_aborted_and_never_reported(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The task a model was loading for is cancelled mid-load. The load (a thread
    that cannot be interrupted) ends unreported, the model unloads through its hook, and the
    next task loads it again; nothing in the worker breaks."""
    log: list[Any] = []
    loading = threading.Event()
    release = threading.Event()
    config = corral.Config.model_validate({"models": {"m": {"load_s": 30}}})
    q = corral.Queue(url, config=config)

    def slow_load() -> None:
        log.append("load")
        loading.set()
        release.wait(10)

    q.model("m", load=slow_load, unload=functools.partial(log.append, "unload"))

    @q.handler("echo", model="m")
    def echo(p: Any) -> Any:
        log.append(("run", p))
        return p

    async def main() -> None:
        w = q.worker(FAST)
        run = asyncio.ensure_future(w.run())
        first = q.submit("echo", 1)
        assert await asyncio.to_thread(loading.wait, 10)
        q.cancel(first)
        for _ in range(500):  # the worker's mirror sees the task gone: the load is aborted
            if any(d.reason.startswith("load aborted") for d in w._sched().decisions):
                break
            await asyncio.sleep(0.02)
        release.set()
        reasons = [d.reason for d in w._sched().decisions]
        assert "load aborted: its waiting requests left" in reasons
        loading.clear()
        second = q.submit("echo", 2)
        assert await asyncio.to_thread(q.result, second, 20) == 2
        w.stop()
        await asyncio.wait_for(run, 10)

    asyncio.run(main())
    assert log == ["load", "unload", "load", ("run", 2)]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    q.close()


def test_a_handlers_timeout_counts_from_when_it_begins_not_from_its_process_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync handler with `timeout_s` runs in a process that imports its module first: on a
    busy machine (or a module that is slow to import) that took longer than the timeout, and
    the handler was stopped before it began. The start has a bound of its own."""
    from corral.worker import isolate
    from corral.worker.registry import TaskContext

    (tmp_path / "slow_to_import.py").write_text(
        "import time\ntime.sleep(2.5)\n\ndef double(p):\n    time.sleep(0.3)\n    return p * 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_to_import  # type: ignore[import-not-found]

    ctx = TaskContext("t", 1)
    assert isolate.run(slow_to_import.double, 21, ctx, timeout_s=1.0) == 42
    monkeypatch.setattr(isolate, "START_LIMIT_S", 1.0)
    with pytest.raises(isolate.HandlerDied, match="did not start it in 1 s"):
        isolate.run(slow_to_import.double, 21, ctx, timeout_s=1.0)
