"""Riding out a database outage (store/outage.py): which operations run again, and when."""

from __future__ import annotations

import logging

import pytest

from corral.store import StoreUnavailable
from corral.store.outage import Lost, Outage


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


def test_every_store_operation_on_postgresql_rides_out_an_outage() -> None:
    """A dropped connection must never escape as `Lost`: each operation of the Store Protocol
    is wrapped (tried again) or overridden by PostgresStore."""
    from corral.store.base import Store
    from corral.store.postgres import PostgresStore
    from corral.store.sql import SqlStore

    ops = [  # every role's (Store is their union: TaskQueue, TaskControl, Membership, ...)
        name
        for role in Store.__mro__
        if role.__module__ == Store.__module__
        for name, value in vars(role).items()
        if callable(value) and not name.startswith("_")
        and name not in ("subscribe", "close", "ping")  # no database, or no retrying by design
    ]  # fmt: skip
    assert len(ops) > 30
    bare = [n for n in ops if getattr(PostgresStore, n) is getattr(SqlStore, n, None)]
    assert not bare
