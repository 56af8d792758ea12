"""The store's schema, as numbered migrations per SQL dialect (`SqlStore.upgrade` applies the
ones a database lacks, in order), and the few phrases that differ between dialects."""

from __future__ import annotations

from dataclasses import dataclass

from corral.store.base import SchemaTooNew, StoreError
from corral.store.queries import Transactions


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
    """(version, SQL) in order. Never edit a shipped step: add the next one."""
    return [
        (
            1,
            f"""
CREATE TABLE corral_tasks (
    seq {d.serial_pk},
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    payload TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    serial_key TEXT,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    created_at {d.real} NOT NULL,
    run_after {d.real} NOT NULL,
    lease_token TEXT,
    lease_expires_at {d.real},
    worker_id TEXT,
    started_at {d.real},
    finished_at {d.real},
    result TEXT,
    error TEXT,
    errors TEXT NOT NULL DEFAULT '[]',
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    batch_id TEXT
);
CREATE INDEX corral_tasks_claim ON corral_tasks (model, status, priority DESC, seq);
CREATE INDEX corral_tasks_serial ON corral_tasks (serial_key, status);
CREATE INDEX corral_tasks_lease ON corral_tasks (status, lease_expires_at);
""",
        ),
        (
            2,
            # Partial indexes: a task sits in each only while it matters (queued for claims,
            # running for leases, keyed for serial keys), so committing a result touches one
            # index entry instead of six: less WAL per task, smaller indexes.
            """
DROP INDEX corral_tasks_claim;
DROP INDEX corral_tasks_serial;
DROP INDEX corral_tasks_lease;
CREATE INDEX corral_tasks_queued ON corral_tasks (model, priority DESC, seq)
    WHERE status = 'queued';
CREATE INDEX corral_tasks_serial ON corral_tasks (serial_key, status)
    WHERE serial_key IS NOT NULL;
CREATE INDEX corral_tasks_running ON corral_tasks (lease_expires_at) WHERE status = 'running';
""",
        ),
        (
            3,
            # The Batch API: files (bytes on disk, records here) and batches, whose lines are
            # tasks with a batch_id.
            f"""
CREATE TABLE corral_files (
    seq {d.serial_pk},
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at {d.real} NOT NULL,
    path TEXT NOT NULL
);
CREATE TABLE corral_batches (
    seq {d.serial_pk},
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    created_at {d.real} NOT NULL,
    idempotency_key TEXT UNIQUE,
    data TEXT NOT NULL
);
CREATE INDEX corral_tasks_batch ON corral_tasks (batch_id, seq) WHERE batch_id IS NOT NULL;
""",
        ),
        (
            4,
            # Service classes: interactive tasks are claimed before batch ones (existing tasks
            # are batch work, the queue's default).
            """
ALTER TABLE corral_tasks ADD COLUMN interactive INTEGER NOT NULL DEFAULT 0;
DROP INDEX corral_tasks_queued;
CREATE INDEX corral_tasks_queued ON corral_tasks (model, interactive DESC, priority DESC, seq)
    WHERE status = 'queued';
""",
        ),
        (
            5,
            # Files that expire (the Batch API's `expires_after`).
            f"ALTER TABLE corral_files ADD COLUMN expires_at {d.real};",
        ),
        (
            6,
            # Live workers and the models they serve, so that work nobody serves is reported.
            f"""
CREATE TABLE corral_workers (
    id TEXT PRIMARY KEY,
    models TEXT NOT NULL,
    seen_at {d.real} NOT NULL
);
""",
        ),
        (
            7,
            # Group commit: tasks started together, and tasks that must run alone (see
            # store.base: a grouped task's attempt does not count if its worker dies).
            """
ALTER TABLE corral_tasks ADD COLUMN started_in_group INTEGER NOT NULL DEFAULT 0;
ALTER TABLE corral_tasks ADD COLUMN run_alone INTEGER NOT NULL DEFAULT 0;
""",
        ),
        (
            8,
            # Which worker holds which model on which device: a cluster of workers on one
            # database loads each model where it costs least, once (model affinity).
            f"""
CREATE TABLE corral_residency (
    worker_id TEXT NOT NULL,
    device TEXT NOT NULL,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    seen_at {d.real} NOT NULL,
    PRIMARY KEY (worker_id, model)
);
""",
        ),
        (
            9,
            # Where a worker that is a `corral serve` node is reached: nodes forward requests
            # for a model to the node that holds it.
            "ALTER TABLE corral_workers ADD COLUMN url TEXT;",
        ),
    ]


# --- applying them (the SQL store calls these with its transactions) ----------------------
def schema_version(transaction: Transactions) -> int:
    with transaction(write=False) as tx:
        tx.run("CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)")
        rows = tx.run("SELECT MAX(version) AS v FROM corral_schema")
        return int(rows[0]["v"] or 0)


def check_schema(transaction: Transactions, dialect: Dialect) -> None:
    """For a store opened without migrating, read-only: its schema must be this code's
    (reads name columns that older schemas lack). Writes nothing."""
    latest = migrations(dialect)[-1][0]
    with transaction(write=False) as tx:
        rows = tx.run("SELECT MAX(version) AS v FROM corral_schema")
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


def upgrade(transaction: Transactions, dialect: Dialect) -> list[int]:
    """Apply pending migrations, each in its own transaction; returns the versions applied.
    Raises `SchemaTooNew` if the database is ahead of this code."""
    steps = migrations(dialect)
    latest = steps[-1][0]
    applied = []
    lock = dialect.migrate_lock
    with transaction(write=True) as tx:
        if lock:
            tx.run(lock)
        tx.run("CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)")
    current = schema_version(transaction)
    if current > latest:
        raise SchemaTooNew(
            f"the database is at schema version {current} but this Corral knows up to "
            f"{latest}; upgrade Corral (pip install -U corral) or use another database"
        )
    for version, sql in steps:
        if version <= current:
            continue
        with transaction(write=True) as tx:
            # Under the lock, look again: a process starting beside this one (a second
            # worker, another node) may have applied it meanwhile.
            if lock:
                tx.run(lock)
            rows = tx.run("SELECT MAX(version) AS v FROM corral_schema")
            if int(rows[0]["v"] or 0) >= version:
                continue
            for statement in filter(str.strip, sql.split(";")):
                tx.run(statement)
            tx.run("INSERT INTO corral_schema (version) VALUES (:v)", {"v": version})
        applied.append(version)
    return applied
