"""One suite, every store: memory, SQLite and PostgreSQL (127.0.0.1:5432, database `test`, or
the throwaway cluster of tests/pgserver.py).

Each PostgreSQL test gets a schema of its own, dropped afterwards, so parallel runs never meet.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from corral.store import (
    BadTask,
    Batch,
    BatchNotFound,
    FileNotFound,
    Finished,
    Lease,
    MemoryStore,
    NewTask,
    QueueFull,
    SchemaTooNew,
    Store,
    StoreBusy,
    StoredFile,
    StoreError,
    TaskNotFound,
    TaskStatus,
    UsageRow,
    open_store,
    sql_batches,
)
from corral.store.migrations import migrations
from corral.store.postgres import PostgresStore
from corral.store.sql import SqlStore
from corral.store.sqlite import DIALECT as SQLITE_DIALECT
from corral.store.sqlite import SqliteStore
from tests.conftest import PG_URL


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pg_schema() -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, clock: Clock, tmp_path: Path) -> Iterator[Store]:
    s: Store
    if request.param == "memory":
        s = MemoryStore(clock=clock)
    elif request.param == "sqlite":
        s = SqliteStore(tmp_path / "tasks.db", clock=clock)
    else:
        s = PostgresStore(PG_URL, schema=request.getfixturevalue("pg_schema"), clock=clock)
    yield s
    s.close()


def add(store: Store, model: str = "m", n: int = 1, **kw: object) -> list[str]:
    return store.enqueue_many([NewTask("k", model, {"i": i}, **kw) for i in range(n)])  # type: ignore[arg-type]


def test_enqueue_and_get_round_trip(store: Store, clock: Clock) -> None:
    tid = store.enqueue(
        NewTask(
            "cover_letter",
            "cover-writer",
            {"job": 42, "tags": ["a"]},
            priority=2,
            serial_key="g1",
            max_attempts=5,
            batch_id="b1",
        )
    )
    t = store.get(tid)
    assert (t.kind, t.model, t.payload, t.priority) == (
        "cover_letter",
        "cover-writer",
        {"job": 42, "tags": ["a"]},
        2,
    )
    assert (t.serial_key, t.max_attempts, t.batch_id) == ("g1", 5, "b1")
    assert t.status is TaskStatus.QUEUED
    assert t.attempts == 0
    assert t.created_at == clock.t


def test_bad_payload_stores_nothing_and_names_the_task(store: Store) -> None:
    with pytest.raises(BadTask, match="payload of a 'k' task is not JSON-serialisable"):
        store.enqueue_many([NewTask("k", "m", {"ok": 1}), NewTask("k", "m", {"bad": object()})])
    assert store.list() == []
    with pytest.raises(BadTask, match="max_attempts must be >= 1"):
        store.enqueue(NewTask("k", "m", max_attempts=0))
    with pytest.raises(BadTask, match="priority must be an integer from -100 to 100; got 309"):
        store.enqueue(NewTask("k", "m", priority=309))
    assert store.list() == []


def test_claim_order_priority_then_fifo_and_only_its_model(store: Store) -> None:
    low = add(store, n=2)
    high = add(store, n=2, priority=5)
    add(store, model="other")
    got = store.claim("m", "w1", limit=3, lease_s=30)
    assert [t.id for t in got] == [*high, low[0]]
    assert all(t.status is TaskStatus.RUNNING and t.attempts == 1 for t in got)
    assert len({t.lease_token for t in got}) == 3
    assert [t.id for t in store.claim("m", "w2", limit=10, lease_s=30)] == [low[1]]
    assert store.claim("m", "w2", limit=10, lease_s=30) == []


def test_serial_key_runs_one_at_a_time_in_fifo(store: Store) -> None:
    a1, a2 = add(store, n=2, serial_key="tag-a")
    (b1,) = add(store, serial_key="tag-b")
    (free,) = add(store)
    first = store.claim("m", "w", limit=10, lease_s=30)
    assert {t.id for t in first} == {a1, b1, free}  # parallel across keys, one per key
    assert store.claim("m", "w", limit=10, lease_s=30) == []  # a2 waits for a1
    t1 = next(t for t in first if t.id == a1)
    assert store.finish(a1, t1.lease_token or "", "done")
    assert [t.id for t in store.claim("m", "w", limit=10, lease_s=30)] == [a2]


def test_serial_key_order_survives_a_retry(store: Store, clock: Clock) -> None:
    a1, a2 = add(store, n=2, serial_key="s")
    (t1,) = store.claim("m", "w", limit=10, lease_s=30)
    assert store.fail(a1, t1.lease_token or "", "boom", retry_in_s=10)
    assert store.claim("m", "w", limit=10, lease_s=30) == []  # a2 may not overtake a1
    clock.t += 10
    assert [t.id for t in store.claim("m", "w", limit=10, lease_s=30)] == [a1]
    assert a2 not in [t.id for t in store.claim("m", "w", limit=10, lease_s=30)]


def test_fencing_a_lost_lease_cannot_commit(store: Store, clock: Clock) -> None:
    (tid,) = add(store)
    (old,) = store.claim("m", "w1", limit=1, lease_s=30)
    clock.t += 31
    assert store.reclaim_expired() == 1
    (new,) = store.claim("m", "w2", limit=1, lease_s=30)
    assert new.attempts == 2
    assert new.lease_token != old.lease_token
    assert store.heartbeat(tid, old.lease_token or "", 30) is Lease.LOST
    assert not store.finish(tid, old.lease_token or "", "stale")
    assert not store.fail(tid, old.lease_token or "", "stale", None)
    assert store.finish(tid, new.lease_token or "", "fresh")
    t = store.get(tid)
    assert t.status is TaskStatus.SUCCEEDED
    assert t.result == "fresh"
    assert t.worker_id == "w2"
    assert not store.finish(tid, new.lease_token or "", "twice")  # exactly one commit
    assert "lease expired on worker w1" in t.errors[0]["error"]


def test_reserved_tasks_count_no_attempt_until_they_start(store: Store, clock: Clock) -> None:
    a, b, c, d = add(store, n=4)
    got = store.claim("m", "w", limit=3, lease_s=30, start=1)
    assert [t.id for t in got] == [a, b, c]
    assert [(t.attempts, t.started_at) for t in got] == [(1, clock.t), (0, None), (0, None)]
    assert all(t.status is TaskStatus.RUNNING for t in got)
    assert [t.id for t in store.claim("m", "w2", limit=10, lease_s=30)] == [d]  # b, c are held
    tok = {t.id: t.lease_token or "" for t in got}
    # A commit starts the next reserved task in the same transaction, before its handler runs.
    clock.t += 1
    assert store.finish(a, tok[a], "ok", then_start=[(b, tok[b])])
    assert (store.get(b).attempts, store.get(b).started_at) == (1, clock.t)
    assert store.start([(b, tok[b])]) == []  # already started
    assert store.start([(c, "wrong-token")]) == []
    assert store.start([(c, tok[c])]) == [c]
    assert store.get(c).attempts == 1


def test_then_start_applies_even_when_the_commit_is_fenced(store: Store, clock: Clock) -> None:
    a, b = add(store, n=2)
    ta, tb = store.claim("m", "w", limit=2, lease_s=30, start=1)
    assert not store.finish(a, "stale-token", "x", then_start=[(b, tb.lease_token or "")])
    assert store.get(b).attempts == 1
    assert store.get(a).status is TaskStatus.RUNNING
    (c,) = add(store)
    (tc,) = store.claim("m", "w", limit=1, lease_s=30, start=0)
    assert store.fail(a, ta.lease_token or "", "boom", None, then_start=[(c, tc.lease_token or "")])
    assert store.get(c).attempts == 1
    (e,) = add(store)
    (te,) = store.claim("m", "w", limit=1, lease_s=30, start=0)
    store.cancel(b)
    assert store.acknowledge_cancel(b, tb.lease_token or "", then_start=[(e, te.lease_token or "")])
    assert store.get(e).attempts == 1


def test_expired_reservations_go_back_without_using_an_attempt(store: Store, clock: Clock) -> None:
    """A worker killed with tasks claimed ahead burns only the attempts it started."""
    started, reserved = add(store, n=2, max_attempts=1)
    store.claim("m", "w1", limit=2, lease_s=30, start=1)
    clock.t += 31
    assert store.reclaim_expired() == 2
    s, r = store.get(started), store.get(reserved)
    assert s.status is TaskStatus.FAILED  # its only attempt ran and the worker died
    assert (r.status, r.attempts, r.errors, r.worker_id) == (TaskStatus.QUEUED, 0, [], None)
    (again,) = store.claim("m", "w2", limit=1, lease_s=30, start=0)
    assert store.release(reserved, again.lease_token or "")
    assert store.get(reserved).attempts == 0


def test_group_commit_commits_each_task_fenced_by_its_own_token(store: Store, clock: Clock) -> None:
    a, b, c, d, e = add(store, n=5)
    (k,) = add(store, serial_key="key")
    (k2,) = add(store, serial_key="key")
    got = store.claim("m", "w", limit=5, lease_s=30, start=3)
    assert [(t.id, t.attempts, t.started_in_group) for t in got] == [
        (a, 1, True), (b, 1, True), (c, 1, True), (d, 0, False), (e, 0, False)
    ]  # fmt: skip
    tok = {t.id: t.lease_token or "" for t in got}
    (tk,) = store.claim("m", "w", limit=1, lease_s=30)
    assert tk.id == k
    assert not tk.started_in_group  # one task alone is no group
    woken: list[int] = []
    store.subscribe(lambda: woken.append(1))
    clock.t += 1
    done = [
        Finished(a, tok[a], json.dumps({"r": "a"})),
        Finished(b, "stale-token", json.dumps("b")),
        Finished(c, tok[c], json.dumps([1, 2])),
        Finished(k, tk.lease_token or "", json.dumps(None)),
    ]
    committed = store.finish_many(done, then_start=[(d, tok[d]), (e, tok[e])])
    assert sorted(committed) == sorted([a, c, k])
    assert (store.get(a).status, store.get(a).result) == (TaskStatus.SUCCEEDED, {"r": "a"})
    assert store.get(c).result == [1, 2]
    assert store.get(a).finished_at == clock.t
    assert store.get(b).status is TaskStatus.RUNNING  # fenced: nothing written
    assert [(store.get(x).attempts, store.get(x).started_in_group) for x in (d, e)] == [
        (1, True),
        (1, True),
    ]
    assert woken  # the serial key's next task may run
    assert [t.id for t in store.claim("m", "w", limit=5, lease_s=30)] == [k2]
    assert store.finish_many([Finished(a, tok[a], "1")]) == []  # exactly one commit


def test_one_task_that_joins_a_run_starts_as_a_group(store: Store, clock: Clock) -> None:
    """`group=True`: the tasks started join a run the worker already holds, so even one is a
    group (its attempt comes back if the worker dies), and one that must run alone stays
    reserved, as in any group."""
    a, b, c = add(store, n=3, max_attempts=1)
    (ta,) = store.claim("m", "w", limit=1, lease_s=30, group=True)
    assert (ta.id, ta.attempts, ta.started_in_group) == (a, 1, True)
    (tb,) = store.claim("m", "w", limit=1, lease_s=30, start=0)
    assert store.start([(b, tb.lease_token or "")], group=True) == [b]
    assert (store.get(b).attempts, store.get(b).started_in_group) == (1, True)
    clock.t += 31
    assert store.reclaim_expired() == 2
    for tid in (a, b):  # either may have killed the worker: neither loses its only attempt
        t = store.get(tid)
        assert (t.status, t.attempts, t.run_alone) == (TaskStatus.QUEUED, 0, True)
    got = store.claim("m", "w2", limit=3, lease_s=30, start=1, group=True)
    assert [(t.id, t.attempts, t.started_at is None) for t in got] == [
        (a, 0, True), (b, 0, True), (c, 0, True)
    ]  # fmt: skip
    tok = {t.id: t.lease_token or "" for t in got}
    assert store.start([(a, tok[a])], group=True) == []  # must run alone: not in a group
    assert store.start([(a, tok[a])]) == [a]


def test_a_grouped_task_whose_worker_died_gets_its_attempt_back_and_runs_alone(
    store: Store, clock: Clock
) -> None:
    """Any task of a group may have killed the worker: none loses an attempt for it, and each
    runs alone from then on, so the one that kills its worker runs out of attempts by itself."""
    a, b, c = add(store, n=3, max_attempts=1)
    store.claim("m", "w1", limit=3, lease_s=30)
    clock.t += 31
    assert store.reclaim_expired() == 3
    for tid in (a, b, c):
        t = store.get(tid)
        assert (t.status, t.attempts, t.run_alone, t.worker_id) == (
            TaskStatus.QUEUED,
            0,
            True,
            None,
        )
        assert t.errors[-1]["counted"] is False
        assert "runs alone" in (t.error or "")
    # A task that must run alone is never started in a group: it comes back reserved ...
    got = store.claim("m", "w2", limit=3, lease_s=30, start=3)
    assert [(t.id, t.attempts, t.started_at) for t in got] == [(x, 0, None) for x in (a, b, c)]
    tok = {t.id: t.lease_token or "" for t in got}
    assert store.start([(a, tok[a]), (b, tok[b])]) == []
    assert store.finish_many([], then_start=[(a, tok[a]), (b, tok[b])]) == []
    assert store.get(a).attempts == 0
    # ... and started by itself; if its worker dies now, the attempt counts.
    assert store.start([(a, tok[a])]) == [a]
    assert (store.get(a).attempts, store.get(a).started_in_group) == (1, False)
    clock.t += 31
    assert store.reclaim_expired() == 3
    assert store.get(a).status is TaskStatus.FAILED
    assert (store.get(b).status, store.get(b).attempts) == (TaskStatus.QUEUED, 0)
    # A claim of one starts it (alone), and a manual retry forgets the mark.
    (tb,) = store.claim("m", "w3", limit=1, lease_s=30)
    assert (tb.id, tb.attempts, tb.started_in_group) == (b, 1, False)
    assert store.retry(a) is TaskStatus.QUEUED
    assert not store.get(a).run_alone


def test_a_dead_workers_last_words_blame_the_running_task_and_clear_its_group(
    store: Store, clock: Clock
) -> None:
    """`blame_death` names the tasks that were running: they count the attempt when the lease
    expires (as if started alone); the rest of the worker's groups lose nothing and are not
    made to run alone; a task started alone keeps its counted attempt."""
    a, b, c, d, e = add(store, n=5, max_attempts=1)
    got = {t.id: t for t in store.claim("m", "w1", limit=3, lease_s=30)}  # a group of three
    (td,) = store.claim("m", "w1", limit=1, lease_s=30)  # one started alone
    (other,) = store.claim("m", "w2", limit=1, lease_s=30)  # another worker's group-less task
    assert (td.id, other.id) == (d, e)
    assert store.blame_death("w1", [(b, got[b].lease_token or "")]) == 3  # a, b and c
    assert store.blame_death("w1", [(b, got[b].lease_token or "")]) == 3  # idempotent
    clock.t += 31
    assert store.reclaim_expired() == 5
    blamed = store.get(b)
    assert (blamed.status, blamed.attempts, blamed.run_alone) == (TaskStatus.FAILED, 1, False)
    assert [x.get("counted", True) for x in blamed.errors] == [True]
    for tid in (a, c):
        t = store.get(tid)
        assert (t.status, t.attempts, t.run_alone) == (TaskStatus.QUEUED, 0, False)
        assert t.errors[-1]["counted"] is False
        assert "runs alone" not in (t.error or "")
    assert store.get(d).status is TaskStatus.FAILED  # started alone: its attempt counted
    assert store.get(e).status is TaskStatus.FAILED  # not w1's: untouched by its words
    # Cleared tasks keep running in groups.
    again = store.claim("m", "w3", limit=2, lease_s=30)
    assert {t.id for t in again} == {a, c}
    assert all(t.started_in_group and t.attempts == 1 for t in again)


def test_stale_last_words_change_nothing(store: Store, clock: Clock) -> None:
    """Words naming a task no longer running under that worker and token (reclaimed, torn or
    made up) leave the group rule in force."""
    a, b = add(store, n=2, max_attempts=2)
    got = {t.id: t for t in store.claim("m", "w1", limit=2, lease_s=30)}
    assert store.blame_death("w1", [(a, "not-the-token")]) == 0
    assert store.blame_death("w2", [(a, got[a].lease_token or "")]) == 0
    assert store.blame_death("w1", [(a, got[a].lease_token or ""), ("nope", "x")]) == 0
    clock.t += 31
    assert store.reclaim_expired() == 2
    for tid in (a, b):
        t = store.get(tid)
        assert (t.status, t.attempts, t.run_alone) == (TaskStatus.QUEUED, 0, True)
    # With nothing running, a dead worker's groups are all cleared.
    got = {t.id: t for t in store.claim("m", "w4", limit=2, lease_s=30, start=2)}
    assert all(t.started_at is None for t in got.values())  # run_alone: reserved, not grouped
    assert store.start([(a, got[a].lease_token or "")]) == [a]
    assert store.blame_death("w4", []) == 0  # a started alone: nothing of a group to clear


def test_purge_deletes_old_finished_tasks_only(store: Store, clock: Clock) -> None:
    ok, bad, gone, live, queued = add(store, n=5, max_attempts=1)
    (line,) = store.enqueue_many([NewTask("k", "m", {}, batch_id="batch_1")])
    got = {t.id: t.lease_token or "" for t in store.claim("m", "w", limit=6, lease_s=99)}
    assert store.finish(ok, got[ok], "x")
    assert store.fail(bad, got[bad], "boom", None)
    store.cancel(gone)
    assert store.acknowledge_cancel(gone, got[gone])
    assert store.finish(line, got[line], "line")
    assert store.release(queued, got[queued])
    clock.t += 100
    assert store.finish(live, got[live], "recent")
    assert store.purge(clock.t - 50, limit=2) == 2  # oldest first, at most `limit`
    assert store.purge(clock.t - 50) == 1
    assert store.purge(clock.t - 50) == 0
    left = {t.id for t in store.list(limit=10)}
    assert left == {live, queued, line}  # recent, never finished, a batch's line
    with pytest.raises(TaskNotFound):
        store.get(ok)


def test_purge_deletes_an_ended_batchs_old_lines_only(store: Store, clock: Clock) -> None:
    store.batches.create(a_batch(1), lines("batch-1", 2))
    store.batches.create(a_batch(2), lines("batch-2", 2))
    for t in store.claim("m", "w", limit=4, lease_s=99):
        assert store.finish(t.id, t.lease_token or "", "x")
    assert store.batches.update("batch-1", "completed", {"n": 1}, ["in_progress"]) is not None
    clock.t += 100
    assert store.purge(clock.t - 50) == 2
    assert store.batches.counts("batch-1") == {}
    assert store.batches.get("batch-1").status == "completed"  # the batch itself is kept
    assert store.batches.counts("batch-2") == {TaskStatus.SUCCEEDED: 2}  # still in progress


def test_expired_task_whose_cancel_was_requested_ends_cancelled(store: Store, clock: Clock) -> None:
    (tid,) = add(store)
    store.claim("m", "w", limit=1, lease_s=30)
    assert store.cancel(tid) is TaskStatus.RUNNING
    clock.t += 31
    assert store.reclaim_expired() == 1
    t = store.get(tid)
    assert t.status is TaskStatus.CANCELLED
    assert t.finished_at == clock.t


def test_heartbeat_extends_the_lease(store: Store, clock: Clock) -> None:
    (tid,) = add(store)
    (t,) = store.claim("m", "w", limit=1, lease_s=30)
    clock.t += 20
    assert store.heartbeat(tid, t.lease_token or "", 30) is Lease.HELD
    clock.t += 20  # 40 s after the claim, 20 s after the heartbeat
    assert store.reclaim_expired() == 0
    assert store.get(tid).status is TaskStatus.RUNNING


def test_failures_retry_with_backoff_then_fail_for_good(store: Store, clock: Clock) -> None:
    (tid,) = add(store, max_attempts=2)
    (t,) = store.claim("m", "w", limit=1, lease_s=30)
    assert store.fail(tid, t.lease_token or "", "first", retry_in_s=5)
    q = store.get(tid)
    assert q.status is TaskStatus.QUEUED
    assert q.run_after == clock.t + 5
    assert q.error == "first"
    assert store.claim("m", "w", limit=1, lease_s=30) == []
    clock.t += 5
    (t,) = store.claim("m", "w", limit=1, lease_s=30)
    assert store.fail(tid, t.lease_token or "", "second", retry_in_s=5)
    f = store.get(tid)
    assert f.status is TaskStatus.FAILED
    assert f.attempts == 2
    assert f.finished_at == clock.t
    assert [e["error"] for e in f.errors] == ["first", "second"]
    assert [e["attempt"] for e in f.errors] == [1, 2]


def test_release_gives_the_task_back_without_an_attempt(store: Store) -> None:
    (tid,) = add(store)
    (t,) = store.claim("m", "w", limit=1, lease_s=30)
    assert store.release(tid, t.lease_token or "")
    r = store.get(tid)
    assert r.status is TaskStatus.QUEUED
    assert r.attempts == 0
    assert r.worker_id is None


def test_cancel_queued_running_and_finished(store: Store) -> None:
    q, r, f = add(store, n=3)
    assert store.cancel(q) is TaskStatus.CANCELLED
    claimed = {t.id: t for t in store.claim("m", "w", limit=10, lease_s=30)}
    assert set(claimed) == {r, f}  # the cancelled one never starts
    assert store.cancel(r) is TaskStatus.RUNNING
    assert store.heartbeat(r, claimed[r].lease_token or "", 30) is Lease.CANCEL
    assert store.acknowledge_cancel(r, claimed[r].lease_token or "")
    assert store.get(r).status is TaskStatus.CANCELLED
    assert store.finish(f, claimed[f].lease_token or "", 1)
    assert store.cancel(f) is TaskStatus.SUCCEEDED
    with pytest.raises(TaskNotFound):
        store.cancel("nope")


def test_retry_requeues_failed_and_cancelled(store: Store) -> None:
    (tid,) = add(store, max_attempts=1)
    (t,) = store.claim("m", "w", limit=1, lease_s=30)
    store.fail(tid, t.lease_token or "", "x", None)
    assert store.retry(tid) is TaskStatus.QUEUED
    assert store.get(tid).attempts == 0
    assert [c.id for c in store.claim("m", "w", limit=1, lease_s=30)] == [tid]
    with pytest.raises(TaskNotFound):
        store.retry("nope")


def test_expired_lease_out_of_attempts_fails(store: Store, clock: Clock) -> None:
    (tid,) = add(store, max_attempts=1)
    store.claim("m", "w1", limit=1, lease_s=30)
    clock.t += 31
    assert store.reclaim_expired() == 1
    t = store.get(tid)
    assert t.status is TaskStatus.FAILED
    assert "lease expired on worker w1" in (t.error or "")


def test_list_filters_and_counts(store: Store) -> None:
    add(store, n=3)
    add(store, model="other", n=2)
    store.claim("m", "w", limit=1, lease_s=30)
    assert len(store.list()) == 5
    assert len(store.list(status=TaskStatus.QUEUED, model="m")) == 2
    light, full = store.list(full=False), store.list()
    assert [t.id for t in light] == [t.id for t in full]
    assert {t.payload for t in light} == {None}  # not read at all
    assert [t.payload for t in full] != [None] * 5
    assert [dataclasses.replace(t, payload=None, result=None) for t in full] == light
    assert [t.seq for t in store.list(limit=2)] == sorted(
        (t.seq for t in store.list()), reverse=True
    )[:2]
    assert store.counts() == {
        "m": {TaskStatus.QUEUED: 2, TaskStatus.RUNNING: 1},
        "other": {TaskStatus.QUEUED: 2},
    }
    with pytest.raises(TaskNotFound):
        store.get("nope")


def test_ready_counts_are_what_claim_could_take_now(store: Store, clock: Clock) -> None:
    add(store, n=2)
    add(store, n=1, priority=3)
    add(store, model="other", n=2, serial_key="s")  # only the first of a serial key is ready
    store.claim("m", "w", limit=1, lease_s=30)  # takes the priority-3 task
    assert store.ready_counts() == {"m": {(False, 0): 2}, "other": {(False, 0): 1}}
    (a,) = store.claim("m", "w", limit=1, lease_s=30)
    store.fail(a.id, a.lease_token or "", "x", retry_in_s=10)
    # the retry is not due yet
    assert store.ready_counts() == {"m": {(False, 0): 1}, "other": {(False, 0): 1}}
    clock.t += 10
    assert store.ready_counts()["m"] == {(False, 0): 2}
    add(store, n=1, interactive=True, priority=-5)
    assert store.ready_counts()["m"] == {(False, 0): 2, (True, -5): 1}


def test_interactive_tasks_are_claimed_before_batch_tasks_whatever_their_priority(
    store: Store,
) -> None:
    batch = add(store, n=2, priority=9)
    first = add(store, n=1, interactive=True, priority=-1)
    second = add(store, n=1, interactive=True, priority=2)
    got = store.claim("m", "w", limit=3, lease_s=30, start=2)
    assert [t.id for t in got] == [*second, *first, batch[0]]
    assert [t.interactive for t in got] == [True, True, False]
    assert [t.started_at is not None for t in got] == [True, True, False]


def test_concurrent_claims_never_hand_out_a_task_twice(
    store: Store, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ids = add(store, n=200)
    seen: list[str] = []
    lock = threading.Lock()

    def worker(s: Store, name: str) -> None:
        while got := s.claim("m", name, limit=7, lease_s=30):
            with lock:
                seen.extend(t.id for t in got)

    stores = [store]
    if isinstance(store, SqliteStore) and not isinstance(store, MemoryStore):  # the same file
        stores += [SqliteStore(store.path) for _ in range(2)]
    elif isinstance(store, PostgresStore):
        stores += [PostgresStore(PG_URL, schema=store.namespace) for _ in range(2)]
    threads = [
        threading.Thread(target=worker, args=(stores[i % len(stores)], f"w{i}")) for i in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(seen) == sorted(ids)  # each exactly once
    for s in stores[1:]:
        s.close()


def test_max_queued_bounds_a_kind_atomically_and_counts_only_queued_tasks(
    store: Store,
) -> None:
    def submit(n: int, kind: str = "k", s: Store = store) -> list[str]:
        return s.enqueue_many([NewTask(kind, "m", {"i": i}) for i in range(n)], max_queued=5)

    assert len(submit(3)) == 3
    with pytest.raises(QueueFull, match=r"'k' is full: 3 queued, max_queued is 5, and 3 more"):
        submit(3)  # all or none
    assert len(store.list()) == 3
    submit(2)
    with pytest.raises(QueueFull, match="5 queued"):
        submit(1)
    assert len(submit(5, kind="other")) == 5  # another kind has its own bound
    store.claim("m", "w", limit=2, lease_s=30)  # running tasks no longer count ...
    assert len(submit(2)) == 2
    assert len(store.list(status=TaskStatus.QUEUED)) == 10

    # ... and concurrent submitters never overshoot the bound.
    stores = [store]
    if isinstance(store, SqliteStore) and not isinstance(store, MemoryStore):
        stores += [SqliteStore(store.path) for _ in range(2)]
    elif isinstance(store, PostgresStore):
        stores += [PostgresStore(PG_URL, schema=store.namespace) for _ in range(2)]
    taken: list[str] = []
    lock = threading.Lock()

    def race(s: Store) -> None:
        for _ in range(10):
            try:
                got = s.enqueue_many([NewTask("race", "m", None)], max_queued=7)
            except QueueFull:
                continue
            with lock:
                taken.extend(got)

    threads = [threading.Thread(target=race, args=(stores[i % len(stores)],)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(taken) == 7
    for s in stores[1:]:
        s.close()


# --- SQL stores only ------------------------------------------------------------------------------
class Wakes:
    """Counts a store's wake-ups; `wait_for(n)` waits until at least n arrived."""

    def __init__(self) -> None:
        self.n = 0
        self._cv = threading.Condition()

    def __call__(self) -> None:
        with self._cv:
            self.n += 1
            self._cv.notify_all()

    def wait_for(self, n: int, timeout_s: float = 5.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.n >= n, timeout_s)


def test_subscribers_hear_when_tasks_may_have_become_claimable(store: Store, clock: Clock) -> None:
    wakes = Wakes()
    unsubscribe = store.subscribe(wakes)

    def woken_by(what: str, action: Callable[[], object]) -> None:
        before = wakes.n
        action()
        assert wakes.wait_for(before + 1), f"no wake-up after {what}"

    woken_by("enqueue", lambda: add(store, n=2, serial_key="s"))
    (t,) = store.claim("m", "w", limit=5, lease_s=30)
    woken_by("release", lambda: store.release(t.id, t.lease_token or ""))
    (t,) = store.claim("m", "w", limit=5, lease_s=30)
    woken_by("the end of a serial key's task", lambda: store.finish(t.id, t.lease_token or "", 1))
    (t,) = store.claim("m", "w", limit=5, lease_s=30)
    store.fail(t.id, t.lease_token or "", "boom", None)
    woken_by("retry", lambda: store.retry(t.id))
    store.claim("m", "w", limit=5, lease_s=30)
    clock.t += 31
    woken_by("reclaim", store.reclaim_expired)
    unsubscribe()
    settled = wakes.n
    add(store)
    assert not wakes.wait_for(settled + 1, timeout_s=0.3)  # unsubscribed: silence


def test_postgres_wakes_subscribers_in_other_processes(pg_schema: str) -> None:
    """LISTEN/NOTIFY: a task enqueued through another connection wakes this store's
    subscribers at once, so idle workers need not poll hard."""
    listener = PostgresStore(PG_URL, schema=pg_schema)
    assert listener.wakes_other_processes
    wakes = Wakes()
    listener.subscribe(wakes)
    assert wakes.wait_for(1)  # the listener fires once when it connects (it may have missed some)
    other = PostgresStore(PG_URL, schema=pg_schema)
    before = wakes.n
    started = time.monotonic()
    other.enqueue(NewTask("k", "m"))
    assert wakes.wait_for(before + 1, timeout_s=2.0)
    assert time.monotonic() - started < 1.0
    other.close()
    listener.close()


LATEST = migrations(SQLITE_DIALECT)[-1][0]


def test_schema_is_versioned_and_reopening_applies_nothing(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "t.db")
    assert s.schema.version() == LATEST
    s.close()
    again = SqliteStore(tmp_path / "t.db", migrate=False)
    assert again.schema.upgrade() == []
    again.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_database_from_schema_1_upgrades_and_keeps_its_tasks(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    old: SqlStore
    if kind == "sqlite":
        old = SqliteStore(tmp_path / "t.db", migrate=False)
    else:
        old = PostgresStore(PG_URL, schema=request.getfixturevalue("pg_schema"), migrate=False)
    with old._tx(write=True) as tx:  # the database as the first release left it
        tx.run("CREATE TABLE corral_schema (version INTEGER NOT NULL)")
        for statement in filter(str.strip, migrations(old.dialect)[0][1].split(";")):
            tx.run(statement)
        tx.run("INSERT INTO corral_schema (version) VALUES (1)")
        tx.run(  # a task as the first release wrote it
            "INSERT INTO corral_tasks (id, kind, model, payload, priority, status, "
            "max_attempts, created_at, run_after) VALUES ('old', 'k', 'm', '{}', 0, 'queued', "
            "3, 0, 0)"
        )
    assert old.schema.upgrade() == list(range(2, LATEST + 1))
    assert old.schema.version() == LATEST
    (new,) = add(old, interactive=True)
    claimed = old.claim("m", "w", limit=5, lease_s=30)
    assert [(t.id, t.interactive) for t in claimed] == [(new, True), ("old", False)]
    old.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_processes_starting_at_once_on_a_new_database_migrate_it_once(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """Several nodes or workers started together on an empty database: each opens the store
    (and migrates it) at the same moment; none fails, each step is applied once. SQLite's race
    (its switch to WAL refused at once while another opener switches) failed about one round in
    200 on a busy machine: a fresh database each round, 100 rounds."""
    rounds = 100 if kind == "sqlite" else 1
    for n in range(rounds):
        schema = request.getfixturevalue("pg_schema") if kind == "postgres" else ""

        def open_one(db: Path, schema: str) -> SqliteStore | PostgresStore:
            if kind == "sqlite":
                return SqliteStore(db)
            return PostgresStore(PG_URL, schema=schema)

        with ThreadPoolExecutor(8) as pool:
            stores = list(pool.map(open_one, [tmp_path / f"t{n}.db"] * 8, [schema] * 8))
        try:
            with stores[0]._tx(write=False) as tx:
                rows = tx.run("SELECT version FROM corral_schema ORDER BY version")
            assert [r["version"] for r in rows] == list(range(1, LATEST + 1))  # each step once
            add(stores[1])
            assert stores[2].counts() == {"m": {TaskStatus.QUEUED: 1}}
        finally:
            for s in stores:
                s.close()


def test_newer_schema_is_a_clear_error(tmp_path: Path, pg_schema: str) -> None:
    s = SqliteStore(tmp_path / "t.db")
    s._conn.execute("INSERT INTO corral_schema (version) VALUES (99)")
    s.close()
    with pytest.raises(
        SchemaTooNew, match=f"schema version 99 but this Corral knows up to {LATEST}"
    ):
        SqliteStore(tmp_path / "t.db")
    p = PostgresStore(PG_URL, schema=pg_schema)
    p.close()
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {pg_schema}.corral_schema (version) VALUES (99)")
    with pytest.raises(SchemaTooNew):
        PostgresStore(PG_URL, schema=pg_schema)


def test_sqlite_locked_beyond_the_busy_timeout_is_retryable(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    s = SqliteStore(path, busy_timeout_s=0.2)
    (tid,) = add(s)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreBusy, match="stayed locked beyond the busy timeout"):
        s.claim("m", "w", limit=1, lease_s=30)
    with pytest.raises(StoreBusy):
        add(s)
    blocker.execute("ROLLBACK")
    blocker.close()
    assert [t.id for t in s.claim("m", "w", limit=5, lease_s=30)] == [tid]  # nothing lost
    s.close()


def test_unopenable_sqlite_path_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=r"cannot open the SQLite database at .*file/sub/t\.db"):
        SqliteStore(tmp_path / "file" / "sub" / "t.db")


def test_open_store_by_url(tmp_path: Path, pg_schema: str) -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    s = open_store(f"sqlite:///{tmp_path}/x.db")
    assert isinstance(s, SqliteStore)
    assert s.path == f"/{tmp_path}/x.db".replace("//", "/")
    s.close()
    p = open_store(f"{PG_URL}?schema={pg_schema}")
    assert isinstance(p, PostgresStore)
    assert p.namespace == pg_schema
    p.close()
    with pytest.raises(StoreError, match="unknown store URL 'redis://x'"):
        open_store("redis://x")
    with pytest.raises(
        StoreError, match="cannot connect to PostgreSQL at postgresql://u:\\*\\*\\*@"
    ):
        open_store("postgresql://u:secret@127.0.0.1:1/nope")


# --- files and batches (the Batch API) -----------------------------------------------------------
def a_file(i: int, purpose: str = "batch") -> StoredFile:
    return StoredFile(f"file-{i}", purpose, f"in{i}.jsonl", 10 * i, 1_000.0 + i, f"/x/{i}")


def test_files_round_trip_page_newest_first_and_delete(store: Store) -> None:
    for i in range(5):
        store.files.add(a_file(i, "batch" if i % 2 == 0 else "batch_output"))
    assert store.files.get("file-3") == a_file(3, "batch_output")
    assert [f.id for f in store.files.list()] == ["file-4", "file-3", "file-2", "file-1", "file-0"]
    assert [f.id for f in store.files.list(after="file-3", limit=2)] == ["file-2", "file-1"]
    assert [f.id for f in store.files.list(purpose="batch")] == ["file-4", "file-2", "file-0"]
    assert store.files.delete("file-2").path == "/x/2"
    with pytest.raises(FileNotFound, match="no file with id 'file-2'"):
        store.files.get("file-2")
    with pytest.raises(FileNotFound):
        store.files.delete("file-2")


def test_files_page_oldest_first_keep_their_expiry_and_an_unknown_cursor_is_empty(
    store: Store,
) -> None:
    for i in range(4):
        store.files.add(a_file(i, "batch"))
    expiring = dataclasses.replace(a_file(9, "batch"), expires_at=5_000.5)
    store.files.add(expiring)
    assert store.files.get("file-9").expires_at == 5_000.5
    assert store.files.get("file-1").expires_at is None
    asc = [f.id for f in store.files.list(order="asc")]
    assert asc == ["file-0", "file-1", "file-2", "file-3", "file-9"]
    assert [f.id for f in store.files.list(order="asc", after="file-1", limit=2)] == [
        "file-2",
        "file-3",
    ]
    assert store.files.list(after="file-nope") == []
    assert store.files.list(after="file-nope", order="asc") == []


def test_a_validating_batch_starts_with_its_lines_once(store: Store) -> None:
    store.batches.create(dataclasses.replace(a_batch(1), status="validating"), [])
    assert store.batches.counts("batch-1") == {}
    started = store.batches.start("batch-1", "in_progress", {"n": 2}, lines("batch-1", 3))
    assert started is not None
    assert (started.status, started.data) == ("in_progress", {"n": 2})
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 3}
    # a second start (another process, a retry) stores nothing more
    assert store.batches.start("batch-1", "in_progress", {"n": 3}, lines("batch-1", 3)) is None
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 3}
    assert store.batches.get("batch-1").data == {"n": 2}
    with pytest.raises(BatchNotFound):
        store.batches.start("batch-9", "in_progress", {}, [])


def a_batch(i: int, key: str | None = None) -> Batch:
    return Batch(f"batch-{i}", "in_progress", 1_000.0 + i, {"n": i, "meta": {"a": "b"}}, key)


def lines(batch_id: str, n: int) -> list[NewTask]:
    return [
        NewTask("openai_batch", "m", {"line": i}, priority=-1, batch_id=batch_id) for i in range(n)
    ]


def test_a_batch_and_its_lines_are_stored_together(store: Store) -> None:
    b = store.batches.create(a_batch(1), lines("batch-1", 3))
    assert (b.id, b.status, b.data) == ("batch-1", "in_progress", {"n": 1, "meta": {"a": "b"}})
    assert store.batches.get("batch-1") == b
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 3}
    assert [t.payload["line"] for t in store.batches.tasks("batch-1")] == [0, 1, 2]
    first = store.batches.tasks("batch-1")[0]
    assert [t.payload["line"] for t in store.batches.tasks("batch-1", after_seq=first.seq)] == [
        1,
        2,
    ]
    assert store.ready_counts() == {"m": {(False, -1): 3}}  # claimable like any task
    with pytest.raises(BatchNotFound, match="no batch with id 'nope'"):
        store.batches.get("nope")


def _owned(store: Store, i: int, owner: str | None, n: int, weight: float = 1.0) -> list[str]:
    """Batch `batch-i` of `owner` with `n` lines on model m, placed as the service places
    them (`starts`, then start + k / weight); its lines' ids."""
    (start,) = store.batches.starts(["m"], owner, -1).values()
    tasks = [
        dataclasses.replace(t, turn=start + k / weight)
        for k, t in enumerate(lines(f"batch-{i}", n), 1)
    ]
    store.batches.create(dataclasses.replace(a_batch(i), owner=owner), tasks)
    return [t.id for t in store.batches.tasks(f"batch-{i}")]


def _claim_all(store: Store) -> list[str]:
    got: list[str] = []
    while batch := store.claim("m", "w", limit=1, lease_s=30):
        got.extend(t.id for t in batch)
    return got


def test_owners_batch_lines_take_turns_by_weight_and_the_rest_keep_their_order(
    store: Store,
) -> None:
    a = _owned(store, 1, "ann", 6)
    b = _owned(store, 2, "bob", 3)
    assert _claim_all(store) == [a[0], a[1], b[0], a[2], b[1], a[3], b[2], a[4], a[5]]
    # Weight 2: two of carol's lines to one of ann's; ann's second batch follows her first;
    # a queue task (no turn) keeps its place by arrival, after every line queued before it.
    a = _owned(store, 3, "ann", 3)
    c = _owned(store, 4, "carol", 4, weight=2.0)
    a2 = _owned(store, 5, "ann", 1)
    (task,) = store.enqueue_many([NewTask("k", "m", {}, priority=-1)])
    assert _claim_all(store) == [a[0], c[0], a[1], c[1], c[2], a[2], c[3], a2[0], task]
    # Without owners (no keys), batches run one after the other, as queue tasks do.
    x = _owned(store, 6, None, 2)
    y = _owned(store, 7, None, 2)
    assert _claim_all(store) == [*x, *y]


def test_large_batches_keep_their_turns(store: Store) -> None:
    """Batches of many lines (PostgreSQL stores them with COPY) keep every line's turn."""
    a = _owned(store, 1, "ann", 40)
    b = _owned(store, 2, "bob", 20)
    assert store.batches.starts(["m"], "ann", -1) == {"m": 40.0}
    got = _claim_all(store)
    assert got[:6] == [a[0], a[1], b[0], a[2], b[1], a[3]]
    assert got[41:] == a[21:]


def test_a_batch_that_does_not_store_stores_no_lines(store: Store) -> None:
    bad = [*lines("batch-1", 2), NewTask("openai_batch", "m", {"x": float("nan")})]
    with pytest.raises(BadTask):
        store.batches.create(a_batch(1), bad)
    with pytest.raises(BatchNotFound):
        store.batches.get("batch-1")
    assert store.counts() == {}


def test_an_idempotency_key_returns_the_first_batch(store: Store) -> None:
    first = store.batches.create(a_batch(1, key="k1"), lines("batch-1", 2))
    again = store.batches.create(a_batch(2, key="k1"), lines("batch-2", 2))
    assert again == first
    assert store.counts() == {"m": {TaskStatus.QUEUED: 2}}  # the retry stored no lines
    with pytest.raises(BatchNotFound):
        store.batches.get("batch-2")


def test_batches_page_newest_first(store: Store) -> None:
    for i in range(4):
        store.batches.create(a_batch(i), [])
    assert [b.id for b in store.batches.list()] == ["batch-3", "batch-2", "batch-1", "batch-0"]
    assert [b.id for b in store.batches.list(after="batch-2", limit=1)] == ["batch-1"]
    store.batches.update("batch-1", "completed", {}, expect=["in_progress"])
    live = store.batches.list(status=["in_progress", "cancelling"])
    assert [b.id for b in live] == ["batch-3", "batch-2", "batch-0"]
    assert [b.id for b in store.batches.list(after="batch-3", status=["completed"])] == ["batch-1"]


def test_files_and_batches_keep_their_owner_and_list_by_owner(store: Store) -> None:
    for i, owner in enumerate(["alice", "bob", None, "alice"]):
        store.files.add(dataclasses.replace(a_file(i), owner=owner))
        store.batches.create(dataclasses.replace(a_batch(i), owner=owner), lines(f"batch-{i}", 1))
    assert store.files.get("file-1").owner == "bob"
    assert store.files.get("file-2").owner is None
    assert [f.id for f in store.files.list(owner="alice")] == ["file-3", "file-0"]
    assert [f.id for f in store.files.list(owner="alice", after="file-3")] == ["file-0"]
    assert [f.id for f in store.files.list(owner="carol")] == []
    assert len(store.files.list()) == 4  # no owner given: everyone's
    assert store.batches.get("batch-1").owner == "bob"
    assert [b.id for b in store.batches.list(owner="alice")] == ["batch-3", "batch-0"]
    assert [b.id for b in store.batches.list(owner="bob", status=["in_progress"])] == ["batch-1"]
    assert store.files.delete("file-0").owner == "alice"
    done = store.batches.update("batch-3", "completed", {}, expect=["in_progress"])
    assert done is not None
    assert done.owner == "alice"


def test_update_batch_is_compare_and_set_on_status(store: Store) -> None:
    store.batches.create(a_batch(1), [])
    done = store.batches.update("batch-1", "finalizing", {"n": 2}, expect=["in_progress"])
    assert done is not None
    assert (done.status, done.data) == ("finalizing", {"n": 2})
    assert store.batches.update("batch-1", "cancelling", {}, expect=["in_progress"]) is None
    assert store.batches.get("batch-1").status == "finalizing"  # the losing write changed nothing
    with pytest.raises(BatchNotFound):
        store.batches.update("nope", "x", {}, expect=["in_progress"])


def test_cancel_batch_cancels_queued_lines_and_flags_running_ones(store: Store) -> None:
    store.batches.create(a_batch(1), lines("batch-1", 4))
    add(store, "other", n=2)  # not the batch's: untouched
    (running,) = store.claim("m", "w", 1, 30.0)
    assert running.batch_id == "batch-1"
    assert store.batches.cancel("batch-1") == 4
    assert store.batches.counts("batch-1") == {TaskStatus.CANCELLED: 3, TaskStatus.RUNNING: 1}
    assert store.heartbeat(running.id, running.lease_token or "", 30.0) is Lease.CANCEL
    assert store.counts()["other"] == {TaskStatus.QUEUED: 2}


def test_workers_are_seen_refreshed_and_forgotten(store: Store, clock: Clock) -> None:
    assert store.members.workers(0) == {}
    store.members.worker_seen("w1", ["a", "b"])
    clock.t += 10
    store.members.worker_seen("w2", ["c"])
    assert store.members.workers(clock.t - 60) == {"w1": ["a", "b"], "w2": ["c"]}
    assert store.members.workers(clock.t - 5) == {"w2": ["c"]}  # w1 not seen for 10 s
    store.members.worker_seen("w1", ["a"])  # seen again, now serving fewer models
    assert store.members.workers(clock.t - 5) == {"w1": ["a"], "w2": ["c"]}
    store.members.worker_gone("w2")
    store.members.worker_gone("w2")  # idempotent
    assert store.members.workers(0) == {"w1": ["a"]}


def test_nodes_are_the_workers_that_said_a_url(store: Store, clock: Clock) -> None:
    assert store.members.nodes(0) == {}
    store.members.worker_seen("plain", ["a"])  # a `corral worker`: no URL
    store.members.worker_seen("n1", ["a", "b"], url="http://10.0.0.1:8080")
    clock.t += 10
    store.members.worker_seen("n2", ["a"], url="http://10.0.0.2:8080")
    assert store.members.nodes(clock.t - 60) == {
        "n1": "http://10.0.0.1:8080",
        "n2": "http://10.0.0.2:8080",
    }
    assert store.members.nodes(clock.t - 5) == {"n2": "http://10.0.0.2:8080"}  # n1 silent for 10 s
    assert set(store.members.workers(clock.t - 60)) == {
        "plain",
        "n1",
        "n2",
    }  # nodes are workers too
    store.members.worker_seen("n1", ["a"], url="http://10.0.0.9:8080")  # moved
    assert store.members.nodes(clock.t - 5)["n1"] == "http://10.0.0.9:8080"
    store.members.worker_gone("n2")
    assert store.members.nodes(0) == {"n1": "http://10.0.0.9:8080"}


def test_residency_is_replaced_per_worker_ages_out_and_goes_with_the_worker(
    store: Store, clock: Clock
) -> None:
    start = clock.t
    store.members.set_residency("w1", [("gpu0", "a", "loading")])
    store.members.set_residency("w2", [("gpu0", "b", "ready"), ("gpu1", "c", "ready")])
    store.members.set_residency("w1", [("gpu0", "a", "ready")])  # replaces, not adds
    rows = store.members.residency(start - 1)
    assert [(r.worker_id, r.device, r.model, r.state) for r in rows] == [
        ("w1", "gpu0", "a", "ready"),
        ("w2", "gpu0", "b", "ready"),
        ("w2", "gpu1", "c", "ready"),
    ]
    assert all(r.seen_at == start for r in rows)
    clock.t += 30
    store.members.set_residency("w1", [("gpu0", "a", "ready")])  # a heartbeat: w1 still holds a
    assert [(r.worker_id, r.model) for r in store.members.residency(start + 1)] == [("w1", "a")]
    store.members.set_residency("w1", [])  # unloaded everything
    assert [r.worker_id for r in store.members.residency(start - 1)] == ["w2", "w2"]
    store.members.worker_gone("w2")
    assert store.members.residency(start - 1) == []


def test_residency_holds_more_models_than_the_alphabet(store: Store, clock: Clock) -> None:
    # A worker with many small models (embeddings, say) on its devices: the list of models it
    # keeps once named its placeholders a-z, and the 27th broke the statement.
    many = [(f"gpu{i % 4}", f"m{i:02d}", "ready") for i in range(60)]
    store.members.set_residency("w1", many)
    store.members.set_residency("w1", many[:40])  # it unloaded twenty; forty stay
    rows = store.members.residency(clock.t - 1)
    assert sorted(r.model for r in rows) == [f"m{i:02d}" for i in range(40)]


def test_a_large_batch_is_stored_a_transaction_at_a_time_and_runs_only_once_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_batches, "LINES_PER_TX", 4)
    seen: list[tuple[str, dict[str, dict[tuple[bool, int], int]]]] = []

    def watched(n: int) -> Iterator[NewTask]:
        for i, task in enumerate(lines("batch-1", n)):
            if i in (6, 10):
                # Between its transactions the store serves others (on SQLite its lock is
                # free, else this would wait forever), and none of the lines can run yet.
                seen.append((store.batches.get("batch-1").status, store.ready_counts()))
            yield task

    b = store.batches.create(a_batch(1), watched(11))
    assert seen == [("validating", {}), ("validating", {})]
    assert (b.status, b.data) == ("in_progress", {"n": 1, "meta": {"a": "b"}})
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 11}
    assert [t.payload["line"] for t in store.batches.tasks("batch-1")] == list(range(11))
    assert store.ready_counts() == {"m": {(False, -1): 11}}


def test_a_large_batch_that_cannot_be_stored_leaves_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_batches, "LINES_PER_TX", 2)
    bad = [*lines("batch-1", 5), NewTask("openai_batch", "m", {"x": float("nan")})]
    with pytest.raises(BadTask):
        store.batches.create(a_batch(1), bad)
    with pytest.raises(BatchNotFound):
        store.batches.get("batch-1")
    assert store.counts() == {}


def test_two_attempts_at_storing_one_batch_store_its_lines_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_batches, "LINES_PER_TX", 2)
    store.batches.create(dataclasses.replace(a_batch(1), status="validating"), [])
    won: list[Batch | None] = []

    def racing(n: int) -> Iterator[NewTask]:
        for i, task in enumerate(lines("batch-1", n)):
            if i == 3:  # another process takes over while this one is halfway
                again = lines("batch-1", 5)
                won.append(store.batches.start("batch-1", "in_progress", {"by": 2}, again))
            yield task

    assert store.batches.start("batch-1", "in_progress", {"by": 1}, racing(5)) is None
    assert won[0] is not None
    assert won[0].data == {"by": 2}
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 5}
    assert store.ready_counts() == {"m": {(False, -1): 5}}


def test_the_attempt_that_starts_a_batch_drops_what_a_dead_one_held_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_batches, "LINES_PER_TX", 2)
    store.batches.create(dataclasses.replace(a_batch(1), status="validating"), [])

    def dies(n: int) -> Iterator[NewTask]:
        yield from lines("batch-1", n)
        raise KeyboardInterrupt  # the process goes before it can drop what it stored

    with monkeypatch.context() as m:
        m.setattr(sql_batches.SqlBatches, "_drop_held", staticmethod(lambda *a: None))
        with pytest.raises(KeyboardInterrupt):
            store.batches.start("batch-1", "in_progress", {}, dies(5))
    assert store.ready_counts() == {}  # held back: none of them can run
    assert store.batches.start("batch-1", "in_progress", {}, lines("batch-1", 3)) is not None
    assert store.batches.counts("batch-1") == {TaskStatus.QUEUED: 3}


def test_the_audit_log_keeps_who_did_what_and_when(store: Store, clock: Clock) -> None:
    store.audit.record("ops", "model.load", "alpha", "POST /api/models/alpha/load")
    clock.t += 10
    store.audit.record("bob", "model.unload", "alpha")
    for _ in range(2):  # a key change told twice (a restart reads the key file again)
        store.audit.record("local", "key.create", "alice:key_1", "role user", at=5.0, once=True)
    entries = store.audit.list()
    assert [(e.principal, e.action, e.target) for e in entries] == [
        ("local", "key.create", "alice:key_1"),
        ("bob", "model.unload", "alpha"),
        ("ops", "model.load", "alpha"),
    ]  # newest first (by when it was kept)
    assert entries[0].at == 5.0
    assert entries[2].detail == "POST /api/models/alpha/load"
    assert [e.action for e in store.audit.list(since=clock.t)] == ["model.unload"]
    assert len(store.audit.list(limit=1)) == 1
    store.audit.record("x" * 5000, "a", "t")  # bounded, whatever a field holds
    assert len(store.audit.list(limit=1)[0].principal) == 2000


def test_usage_rows_add_up_per_hour_principal_and_model(store: Store) -> None:
    def row(hour: int, who: str, n: int, wait_s: float) -> UsageRow:
        return UsageRow(hour, who, "m", n, 10 * n, 2 * n, wait_s, 0.5 * n, 0.25)

    store.usage.add([row(3600, "alice", 1, 0.5), row(3600, "bob", 2, 1.0)])
    store.usage.add([row(3600, "alice", 3, 1.5), row(7200, "alice", 1, 0.0)])  # saved again
    store.usage.add([])
    rows = store.usage.since(0)
    assert rows == [
        UsageRow(3600, "alice", "m", 4, 40, 8, 2.0, 2.0, 0.5),
        UsageRow(3600, "bob", "m", 2, 20, 4, 1.0, 1.0, 0.25),
        UsageRow(7200, "alice", "m", 1, 10, 2, 0.0, 0.5, 0.25),
    ]
    assert [r.hour for r in store.usage.since(7200)] == [7200]
    assert store.usage.forget_before(7200) == 2
    assert [r.hour for r in store.usage.since(0)] == [7200]
