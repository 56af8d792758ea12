"""One implementation of the store's SQL for every SQL dialect; adapters supply a connection,
transactions and the few phrases that differ (see `Dialect`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from corral.store.base import Lease, NewTask, SchemaTooNew, Task, TaskNotFound, TaskStatus

_COLUMNS = (
    "seq, id, kind, model, payload, priority, serial_key, status, attempts, max_attempts, "
    "created_at, run_after, lease_token, lease_expires_at, worker_id, started_at, finished_at, "
    "result, error, errors, cancel_requested, batch_id"
)


@dataclass(frozen=True)
class Dialect:
    serial_pk: str  # the auto-increment primary key column
    real: str  # a double-precision float column
    new_token: str  # an expression giving a fresh random token per row
    lock_skip: str  # appended to the claim's inner SELECT ("" or "FOR UPDATE SKIP LOCKED")


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
    ]


class Tx(Protocol):
    """One open transaction: run a statement with named parameters, get rows as mappings."""

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]: ...


# A queued task `claim` may take now: due, and first of its serial key with none running.
_CLAIMABLE = """t.status = 'queued' AND t.run_after <= :now
      AND (t.serial_key IS NULL OR (
        NOT EXISTS (SELECT 1 FROM corral_tasks r
                    WHERE r.serial_key = t.serial_key AND r.status = 'running')
        AND t.seq = (SELECT MIN(q.seq) FROM corral_tasks q
                     WHERE q.serial_key = t.serial_key AND q.status = 'queued')))"""


def _task(row: Mapping[str, Any]) -> Task:
    return Task(
        id=row["id"],
        seq=int(row["seq"]),
        kind=row["kind"],
        model=row["model"],
        payload=json.loads(row["payload"]),
        priority=int(row["priority"]),
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
    )


class SqlStore:
    """The `Store` over SQL. Subclasses implement `_tx(write)` and set `dialect`."""

    dialect: Dialect

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock

    def _tx(self, write: bool, single: bool = False) -> AbstractContextManager[Tx]:
        """A transaction. `single`: the caller runs exactly one statement, which is atomic on
        its own, so an adapter may skip BEGIN/COMMIT round trips."""
        raise NotImplementedError

    # --- schema -------------------------------------------------------------------------------
    def schema_version(self) -> int:
        with self._tx(write=False) as tx:
            tx.run("CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)")
            rows = tx.run("SELECT MAX(version) AS v FROM corral_schema")
            return int(rows[0]["v"] or 0)

    def upgrade(self) -> list[int]:
        """Apply pending migrations, each in its own transaction; returns the versions applied.
        Raises `SchemaTooNew` if the database is ahead of this code."""
        steps = migrations(self.dialect)
        latest = steps[-1][0]
        applied = []
        with self._tx(write=True) as tx:
            tx.run("CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)")
        current = self.schema_version()
        if current > latest:
            raise SchemaTooNew(
                f"the database is at schema version {current} but this Corral knows up to "
                f"{latest}; upgrade Corral (pip install -U corral) or use another database"
            )
        for version, sql in steps:
            if version <= current:
                continue
            with self._tx(write=True) as tx:
                for statement in filter(str.strip, sql.split(";")):
                    tx.run(statement)
                tx.run("INSERT INTO corral_schema (version) VALUES (:v)", {"v": version})
            applied.append(version)
        return applied

    # --- writes -------------------------------------------------------------------------------
    def enqueue(self, task: NewTask) -> str:
        return self.enqueue_many([task])[0]

    def enqueue_many(self, tasks: Sequence[NewTask]) -> list[str]:
        rows = [(t, t.payload_json(), uuid.uuid4().hex) for t in tasks]  # validate first
        now = self._clock()
        with self._tx(write=True) as tx:
            self._insert(
                tx,
                [
                    {
                        "id": tid,
                        "kind": t.kind,
                        "model": t.model,
                        "payload": payload,
                        "priority": t.priority,
                        "serial_key": t.serial_key,
                        "status": "queued",
                        "max_attempts": t.max_attempts,
                        "created_at": now,
                        "run_after": now,
                        "batch_id": t.batch_id,
                    }
                    for t, payload, tid in rows
                ],
            )
        return [tid for _, _, tid in rows]

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            tx.run(
                "INSERT INTO corral_tasks (id, kind, model, payload, priority, serial_key, "
                "status, max_attempts, created_at, run_after, batch_id) VALUES (:id, :kind, "
                ":model, :payload, :priority, :serial_key, :status, :max_attempts, :created_at, "
                ":run_after, :batch_id)",
                row,
            )

    def claim(self, model: str, worker_id: str, limit: int, lease_s: float) -> list[Task]:
        now = self._clock()
        sql = f"""
UPDATE corral_tasks SET status = 'running', attempts = attempts + 1,
    lease_token = {self.dialect.new_token}, lease_expires_at = :expires, worker_id = :worker,
    started_at = :now
WHERE seq IN (
    SELECT t.seq FROM corral_tasks t
    WHERE t.model = :model AND {_CLAIMABLE}
    ORDER BY t.priority DESC, t.seq
    LIMIT :limit {self.dialect.lock_skip})
RETURNING {_COLUMNS}"""
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(
                sql,
                {
                    "expires": now + lease_s,
                    "worker": worker_id,
                    "now": now,
                    "model": model,
                    "limit": limit,
                },
            )
        return sorted((_task(r) for r in rows), key=lambda t: (-t.priority, t.seq))

    def _update_held(
        self, task_id: str, token: str, sets: str, params: dict[str, Any]
    ) -> list[Mapping[str, Any]]:
        sql = (
            f"UPDATE corral_tasks SET {sets} WHERE id = :id AND status = 'running' "
            f"AND lease_token = :token RETURNING cancel_requested"
        )
        with self._tx(write=True, single=True) as tx:
            return tx.run(sql, {"id": task_id, "token": token, **params})

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        rows = self._update_held(
            task_id, token, "lease_expires_at = :expires", {"expires": self._clock() + lease_s}
        )
        if not rows:
            return Lease.LOST
        return Lease.CANCEL if rows[0]["cancel_requested"] else Lease.HELD

    def finish(self, task_id: str, token: str, result: Any) -> bool:
        encoded = json.dumps(result, allow_nan=False)
        return bool(
            self._update_held(
                task_id,
                token,
                "status = 'succeeded', result = :result, lease_token = NULL, "
                "lease_expires_at = NULL, finished_at = :now",
                {"result": encoded, "now": self._clock()},
            )
        )

    def fail(self, task_id: str, token: str, error: str, retry_in_s: float | None) -> bool:
        now = self._clock()
        with self._tx(write=True) as tx:
            rows = tx.run(
                "SELECT attempts, max_attempts, errors FROM corral_tasks WHERE id = :id "
                "AND status = 'running' AND lease_token = :token",
                {"id": task_id, "token": token},
            )
            if not rows:
                return False
            row = rows[0]
            errors = json.dumps(
                [
                    *json.loads(row["errors"]),
                    {"attempt": int(row["attempts"]), "error": error, "at": now},
                ]
            )
            again = retry_in_s is not None and int(row["attempts"]) < int(row["max_attempts"])
            if again:
                sets = (
                    "status = 'queued', run_after = :after, lease_token = NULL, "
                    "lease_expires_at = NULL, worker_id = NULL"
                )
            else:
                sets = (
                    "status = 'failed', lease_token = NULL, lease_expires_at = NULL, "
                    "finished_at = :now"
                )
            tx.run(
                f"UPDATE corral_tasks SET {sets}, error = :error, errors = :errors WHERE id = :id",
                {
                    "after": now + (retry_in_s or 0.0),
                    "now": now,
                    "error": error,
                    "errors": errors,
                    "id": task_id,
                },
            )
            return True

    def release(self, task_id: str, token: str) -> bool:
        return bool(
            self._update_held(
                task_id,
                token,
                "status = 'queued', attempts = attempts - 1, lease_token = NULL, "
                "lease_expires_at = NULL, worker_id = NULL, started_at = NULL",
                {},
            )
        )

    def acknowledge_cancel(self, task_id: str, token: str) -> bool:
        return bool(
            self._update_held(
                task_id,
                token,
                "status = 'cancelled', lease_token = NULL, lease_expires_at = NULL, "
                "finished_at = :now",
                {"now": self._clock()},
            )
        )

    def cancel(self, task_id: str) -> TaskStatus:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(
                "UPDATE corral_tasks SET "
                "cancel_requested = CASE WHEN status = 'running' THEN 1 ELSE cancel_requested END, "
                "finished_at = CASE WHEN status = 'queued' THEN :now ELSE finished_at END, "
                "status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END "
                "WHERE id = :id RETURNING status",
                {"id": task_id, "now": self._clock()},
            )
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return TaskStatus(rows[0]["status"])

    def retry(self, task_id: str) -> TaskStatus:
        with self._tx(write=True) as tx:
            tx.run(
                "UPDATE corral_tasks SET status = 'queued', attempts = 0, run_after = :now, "
                "finished_at = NULL, cancel_requested = 0, worker_id = NULL, started_at = NULL "
                "WHERE id = :id AND status IN ('failed', 'cancelled')",
                {"id": task_id, "now": self._clock()},
            )
            rows = tx.run("SELECT status FROM corral_tasks WHERE id = :id", {"id": task_id})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return TaskStatus(rows[0]["status"])

    def reclaim_expired(self) -> int:
        now = self._clock()
        with self._tx(write=True) as tx:
            rows = tx.run(
                "SELECT id, attempts, max_attempts, worker_id, errors FROM corral_tasks "
                "WHERE status = 'running' AND lease_expires_at < :now",
                {"now": now},
            )
            for row in rows:
                error = f"lease expired on worker {row['worker_id']} (worker died or stalled)"
                errors = json.dumps(
                    [
                        *json.loads(row["errors"]),
                        {"attempt": int(row["attempts"]), "error": error, "at": now},
                    ]
                )
                final = int(row["attempts"]) >= int(row["max_attempts"])
                tx.run(
                    "UPDATE corral_tasks SET status = :status, lease_token = NULL, "
                    "lease_expires_at = NULL, worker_id = CASE WHEN :final = 1 THEN worker_id "
                    "ELSE NULL END, finished_at = :finished, error = :error, errors = :errors "
                    "WHERE id = :id AND status = 'running'",
                    {
                        "status": "failed" if final else "queued",
                        "final": int(final),
                        "finished": now if final else None,
                        "error": error,
                        "errors": errors,
                        "id": row["id"],
                    },
                )
        return len(rows)

    # --- reads --------------------------------------------------------------------------------
    def get(self, task_id: str) -> Task:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(f"SELECT {_COLUMNS} FROM corral_tasks WHERE id = :id", {"id": task_id})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return _task(rows[0])

    def list(
        self, status: TaskStatus | None = None, model: str | None = None, limit: int = 100
    ) -> list[Task]:
        where, params = _filters(status, model)
        params["limit"] = limit
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                f"SELECT {_COLUMNS} FROM corral_tasks{where} ORDER BY seq DESC LIMIT :limit", params
            )
        return [_task(r) for r in rows]

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                "SELECT model, status, COUNT(*) AS n FROM corral_tasks GROUP BY model, status"
            )
        out: dict[str, dict[TaskStatus, int]] = {}
        for r in rows:
            out.setdefault(r["model"], {})[TaskStatus(r["status"])] = int(r["n"])
        return out

    def ready_counts(self) -> dict[str, dict[int, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                f"SELECT t.model, t.priority, COUNT(*) AS n FROM corral_tasks t "
                f"WHERE {_CLAIMABLE} GROUP BY t.model, t.priority",
                {"now": self._clock()},
            )
        out: dict[str, dict[int, int]] = {}
        for r in rows:
            out.setdefault(r["model"], {})[int(r["priority"])] = int(r["n"])
        return out


def _filters(status: TaskStatus | None, model: str | None) -> tuple[str, dict[str, Any]]:
    clauses, params = [], {}
    if status is not None:
        clauses.append("status = :status")
        params["status"] = status.value
    if model is not None:
        clauses.append("model = :model")
        params["model"] = model
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params
