"""PostgreSQL store, for several workers and hosts: `FOR UPDATE SKIP LOCKED` claims, so
concurrent workers never wait on each other's rows, and LISTEN/NOTIFY wake-ups, so an idle worker
hears of new work at once instead of polling hard. Connections come from a pool
(`psycopg_pool`); an operation whose connection drops is tried again on a fresh one for up to
`patience_s` (`store/outage.py` says which may be). Needs the `postgres` extra (psycopg 3)."""

from __future__ import annotations

import builtins
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from corral.store.base import (
    Finished,
    StoreError,
    StoreUnavailable,
    Task,
    new_ids,
)
from corral.store.migrations import Dialect
from corral.store.outage import Lost, Outage, guarded
from corral.store.queries import SQL, load
from corral.store.sql import SqlStore, Tx, claimed

_SQL = load("postgres.sql", SQL)  # its own statements: the claim, group commit, NOTIFY

DIALECT = Dialect(
    serial_pk="BIGSERIAL PRIMARY KEY",
    real="DOUBLE PRECISION",
    new_token="replace(gen_random_uuid()::text, '-', '')",
    lock_skip="FOR UPDATE SKIP LOCKED",
    cte_writes=True,
    kind_lock=_SQL["kind_lock"],
    migrate_lock=_SQL["migrate_lock"],
)
_PARAM = re.compile(r"(?<!:):([a-z_]+)")
log = logging.getLogger("corral.store")
# The pool logs every failed reconnection attempt (twice a second through an outage); the
# store's own lines say when the database became unreachable and when it was back.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
_LISTEN_TICK_S = 0.1  # how often the listener checks whether the store is closing


@functools.lru_cache(maxsize=256)
def _pg(sql: str) -> str:
    """`:name` placeholders (shared with SQLite) to psycopg's `%(name)s` (cached: the store's
    statements are a few fixed texts, and the rewrite cost a third of a single enqueue's own
    time)."""
    return _PARAM.sub(r"%(\1)s", sql)


class _PgTx:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]:
        cur = self._conn.execute(_pg(sql), params or {})
        return list(cur.fetchall()) if cur.description else []

    def copy_rows(
        self, table: str, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]
    ) -> None:
        with (
            self._conn.cursor() as cur,
            cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy,
        ):
            for r in rows:
                copy.write_row([r[c] for c in columns])

    def run_many(self, sql: str, params: Sequence[Mapping[str, Any]]) -> None:
        with self._conn.cursor() as cur:  # psycopg pipelines executemany: no round trip per row
            cur.executemany(_pg(sql), params)


class PostgresStore(SqlStore):
    dialect = DIALECT
    wakes_other_processes = True

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        clock: Callable[[], float] = time.time,
        migrate: bool = True,
        pool_size: int = 4,
        patience_s: float = 30.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        """`pool_size`: connections at most (threads of one process run transactions side by
        side); `patience_s`: how long an operation keeps trying through an outage before
        `StoreUnavailable`; `connect_timeout_s`: for each connection attempt (the first one, at
        start, fails with `StoreError` after it)."""
        self.outage = Outage(f"PostgreSQL at {_redact(url)}", patience_s)
        super().__init__(clock, guard=self.outage.call)
        try:
            import psycopg
            from psycopg.rows import dict_row
            from psycopg_pool import ConnectionPool
        except ImportError:  # pragma: no cover - depends on the installation
            raise StoreError("PostgreSQL needs psycopg 3: pip install 'corral[postgres]'") from None
        if schema is not None and not re.fullmatch(r"[a-z_][a-z0-9_]*", schema):
            raise StoreError(f"schema must be a lower-case SQL identifier; got {schema!r}")
        self.url = url
        self.namespace = schema  # the PostgreSQL schema its tables live in (None: public)
        self.connect_timeout_s = connect_timeout_s
        try:  # the schema first, so that every pooled connection can use it
            with psycopg.connect(url, connect_timeout=max(1, round(connect_timeout_s))) as conn:
                conn.autocommit = True
                if schema is not None:  # one at a time: at once, two would collide
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (schema,))
                        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                info = conn.info
                self.identity = (
                    f"postgresql:{info.hostaddr or info.host}:{info.port}/{info.dbname}/"
                    f"{schema or ''}"
                )
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {_redact(url)}: {exc}") from None

        def configure(conn: Any) -> None:
            if schema is not None:
                conn.execute(f"SET search_path TO {schema}")

        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, pool_size),
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                "connect_timeout": max(1, round(connect_timeout_s)),
                # A peer gone silent (a cut network path, a host that died) is noticed in
                # about 20 s rather than never.
                "keepalives": 1,
                "keepalives_idle": 10,
                "keepalives_interval": 5,
                "keepalives_count": 2,
            },
            configure=configure,
            open=False,
            name=f"corral-{schema or 'public'}",
            reconnect_timeout=float("inf"),  # keep trying in the background through an outage
        )
        self._pool.open()
        self._lock = threading.Lock()
        # NOTIFY channels are per database: one per schema keeps test schemas apart.
        self._channel = f"corral_{schema or 'public'}"
        self._notify = _SQL["notify"].format(channel=self._channel)
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        if migrate:
            try:
                self.schema.upgrade()
            except BaseException:  # a schema too new, an unreachable database: no pool left open
                self._pool.close()
                raise

    @contextmanager
    def _tx(self, write: bool, single: bool = False) -> Iterator[Tx]:
        """A pooled connection's transaction. A dropped connection raises `Lost` (for
        `self.outage`, which tries again); `maybe_done` when it dropped during the commit (a
        single statement is its own commit)."""
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            conn = self._pool.getconn(timeout=self.connect_timeout_s)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            raise Lost(exc, maybe_done=False) from exc
        committing = single
        try:
            if single:  # autocommit: one statement is its own transaction, one round trip
                yield _PgTx(conn)
            else:
                with conn.transaction():
                    yield _PgTx(conn)
                    committing = True
        except psycopg.OperationalError as exc:
            if conn.broken or conn.closed:
                raise Lost(exc, maybe_done=committing) from exc
            raise StoreError(f"PostgreSQL error: {exc}") from exc
        except psycopg.Error as exc:
            raise StoreError(f"PostgreSQL error: {exc}") from exc
        finally:
            self._pool.putconn(conn)  # a broken one is dropped, and replaced in the background

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        """COPY for more than a few rows: one stream, rows encoded in C (a pipelined executemany
        still plans and sends a statement per row)."""
        if len(rows) < 8 or not isinstance(tx, _PgTx):
            super()._insert(tx, rows)
            return
        tx.copy_rows("corral_tasks", tuple(rows[0]), rows)  # `task_rows`' columns, all of them

    @guarded
    def finish_many(
        self, done: Sequence[Finished], then_start: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        """One statement, so one round trip and one WAL flush for the whole group: the starts
        and the commits, each row fenced by its own token (`unnest` pairs them up)."""
        if not done and not then_start:
            return []
        now = self._clock()
        params: dict[str, Any] = {
            "now": now,
            "ids": [d.task_id for d in done],
            "tokens": [d.token for d in done],
            "results": [d.result_json for d in done],
            "s_ids": [t[0] for t in then_start],
            "s_tokens": [t[1] for t in then_start],
            "grp": int(len(then_start) > 1),
            "channel": self._channel,
        }
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(_SQL["finish_many"], params)
        committed = [r["id"] for r in rows]
        if any(r["serial_key"] is not None for r in rows):
            self._wakeups.fire()  # the statement announced it to other processes
        return committed

    def _announce(self, tx: Tx) -> None:
        tx.run(_SQL["announce"], {"channel": self._channel})

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        remove = super().subscribe(wake)
        with self._lock:
            if self._listener is None:
                self._listener = threading.Thread(
                    target=self._listen, name=f"{self._channel}-listener", daemon=True
                )
                self._listener.start()
        return remove

    def _listen(self) -> None:
        """LISTEN on a connection of its own; every notification (and every reconnect, which
        may have missed some) wakes the subscribers. Polling stays as the safety net."""
        import psycopg

        failing = False
        while not self._closing.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {self._channel}")
                    failing = False
                    self._wakeups.fire()
                    while not self._closing.is_set():
                        for _ in conn.notifies(timeout=_LISTEN_TICK_S):
                            self._wakeups.fire()
            except psycopg.Error as exc:
                if not failing:  # once per outage: the store's own line says when it ends
                    log.warning(
                        "LISTEN %s lost (%s); reconnecting every 1 s, polling meanwhile",
                        self._channel,
                        " ".join(str(exc).split()),
                    )
                failing = True
                self._closing.wait(1.0)

    def ping(self) -> None:
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            conn = self._pool.getconn(timeout=min(1.0, self.connect_timeout_s))
            try:
                conn.execute("SELECT 1")
            finally:
                self._pool.putconn(conn)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            down = self.outage.down_since
            since = f" (for {time.monotonic() - down:.0f} s)" if down is not None else ""
            why = " ".join(str(exc).split())
            raise StoreUnavailable(f"{self.outage.name} is unreachable{since}: {why}") from None

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            self._listener.join(timeout=2 * _LISTEN_TICK_S)
        self._pool.close()

    # --- through an outage (store/outage.py) --------------------------------------------------
    def claim(
        self,
        model: str,
        worker_id: str,
        limit: int,
        lease_s: float,
        start: int | None = None,
        group: bool = False,
    ) -> builtins.list[Task]:
        nonce = new_ids(1)[0]
        params = {
            "worker": worker_id,
            "model": model,
            "limit": limit,
            "start": limit if start is None else start,
            "grp": int(group),
            "nonce": nonce,
        }
        return self.outage.call(
            "a claim",
            lambda: claimed(self._tx, _SQL["claim"], params, self._clock(), lease_s),
            idempotent=False,
            # what it leased, if it did
            resolve=lambda: (
                claimed(self._tx, _SQL["claimed"], params, self._clock(), lease_s) or None
            ),
        )


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
