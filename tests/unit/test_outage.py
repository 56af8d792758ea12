"""Riding out a database outage (store/outage.py): which operations run again, and when."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest

from corral.store import Finished, MemoryStore, NewTask, StoreUnavailable, TaskStatus
from corral.store.outage import Lost, Outage
from corral.store.queries import Transactions, Tx


class Flaky:
    """Fails its first `drops` calls with a dropped connection (during the commit if
    `maybe_done`), then returns how many calls it took."""

    def __init__(self, drops: int, maybe_done: bool = False) -> None:
        self.drops = drops
        self.maybe_done = maybe_done
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.drops:
            raise Lost(ConnectionError("server closed the connection"), self.maybe_done)
        return self.calls


def fast(patience_s: float = 5.0) -> Outage:
    return Outage("db", patience_s, first_delay_s=0.001, max_delay_s=0.002)


def test_an_operation_runs_again_on_a_fresh_connection(caplog: pytest.LogCaptureFixture) -> None:
    outage = fast()
    with caplog.at_level(logging.WARNING, logger="corral.store"):
        assert outage.call("a read", Flaky(3)) == 4
        assert outage.call("a read", Flaky(2)) == 3
    lost = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    back = [r.getMessage() for r in caplog.records if "connected again" in r.getMessage()]
    assert len(lost) == 2  # once per outage, not once per try
    assert len(back) == 2
    assert "server closed the connection" in lost[0]
    assert outage.outages == 2
    assert outage.down_since is None


def test_a_lost_commit_runs_again_only_if_idempotent_or_resolved() -> None:
    outage = fast()
    assert outage.call("a fenced write", Flaky(1, maybe_done=True)) == 2
    with pytest.raises(StoreUnavailable, match="may or may not have taken effect"):
        outage.call("an insert", Flaky(1, maybe_done=True), idempotent=False)
    # Before the commit the database rolled it back: always safe.
    assert outage.call("an insert", Flaky(1), idempotent=False) == 2
    # With a resolve, it looks for its own effect first, and runs again only if none.
    found = outage.call("a claim", Flaky(1, maybe_done=True), idempotent=False, resolve=lambda: -1)
    assert found == -1
    flaky = Flaky(1, maybe_done=True)
    assert outage.call("a claim", flaky, idempotent=False, resolve=lambda: None) == 2
    assert flaky.calls == 2


def test_patience_runs_out_with_a_clear_error() -> None:
    outage = fast(patience_s=0.05)
    with pytest.raises(StoreUnavailable, match=r"db is unreachable .*gave up on a read after"):
        outage.call("a read", Flaky(10**9))
    assert outage.down_since is not None  # still down: the next success says it is back
    assert outage.call("a read", lambda: 7) == 7
    assert outage.down_since is None


class DroppingStore(MemoryStore):
    """The store whose connection drops under every other transaction while `dropping`,
    before the commit (always safe to run again), with an `Outage` as its guard."""

    def __init__(self) -> None:
        self.dropping = False
        self.opened = 0
        self.drops = 0
        super().__init__()
        self._guard = fast().call

    @contextmanager
    def _tx(self, write: bool, single: bool = False) -> Iterator[Tx]:
        if self.dropping:
            self.opened += 1
            if self.opened % 2:
                self.drops += 1
                raise Lost(ConnectionError("server closed the connection"), maybe_done=False)
        with super()._tx(write, single) as tx:
            yield tx


def test_every_task_operation_rides_out_a_dropped_connection() -> None:
    """Each task operation runs under the store's guard (`@guarded`, or its own call): with
    the connection dropping under every first try, each still succeeds. PostgresStore claims
    its own way (a lost commit is resolved by the claim's nonce: test_pg_faults)."""
    from corral.store.roles import TaskControl, TaskQueue

    store = DroppingStore()
    ids = store.enqueue_many([NewTask(kind="k", model="m", payload={"n": n}) for n in range(6)])

    def held(n: int = 1, start: int = 0) -> list[tuple[str, str]]:
        """`n` tasks claimed (the first `start` of them started), claimed before the drops."""
        store.dropping = False
        tasks = store.claim("m", "w1", n, 60.0, start=start)
        store.dropping = True
        return [(t.id, str(t.lease_token)) for t in tasks]

    calls: dict[str, Callable[[], object]] = {
        "enqueue": lambda: store.enqueue(NewTask(kind="k", model="m")),
        "enqueue_many": lambda: store.enqueue_many([NewTask(kind="k", model="m")], 100),
        "start": lambda: store.start(held()),
        "heartbeat": lambda: store.heartbeat(*held()[0], 60.0),
        "finish": lambda: store.finish(*held()[0], {"ok": 1}),
        "finish_many": lambda: store.finish_many([Finished(*t, "{}") for t in held(2, 2)]),
        "fail": lambda: store.fail(*held()[0], "boom", None),
        "release": lambda: store.release(*held()[0]),
        "acknowledge_cancel": lambda: store.acknowledge_cancel(*held()[0]),
        "get": lambda: store.get(ids[0]),
        "list": lambda: store.list(),
        "counts": lambda: store.counts(),
        "ready_counts": lambda: store.ready_counts(),
        "cancel": lambda: store.cancel(ids[-1]),
        "retry": lambda: store.retry(ids[-1]),
        "reclaim_expired": lambda: store.reclaim_expired(),
        "blame_death": lambda: store.blame_death("w1", []),
        "purge": lambda: store.purge(time.time() + 60),
    }
    ops = {
        name
        for role in (TaskQueue, TaskControl)
        for name, value in vars(role).items()
        if callable(value) and not name.startswith("_")
    }
    assert set(calls) == ops - {"claim", "subscribe"}  # a new operation joins this test
    for name, call in calls.items():
        drops = store.drops
        store.dropping = True
        assert call() is not None, name
        assert store.drops > drops, name  # dropped, and ran again
    store.dropping = False
    assert store.get(ids[-1]).status == TaskStatus.QUEUED  # cancelled, then retried


class Dropping:
    """A store's transactions whose connection drops as each transaction opens, every other
    time (before the commit: always safe to run again)."""

    def __init__(self, transactions: Transactions) -> None:
        self._transactions = transactions
        self.opened = 0
        self.drops = 0

    def __call__(self, write: bool, single: bool = False) -> AbstractContextManager[Tx]:
        self.opened += 1
        if self.opened % 2:
            self.drops += 1
            raise Lost(ConnectionError("server closed the connection"), maybe_done=False)
        return self._transactions(write, single)


def test_every_operation_of_the_other_roles_runs_under_the_guard() -> None:
    """`files`, `batches` and `members` take the guard each operation runs under: with the
    connection dropping under every first try, each of their operations still succeeds."""
    from corral.store import Batch, MemoryStore, NewTask, StoredFile
    from corral.store.sql_batches import SqlBatches, SqlFiles
    from corral.store.sql_cluster import SqlMembership

    store = MemoryStore()
    tx = Dropping(store._tx)
    guard = fast().call
    files = SqlFiles(tx, guard)
    batches = SqlBatches(tx, guard, time.time, store._insert, lambda: None, store._announce)
    members = SqlMembership(tx, guard, time.time)
    line = NewTask(kind="batch", model="m", payload={}, batch_id="b1")
    calls: dict[object, dict[str, Callable[[], object]]] = {
        SqlFiles: {
            "add": lambda: files.add(StoredFile("f1", "batch", "in.jsonl", 2, 1.0, "/tmp/f1")),
            "get": lambda: files.get("f1"),
            "list": lambda: files.list(),
            "delete": lambda: files.delete("f1"),
        },
        SqlBatches: {
            "create": lambda: batches.create(Batch("b1", "validating", 1.0, {}), []),
            "start": lambda: batches.start("b1", "in_progress", {}, [line]),
            "get": lambda: batches.get("b1"),
            "list": lambda: batches.list(),
            "update": lambda: batches.update("b1", "finalizing", {}, ["in_progress"]),
            "counts": lambda: batches.counts("b1"),
            "tasks": lambda: batches.tasks("b1"),
            "starts": lambda: batches.starts(["m"], "ann", -1),
            "cancel": lambda: batches.cancel("b1"),
        },
        SqlMembership: {
            "worker_seen": lambda: members.worker_seen("w1", ["m"]),
            "set_residency": lambda: members.set_residency("w1", [("cpu", "m", "ready")]),
            "residency": lambda: members.residency(0.0),
            "workers": lambda: members.workers(0.0),
            "nodes": lambda: members.nodes(0.0),
            "worker_gone": lambda: members.worker_gone("w1"),
        },
    }
    for role, ops in calls.items():
        public = {n for n, v in vars(role).items() if callable(v) and not n.startswith("_")}
        assert set(ops) == public, role  # a new operation joins this test
        for name, call in ops.items():
            drops = tx.drops
            call()
            assert tx.drops == drops + 1, f"{role}.{name}"  # dropped once, and ran again
    assert batches.counts("b1") == {TaskStatus.CANCELLED: 1}
    assert members.workers(0.0) == {}


def test_a_large_batch_stored_over_a_dropping_connection_has_each_line_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch stored a transaction at a time (store/sql_batches.py) rides out a drop under
    every other transaction: each is tried again with the lines it read (its lines a generator,
    read once), and none is lost or stored twice."""
    from corral.store import Batch, MemoryStore, sql_batches
    from corral.store.sql_batches import SqlBatches

    monkeypatch.setattr(sql_batches, "LINES_PER_TX", 3)
    store = MemoryStore()
    tx = Dropping(store._tx)
    batches = SqlBatches(tx, fast().call, time.time, store._insert, lambda: None, store._announce)
    lines = (NewTask(kind="k", model="m", payload={"n": n}, batch_id="b1") for n in range(10))
    b = batches.create(Batch("b1", "in_progress", 1.0, {}), lines)
    assert b.status == "in_progress"
    assert tx.drops >= 4  # the first try of each of its four transactions
    assert store.batches.counts("b1") == {TaskStatus.QUEUED: 10}
    assert sorted(t.payload["n"] for t in store.batches.tasks("b1")) == list(range(10))
    assert store.ready_counts() == {"m": {(False, 0): 10}}
