"""The store's SQL, named: the task columns, the statements the SQL stores share, and rows
turned into the store's types. Dialect-specific statements live with their adapter."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from corral.store.base import Batch, StoredFile, Task, TaskStatus

COLUMNS = (
    "seq, id, kind, model, payload, priority, serial_key, status, attempts, max_attempts, "
    "created_at, run_after, lease_token, lease_expires_at, worker_id, started_at, finished_at, "
    "result, error, errors, cancel_requested, batch_id, interactive, started_in_group, run_alone"
)
# The same columns without the payload and the result (`list(full=False)`).
LIGHT = COLUMNS.replace("payload,", "'null' AS payload,").replace("result,", "NULL AS result,")
QUALIFIED = ", ".join(f"corral_tasks.{c.strip()}" for c in COLUMNS.split(","))


INSERT = (
    "INSERT INTO corral_tasks (id, kind, model, payload, priority, interactive, serial_key, "
    "status, max_attempts, created_at, run_after, batch_id) VALUES (:id, :kind, :model, "
    ":payload, :priority, :interactive, :serial_key, :status, :max_attempts, :created_at, "
    ":run_after, :batch_id)"
)
CLAIMABLE = """t.status = 'queued' AND t.run_after <= :now
      AND (t.serial_key IS NULL OR (
        NOT EXISTS (SELECT 1 FROM corral_tasks r
                    WHERE r.serial_key = t.serial_key AND r.status = 'running')
        AND t.seq = (SELECT MIN(q.seq) FROM corral_tasks q
                     WHERE q.serial_key = t.serial_key AND q.status = 'queued')))"""


# Start a reserved task: its attempt counts from here. In a group (`:start_group` 1), never a
# task that must run alone.
START = (
    "UPDATE corral_tasks SET attempts = attempts + 1, started_at = :start_now, "
    "started_in_group = :start_group "
    "WHERE id = :start_id AND status = 'running' AND lease_token = :start_token "
    "AND started_at IS NULL AND (:start_group = 0 OR run_alone = 0) RETURNING id"
)
FINISH_SETS = (
    "status = 'succeeded', result = :result, lease_token = NULL, lease_expires_at = NULL, "
    "finished_at = :now"
)


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


FILE_COLUMNS = "id, purpose, filename, bytes, created_at, path, expires_at"
BATCH_COLUMNS = "seq, id, status, created_at, idempotency_key, data"


def to_file(row: Mapping[str, Any]) -> StoredFile:
    return StoredFile(
        id=row["id"],
        purpose=row["purpose"],
        filename=row["filename"],
        bytes=int(row["bytes"]),
        created_at=float(row["created_at"]),
        path=row["path"],
        expires_at=None if row["expires_at"] is None else float(row["expires_at"]),
    )


def to_batch(row: Mapping[str, Any]) -> Batch:
    return Batch(
        id=row["id"],
        status=row["status"],
        created_at=float(row["created_at"]),
        data=json.loads(row["data"]),
        idempotency_key=row["idempotency_key"],
        seq=int(row["seq"]),
    )
