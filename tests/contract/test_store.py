"""One suite, every store: memory, SQLite and PostgreSQL (127.0.0.1:5432, database `test`).

Each PostgreSQL test gets a schema of its own, dropped afterwards, so parallel runs never meet.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from corral.store import (
    BadTask,
    Lease,
    MemoryStore,
    NewTask,
    SchemaTooNew,
    Store,
    StoreBusy,
    StoreError,
    TaskNotFound,
    TaskStatus,
    open_store,
)
from corral.store.postgres import PostgresStore
from corral.store.sqlite import SqliteStore

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


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
    assert store.ready_counts() == {"m": {0: 2}, "other": {0: 1}}
    (a,) = store.claim("m", "w", limit=1, lease_s=30)
    store.fail(a.id, a.lease_token or "", "x", retry_in_s=10)
    assert store.ready_counts() == {"m": {0: 1}, "other": {0: 1}}  # the retry is not due yet
    clock.t += 10
    assert store.ready_counts()["m"] == {0: 2}


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
    if isinstance(store, SqliteStore):  # other connections to the same file
        stores += [SqliteStore(store.path) for _ in range(2)]
    elif isinstance(store, PostgresStore):
        stores += [PostgresStore(PG_URL, schema=store.schema) for _ in range(2)]
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


# --- SQL stores only ------------------------------------------------------------------------------
def test_schema_is_versioned_and_reopening_applies_nothing(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "t.db")
    assert s.schema_version() == 1
    s.close()
    again = SqliteStore(tmp_path / "t.db", migrate=False)
    assert again.upgrade() == []
    again.close()


def test_newer_schema_is_a_clear_error(tmp_path: Path, pg_schema: str) -> None:
    s = SqliteStore(tmp_path / "t.db")
    s._conn.execute("INSERT INTO corral_schema (version) VALUES (99)")
    s.close()
    with pytest.raises(SchemaTooNew, match="schema version 99 but this Corral knows up to 1"):
        SqliteStore(tmp_path / "t.db")
    p = PostgresStore(PG_URL, schema=pg_schema)
    p._conn.execute("INSERT INTO corral_schema (version) VALUES (99)")
    p.close()
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
    assert p.schema == pg_schema
    p.close()
    with pytest.raises(StoreError, match="unknown store URL 'redis://x'"):
        open_store("redis://x")
    with pytest.raises(
        StoreError, match="cannot connect to PostgreSQL at postgresql://u:\\*\\*\\*@"
    ):
        open_store("postgresql://u:secret@127.0.0.1:1/nope")
