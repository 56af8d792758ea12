"""PostgreSQL store, for several workers and hosts: `FOR UPDATE SKIP LOCKED` claims, so
concurrent workers never wait on each other's rows, and LISTEN/NOTIFY wake-ups, so an idle worker
hears of new work at once instead of polling hard. Needs the `postgres` extra (psycopg 3)."""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from corral.store.base import Finished, StoreError
from corral.store.sql import _CLAIMABLE, _QUALIFIED, Dialect, SqlStore, Tx

DIALECT = Dialect(
    serial_pk="BIGSERIAL PRIMARY KEY",
    real="DOUBLE PRECISION",
    new_token="replace(gen_random_uuid()::text, '-', '')",
    lock_skip="FOR UPDATE SKIP LOCKED",
    cte_writes=True,
    kind_lock="SELECT pg_advisory_xact_lock(hashtext('corral_kind:' || :kind)) AS x",
)
_PARAM = re.compile(r"(?<!:):([a-z_]+)")
log = logging.getLogger("corral.store")
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


# Group commit (`finish_many`) in one statement: start the next tasks, commit the finished
# ones, and announce a freed serial key, if any, to other processes.
_FINISH_MANY = """
WITH started AS (
    UPDATE corral_tasks SET attempts = attempts + 1, started_at = :now, started_in_group = :grp
    FROM unnest(:s_ids::text[], :s_tokens::text[]) AS s(id, token)
    WHERE corral_tasks.id = s.id AND corral_tasks.status = 'running'
      AND corral_tasks.lease_token = s.token AND corral_tasks.started_at IS NULL
      AND (:grp = 0 OR corral_tasks.run_alone = 0)
    RETURNING corral_tasks.id),
done AS (
    UPDATE corral_tasks SET status = 'succeeded', result = f.result, lease_token = NULL,
        lease_expires_at = NULL, finished_at = :now
    FROM unnest(:ids::text[], :tokens::text[], :results::text[]) AS f(id, token, result)
    WHERE corral_tasks.id = f.id AND corral_tasks.status = 'running'
      AND corral_tasks.lease_token = f.token
    RETURNING corral_tasks.id, corral_tasks.serial_key)
SELECT id, serial_key,
       CASE WHEN serial_key IS NULL THEN NULL ELSE pg_notify(:channel, '') END AS notified
FROM done"""

# The claim. The picked rows' seqs go in one array: the update then finds them through the
# primary key (joined to a ranked subquery instead, the planner hashes the whole table, which
# grows with every stored result). Its commit is asynchronous (`synchronous_commit` off for
# this transaction only): a claim the database loses in a crash only puts tasks back (their
# leases, hence their commits, are gone: at-least-once holds), and a result's synchronous
# commit flushes every claim before it anyway. It spares a WAL flush per claim.
_STARTS = (
    "array_position(p.a, corral_tasks.seq) <= :start "
    "AND (:start <= 1 OR cardinality(p.a) <= 1 OR corral_tasks.run_alone = 0)"
)
_CLAIM = f"""
WITH p AS (SELECT ARRAY(SELECT t.seq FROM corral_tasks t
                        WHERE t.model = :model AND {_CLAIMABLE}
                        ORDER BY t.interactive DESC, t.priority DESC, t.seq
                        LIMIT :limit FOR UPDATE SKIP LOCKED) AS a,
                  set_config('synchronous_commit', 'off', true) AS async_commit)
UPDATE corral_tasks SET status = 'running',
    attempts = attempts + CASE WHEN {_STARTS} THEN 1 ELSE 0 END,
    started_at = CASE WHEN {_STARTS} THEN :now ELSE NULL END,
    started_in_group = CASE WHEN {_STARTS} AND :start > 1 AND cardinality(p.a) > 1
                       THEN 1 ELSE 0 END,
    lease_token = {DIALECT.new_token}, lease_expires_at = :expires, worker_id = :worker
FROM p
WHERE corral_tasks.seq = ANY(p.a)
RETURNING {_QUALIFIED}"""

_INSERT_COLUMNS = (
    "id",
    "kind",
    "model",
    "payload",
    "priority",
    "interactive",
    "serial_key",
    "status",
    "max_attempts",
    "created_at",
    "run_after",
    "batch_id",
)


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
    ) -> None:
        super().__init__(clock)
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError:  # pragma: no cover - depends on the installation
            raise StoreError("PostgreSQL needs psycopg 3: pip install 'corral[postgres]'") from None
        if schema is not None and not re.fullmatch(r"[a-z_][a-z0-9_]*", schema):
            raise StoreError(f"schema must be a lower-case SQL identifier; got {schema!r}")
        self.url = url
        self.schema = schema
        try:
            self._conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
            if schema is not None:
                self._conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                self._conn.execute(f"SET search_path TO {schema}")
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {_redact(url)}: {exc}") from None
        self._lock = threading.Lock()
        # NOTIFY channels are per database: one per schema keeps test schemas apart.
        self._channel = f"corral_{schema or 'public'}"
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        if migrate:
            self.upgrade()

    @contextmanager
    def _tx(self, write: bool, single: bool = False) -> Iterator[Tx]:
        import psycopg

        with self._lock:
            try:
                if single:  # autocommit: one statement is its own transaction, one round trip
                    yield _PgTx(self._conn)
                else:
                    with self._conn.transaction():
                        yield _PgTx(self._conn)
            except psycopg.Error as exc:
                raise StoreError(f"PostgreSQL error: {exc}") from exc

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        """COPY for more than a few rows: one stream, rows encoded in C (a pipelined executemany
        still plans and sends a statement per row)."""
        if len(rows) < 8 or not isinstance(tx, _PgTx):
            super()._insert(tx, rows)
            return
        tx.copy_rows("corral_tasks", _INSERT_COLUMNS, rows)

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
            rows = tx.run(_FINISH_MANY, params)
        committed = [r["id"] for r in rows]
        if any(r["serial_key"] is not None for r in rows):
            self._wakeups.fire()  # the statement announced it to other processes
        return committed

    def _claim_sql(self) -> str:
        return _CLAIM

    def _announce(self, tx: Tx) -> None:
        tx.run("SELECT pg_notify(:channel, '')", {"channel": self._channel})

    def _notify_sql(self) -> str:
        return f"SELECT pg_notify('{self._channel}', '') AS notified"

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

        while not self._closing.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {self._channel}")
                    self._wakeups.fire()
                    while not self._closing.is_set():
                        for _ in conn.notifies(timeout=_LISTEN_TICK_S):
                            self._wakeups.fire()
            except psycopg.Error as exc:
                log.warning("LISTEN %s failed (%s); retrying in 1 s", self._channel, exc)
                self._closing.wait(1.0)

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            self._listener.join(timeout=2 * _LISTEN_TICK_S)
        self._conn.close()


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
