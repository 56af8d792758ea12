"""The store's SQL, named: `SQL` holds the statements of queries.sql (`load` reads a dialect's
file beside its adapter); rows turned into the store's types; the transaction Protocols."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any, Protocol

from corral.store.base import Batch, NewTask, StoredFile, Task, TaskStatus, new_ids


class Tx(Protocol):
    """One open transaction: run a statement with named parameters, get rows as mappings."""

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]: ...

    def run_many(self, sql: str, params: Sequence[Mapping[str, Any]]) -> None:
        """Run one statement per parameter set, batched by the driver (no rows back)."""
        ...


class Transactions(Protocol):
    """Opens a transaction (the SQL store's `_tx`). `single`: the caller runs exactly one
    statement, which is atomic on its own, so an adapter may skip BEGIN/COMMIT round trips."""

    def __call__(self, write: bool, single: bool = False) -> AbstractContextManager[Tx]: ...


_ENTRY = re.compile(r"^-- name: (\w+)\n((?:--[^\n]*\n)*)(.*?)(?=^-- name: |\Z)", re.S | re.M)
_INCLUDE = re.compile(r"\{(\w+)\}")


def load(filename: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The named statements of `filename`, a file of this package (see `parse`)."""
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    return parse(text, filename, base)


def parse(text: str, filename: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each `-- name: x` entry of `text`, its leading comment lines dropped. `{y}` includes
    entry `y` of this text or of `base`; other `{...}` are left for the caller to fill in."""
    entries = [(m[1], m[3].strip().removesuffix(";")) for m in _ENTRY.finditer(text)]
    raw = dict(entries)
    if len(raw) != len(entries):  # a second entry of one name would hide the first
        raise ValueError(f"{filename}: an entry name appears twice")
    known = {**(base or {}), **raw}

    def expand(sql: str) -> str:
        return _INCLUDE.sub(lambda m: expand(known[m[1]]) if m[1] in known else m[0], sql)

    return {name: expand(sql) for name, sql in raw.items()}


SQL = load("queries.sql")


def to_task(row: Mapping[str, Any]) -> Task:
    return Task(
        id=row["id"],
        seq=int(row["seq"]),
        kind=row["kind"],
        model=row["model"],
        payload=json.loads(row["payload"]),
        priority=int(row["priority"]),
        interactive=bool(row["interactive"]),
        serial_key=row["serial_key"],
        status=TaskStatus(row["status"]),
        attempts=int(row["attempts"]),
        max_attempts=int(row["max_attempts"]),
        created_at=float(row["created_at"]),
        run_after=float(row["run_after"]),
        lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"],
        worker_id=row["worker_id"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        result=None if row["result"] is None else json.loads(row["result"]),
        error=row["error"],
        errors=json.loads(row["errors"]),
        cancel_requested=bool(row["cancel_requested"]),
        batch_id=row["batch_id"],
        started_in_group=bool(row["started_in_group"]),
        run_alone=bool(row["run_alone"]),
    )


def to_file(row: Mapping[str, Any]) -> StoredFile:
    return StoredFile(
        id=row["id"],
        purpose=row["purpose"],
        filename=row["filename"],
        bytes=int(row["bytes"]),
        created_at=float(row["created_at"]),
        path=row["path"],
        expires_at=None if row["expires_at"] is None else float(row["expires_at"]),
        owner=row["owner"],
    )


def to_batch(row: Mapping[str, Any]) -> Batch:
    return Batch(
        id=row["id"],
        status=row["status"],
        created_at=float(row["created_at"]),
        data=json.loads(row["data"]),
        idempotency_key=row["idempotency_key"],
        seq=int(row["seq"]),
        owner=row["owner"],
    )


def task_rows(
    tasks: Sequence[NewTask], now: float, run_after: float | None = None
) -> list[dict[str, Any]]:
    """`INSERT`'s parameters for `tasks`, every payload validated before any is stored; due
    now unless `run_after` says when."""
    return [
        {
            "id": tid,
            "kind": t.kind,
            "model": t.model,
            "payload": t.payload_json(),
            "priority": t.priority,
            "interactive": int(t.interactive),
            "serial_key": t.serial_key,
            "status": "queued",
            "max_attempts": t.max_attempts,
            "created_at": now,
            "run_after": now if run_after is None else run_after,
            "batch_id": t.batch_id,
            "turn": t.turn,
        }
        for t, tid in zip(tasks, new_ids(len(tasks)), strict=True)
    ]


def in_list(prefix: str, values: Sequence[str], params: dict[str, Any]) -> str:
    """Placeholders for an IN list, their values added to `params` (names are letters: the
    PostgreSQL adapter's parameter names have no digits)."""
    names = [f"{prefix}_{_letters(i)}" for i in range(len(values))]
    params.update(zip(names, values, strict=True))
    return ", ".join(f":{n}" for n in names) or "NULL"


def _letters(i: int) -> str:
    """`i` in base 26 with the letters a-z (0 -> "a", 25 -> "z", 26 -> "ba"): any number of
    placeholders gets distinct names without digits."""
    out = chr(ord("a") + i % 26)
    while i >= 26:
        i //= 26
        out = chr(ord("a") + i % 26) + out
    return out


def page(
    table: str, after: str | None, limit: int, order: str = "desc"
) -> tuple[str, dict[str, Any]]:
    """Paging by a cursor id: rows past `after` in `order` (newest first by default), all rows
    without one, none if no row has that id."""
    params: dict[str, Any] = {"limit": limit}
    if after is None:
        return "1 = 1", params
    params["after"] = after
    past = ">" if order == "asc" else "<"
    return f"seq {past} (SELECT seq FROM {table} WHERE id = :after)", params


def task_filters(status: TaskStatus | None, model: str | None) -> tuple[str, dict[str, Any]]:
    """A WHERE clause over tasks' status and model, and its parameters."""
    clauses, params = [], {}
    if status is not None:
        clauses.append("status = :status")
        params["status"] = status.value
    if model is not None:
        clauses.append("model = :model")
        params["model"] = model
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def run_one(
    transactions: Transactions,
    sql: str,
    params: Mapping[str, Any] | None = None,
    *,
    write: bool = False,
) -> list[Mapping[str, Any]]:
    """One statement in a transaction of its own; its rows."""
    with transactions(write=write, single=True) as tx:
        return tx.run(sql, params)
