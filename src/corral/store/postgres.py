"""PostgreSQL store, for several workers and hosts: `FOR UPDATE SKIP LOCKED` claims, so
concurrent workers never wait on each other's rows. Needs the `postgres` extra (psycopg 3)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from corral.store.base import StoreError
from corral.store.sql import Dialect, SqlStore, Tx

DIALECT = Dialect(
    serial_pk="BIGSERIAL PRIMARY KEY",
    real="DOUBLE PRECISION",
    new_token="replace(gen_random_uuid()::text, '-', '')",
    lock_skip="FOR UPDATE SKIP LOCKED",
)
_PARAM = re.compile(r"(?<!:):([a-z_]+)")


def _pg(sql: str) -> str:
    """`:name` placeholders (shared with SQLite) to psycopg's `%(name)s`."""
    return _PARAM.sub(r"%(\1)s", sql)


class _PgTx:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]:
        cur = self._conn.execute(_pg(sql), params or {})
        return list(cur.fetchall()) if cur.description else []


class PostgresStore(SqlStore):
    dialect = DIALECT

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

    def close(self) -> None:
        self._conn.close()


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
