"""Durable task storage behind one Protocol: memory, SQLite (default) and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from corral.store.base import (
    MAX_PAYLOAD_BYTES,
    AuditEntry,
    BadTask,
    Batch,
    BatchNotFound,
    FileNotFound,
    Finished,
    Lease,
    Level,
    NewTask,
    QueueFull,
    Residency,
    SchemaTooNew,
    StoreBusy,
    StoredFile,
    StoreError,
    StoreUnavailable,
    Task,
    TaskNotFound,
    TaskStatus,
    UsageRow,
    payload_text,
)
from corral.store.memory import MemoryStore
from corral.store.roles import (
    Audit,
    BatchStore,
    FileStore,
    Membership,
    Schema,
    Store,
    TaskControl,
    TaskQueue,
    UsageBook,
)
from corral.store.wakeups import Wakeups

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "Audit",
    "AuditEntry",
    "BadTask",
    "Batch",
    "BatchNotFound",
    "BatchStore",
    "FileNotFound",
    "FileStore",
    "Finished",
    "Lease",
    "Level",
    "Membership",
    "MemoryStore",
    "NewTask",
    "QueueFull",
    "Residency",
    "Schema",
    "SchemaTooNew",
    "Store",
    "StoreBusy",
    "StoreError",
    "StoreUnavailable",
    "StoredFile",
    "Task",
    "TaskControl",
    "TaskNotFound",
    "TaskQueue",
    "TaskStatus",
    "UsageBook",
    "UsageRow",
    "Wakeups",
    "open_store",
    "payload_text",
]


POSTGRES_SCHEMES = ("postgresql://", "postgres://")  # a store other hosts can share


def open_store(
    url: str, *, migrate: bool = True, create: bool = True, read_only: bool = False
) -> Store:
    """A store by URL: `memory://`, `sqlite:///relative.db`, `sqlite:////absolute.db`,
    `postgresql://user@host/db` (optionally `?schema=name` for a schema of its own). SQL stores
    apply pending migrations on open unless `migrate` is False. `create=False`: a SQLite file
    must exist already; `read_only`: it is opened read-only (never created or migrated)."""
    if url == "memory://":
        return MemoryStore()
    if url.startswith("sqlite:///"):
        from corral.store.sqlite import SqliteStore

        path = url[len("sqlite:///") :]
        if not path:
            raise StoreError("sqlite URL needs a path: sqlite:///tasks.db")
        return SqliteStore(Path(path), migrate=migrate, create=create, read_only=read_only)
    if url.startswith(POSTGRES_SCHEMES):
        from corral.store.postgres import PostgresStore

        base, _, query = url.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        schema = params.pop("schema", None)
        rest = "&".join(f"{k}={v}" for k, v in params.items())
        url = base + (f"?{rest}" if rest else "")
        return PostgresStore(url, schema=schema, migrate=migrate and not read_only)
    raise StoreError(
        f"unknown store URL {url!r}; use sqlite:///tasks.db, postgresql://host/db or memory://"
    )
