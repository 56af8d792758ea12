"""SQLite store: the default, embedded, zero set-up.

WAL journal (readers never block the writer), `BEGIN IMMEDIATE` for every write transaction (a
deferred read-then-write would get SQLITE_BUSY at once, ignoring the busy timeout), a busy
timeout, and atomic claims with `UPDATE ... RETURNING`. Safe for several worker processes on one
file; one connection per store object, guarded by a lock for threads.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corral.store.base import Finished, StoreBusy, StoreError
from corral.store.migrations import Dialect
from corral.store.outage import guarded
from corral.store.queries import SQL, load
from corral.store.sql import SqlStore, Tx, start_reserved

DIALECT = Dialect(
    serial_pk="INTEGER PRIMARY KEY AUTOINCREMENT",
    real="REAL",
    new_token="lower(hex(randomblob(16)))",
    lock_skip="",  # one writer at a time: BEGIN IMMEDIATE already serialises claims
)


_SQL = load("sqlite.sql", SQL)  # its own statements (group commit)


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]:
        return list(self._conn.execute(sql, params or {}).fetchall())

    def run_many(self, sql: str, params: Sequence[Mapping[str, Any]]) -> None:
        self._conn.executemany(sql, params)


class SqliteStore(SqlStore):
    dialect = DIALECT

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        migrate: bool = True,
        create: bool = True,
        read_only: bool = False,
    ) -> None:
        """`create`: make the file (and its folders) if missing; `read_only`: open it with
        `mode=ro` (never created, never migrated: its schema must already be this code's)."""
        super().__init__(clock)
        self.path = str(path)
        memory = self.path == ":memory:"
        self.identity = None if memory else f"sqlite:{os.path.realpath(self.path)}"
        if not memory and not Path(self.path).is_file() and (read_only or not create):
            raise StoreError(
                f"no database at {self.path!r} (this command never creates one: check the path, "
                "or create it with `corral db upgrade --db sqlite:///PATH`)"
            )
        try:
            if not memory and not read_only:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            target = f"{Path(self.path).resolve().as_uri()}?mode=ro" if read_only else self.path
            self._conn = sqlite3.connect(
                target,
                timeout=busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
                uri=read_only,
            )
            self._conn.row_factory = sqlite3.Row
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            if not read_only:
                _switch_to_wal(self._conn, busy_timeout_s)
                self._conn.execute("PRAGMA synchronous = NORMAL")
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the SQLite database at {self.path!r}: {exc}") from None
        self._lock = threading.Lock()
        try:
            if read_only:
                self.schema.check()
            elif migrate:
                self.schema.upgrade()
        except sqlite3.DatabaseError as exc:  # not SQLite, or not Corral's, or damaged
            self._conn.close()
            raise StoreError(
                f"cannot use {self.path!r} as Corral's task database: {exc} (is the path right?)"
            ) from None

    @contextmanager
    def _tx(self, write: bool, single: bool = False) -> Iterator[Tx]:
        # Always explicit: BEGIN IMMEDIATE makes a writer wait on the busy timeout up front.
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as exc:
                raise _busy(exc, self.path) from None
            try:
                yield _SqliteTx(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                self._conn.execute("ROLLBACK")
                raise _busy(exc, self.path) from None

    @guarded
    def finish_many(
        self, done: Sequence[Finished], then_start: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        """Two statements in one transaction whatever the group's size: the rows come in as
        one JSON array each (`json_each`), so the per-row cost is SQLite's, not Python's."""
        now = self._clock()
        committed: list[str] = []
        keyed = False
        with self._tx(write=True) as tx:
            if len(then_start) == 1:
                start_reserved(tx, then_start, now)
            elif then_start:
                tx.run(_SQL["start_many"], {"now": now, "items": json.dumps(then_start)})
            if done:
                items = json.dumps([[d.task_id, d.token, d.result_json] for d in done])
                for r in tx.run(_SQL["finish_many"], {"now": now, "items": items}):
                    committed.append(r["id"])
                    keyed = keyed or r["serial_key"] is not None
        if keyed:
            self._woken()
        return committed

    def ping(self) -> None:
        with self._tx(write=False) as tx:
            tx.run(_SQL["ping"])

    def close(self) -> None:
        """Close the connection once no transaction is running on it: a thread still inside
        one (a cancelled task's `to_thread` runs on) would otherwise use a freed connection,
        which crashes the process (SIGSEGV) rather than raising."""
        with self._lock:
            self._conn.close()


def _busy(exc: sqlite3.OperationalError, path: str) -> StoreError:
    if "locked" in str(exc) or "busy" in str(exc):
        return StoreBusy(
            f"the SQLite database {path!r} stayed locked beyond the busy timeout "
            "(another process holds a write transaction); nothing was changed, "
            "retry the operation"
        )
    return StoreError(f"SQLite error on {path!r}: {exc}")


def _switch_to_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> None:
    """Put the database in WAL mode, waiting up to `busy_timeout_s` for other openers.

    SQLite answers `PRAGMA journal_mode = WAL` with "database is locked" at once, without its
    busy handler, while another connection is switching the same new file (22 of 1,000 tries
    of 8 threads on SQLite 3.40): processes started together on a new database must wait here.
    """
    deadline_s = time.monotonic() + busy_timeout_s
    pause_s = 0.002
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline_s:
                raise
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.05)
