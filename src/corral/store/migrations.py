"""The store's schema: the numbered migrations of migrations.sql in each SQL dialect, `Schema`
(the store's `schema`: its version, checking it, applying the steps a database lacks, in
order), and the few phrases that differ between dialects."""

from __future__ import annotations

from dataclasses import dataclass

from corral.store.base import SchemaTooNew, StoreError
from corral.store.outage import Guard
from corral.store.queries import SQL, Transactions, load


@dataclass(frozen=True)
class Dialect:
    serial_pk: str  # the auto-increment primary key column
    real: str  # a double-precision float column
    new_token: str  # an expression giving a fresh random token per row
    lock_skip: str  # appended to the claim's inner SELECT ("" or "FOR UPDATE SKIP LOCKED")
    # Whether a WITH clause may hold an UPDATE: lets a commit and the next task's start share
    # one statement (one round trip on a networked database; SQLite needs none).
    cte_writes: bool = False
    # A statement taking a transaction-scoped lock on `:kind` (bounded kinds' submits), or ""
    # where write transactions are serialised already.
    kind_lock: str = ""
    # A statement taking a transaction-scoped lock on migrating this schema (several processes
    # starting at once on a new database), or "" where write transactions are serialised.
    migrate_lock: str = ""


def migrations(d: Dialect) -> list[tuple[int, str]]:
    """(version, SQL) in order, from migrations.sql (`v1`, `v2`, ...) in `d`'s dialect."""
    steps = load("migrations.sql")
    return [
        (int(name.removeprefix("v")), sql.format(serial_pk=d.serial_pk, real=d.real))
        for name, sql in steps.items()
    ]


class Schema:
    """The store's schema (the `Schema` role): its version, checking it, applying what is
    missing. Each operation runs under the store's guard: each checks the version in its own
    transactions, so it may run again."""

    def __init__(self, transactions: Transactions, dialect: Dialect, guard: Guard) -> None:
        self._tx = transactions
        self._dialect = dialect
        self._guard = guard

    def version(self) -> int:
        return self._guard("schema.version", self._version)

    def _version(self) -> int:
        with self._tx(write=False) as tx:
            tx.run(SQL["schema_table"])
            rows = tx.run(SQL["schema_version"])
            return int(rows[0]["v"] or 0)

    def check(self) -> None:
        """For a store opened without migrating, read-only: its schema must be this code's
        (reads name columns that older schemas lack). Writes nothing."""
        self._guard("schema.check", self._check)

    def _check(self) -> None:
        latest = migrations(self._dialect)[-1][0]
        with self._tx(write=False) as tx:
            rows = tx.run(SQL["schema_version"])
        current = int(rows[0]["v"] or 0)
        if current > latest:
            raise SchemaTooNew(
                f"the database is at schema version {current} but this Corral knows up to "
                f"{latest}; upgrade Corral or use another database"
            )
        if current < latest:
            raise StoreError(
                f"the database is at schema version {current}, this Corral reads {latest}: run "
                "`corral db upgrade` first (read-only commands never change the database)"
            )

    def upgrade(self) -> list[int]:
        """Apply pending migrations, each in its own transaction; returns the versions applied.
        Raises `SchemaTooNew` if the database is ahead of this code."""
        return self._guard("schema.upgrade", self._upgrade)

    def _upgrade(self) -> list[int]:
        steps = migrations(self._dialect)
        latest = steps[-1][0]
        lock = self._dialect.migrate_lock
        with self._tx(write=True) as tx:
            if lock:
                tx.run(lock)
            tx.run(SQL["schema_table"])
        current = self._version()
        if current > latest:
            raise SchemaTooNew(
                f"the database is at schema version {current} but this Corral knows up to "
                f"{latest}; upgrade Corral (pip install -U corral) or use another database"
            )
        return [v for v, sql in steps if v > current and self._apply(v, sql)]

    def _apply(self, version: int, sql: str) -> bool:
        """Apply one step; False if another process did meanwhile."""
        with self._tx(write=True) as tx:
            # Under the lock, look again: a process starting beside this one (a second
            # worker, another node) may have applied it meanwhile.
            if self._dialect.migrate_lock:
                tx.run(self._dialect.migrate_lock)
            rows = tx.run(SQL["schema_version"])
            if int(rows[0]["v"] or 0) >= version:
                return False
            for statement in filter(str.strip, sql.split(";")):
                tx.run(statement)
            tx.run(SQL["record_version"], {"v": version})
        return True
