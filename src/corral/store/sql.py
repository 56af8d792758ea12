"""One implementation of the store's SQL for every SQL dialect; adapters supply a connection,
transactions and the few phrases that differ (see `Dialect`)."""

from __future__ import annotations

import builtins
import itertools
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from corral.store.base import (
    Lease,
    Level,
    NewTask,
    QueueFull,
    Task,
    TaskNotFound,
    TaskStatus,
    grouped_expiry,
)
from corral.store.migrations import Dialect, check_schema, schema_version, upgrade
from corral.store.outage import Guard, unguarded
from corral.store.queries import (
    CLAIMABLE,
    COLUMNS,
    FINISH_SETS,
    INSERT,
    LIGHT,
    QUALIFIED,
    START,
    Tx,
    task_filters,
    task_rows,
    to_task,
)
from corral.store.sql_batches import SqlBatches, SqlFiles
from corral.store.sql_cluster import SqlMembership
from corral.store.wakeups import Wakeups

__all__ = ["SqlStore", "Tx"]


class SqlStore:
    """The `Store` over SQL. Subclasses implement `_tx(write)` and set `dialect`."""

    dialect: Dialect
    wakes_other_processes = False
    identity: str | None = None

    def __init__(self, clock: Callable[[], float] = time.time, guard: Guard = unguarded) -> None:
        """`guard`: how each operation of the other roles runs (store/outage.py)."""
        self._clock = clock
        self._wakeups = Wakeups()
        # The other roles: they share this store's transactions.
        self.files = SqlFiles(self._tx, guard)
        self.batches = SqlBatches(
            self._tx, guard, clock, self._insert_chunks, self._woken, self._announce
        )
        self.members = SqlMembership(self._tx, guard, clock)

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._wakeups.add(wake)

    def _announce(self, tx: Tx) -> None:
        """Inside a write transaction that made tasks claimable: tell other processes, where
        the database can (delivered on commit). `_woken` tells this process afterwards."""

    def _woken(self, announce: bool = False) -> None:
        """Tasks may have become claimable; `announce`: the change's own transaction could not
        announce it, so do it now."""
        if announce and self.wakes_other_processes:
            with self._tx(write=True, single=True) as tx:
                self._announce(tx)
        self._wakeups.fire()

    def _tx(self, write: bool, single: bool = False) -> AbstractContextManager[Tx]:
        """A transaction. `single`: the caller runs exactly one statement, which is atomic on
        its own, so an adapter may skip BEGIN/COMMIT round trips."""
        raise NotImplementedError

    # --- schema (store/migrations.py) -------------------------------------------------------
    def schema_version(self) -> int:
        return schema_version(self._tx)

    def check_schema(self) -> None:
        """For a store opened without migrating, read-only: its schema must be this code's
        (reads name columns that older schemas lack). Writes nothing."""
        check_schema(self._tx, self.dialect)

    def upgrade(self) -> list[int]:
        """Apply pending migrations, each in its own transaction; returns the versions applied.
        Raises `SchemaTooNew` if the database is ahead of this code."""
        return upgrade(self._tx, self.dialect)

    # --- writes -------------------------------------------------------------------------------
    def enqueue(self, task: NewTask) -> str:
        notify = self._notify_sql()
        if not (notify and self.dialect.cte_writes):
            return self.enqueue_many([task])[0]
        (row,) = self._rows([task])
        self._store_row(row)
        return str(row["id"])

    def _store_row(self, row: dict[str, Any]) -> None:
        """One statement, so one round trip in autocommit: the insert and its announcement."""
        with self._tx(write=True, single=True) as tx:
            tx.run(f"WITH added AS ({INSERT} RETURNING 1 AS x) {self._notify_sql()}", row)
        self._woken()

    def _notify_sql(self) -> str:
        """A SELECT that announces new work to other processes, or "" where there are none."""
        return ""

    def enqueue_many(self, tasks: Sequence[NewTask], max_queued: int | None = None) -> list[str]:
        rows = self._rows(tasks)
        self._store_rows(rows, max_queued)
        return [r["id"] for r in rows]

    def _store_rows(self, rows: list[dict[str, Any]], max_queued: int | None) -> None:
        with self._tx(write=True) as tx:
            if max_queued is not None and rows:
                self._check_room(tx, rows[0]["kind"], rows[0]["model"], len(rows), max_queued)
            self._insert(tx, rows)
            self._announce(tx)
        self._woken()

    def _rows(self, tasks: Sequence[NewTask]) -> list[dict[str, Any]]:
        return task_rows(tasks, self._clock())

    def _check_room(self, tx: Tx, kind: str, model: str, adding: int, max_queued: int) -> None:
        """Raise `QueueFull` if `kind` cannot take `adding` more queued tasks. Concurrent
        submitters of one kind are serialised first (SQLite: by BEGIN IMMEDIATE already)."""
        if self.dialect.kind_lock:
            tx.run(self.dialect.kind_lock, {"kind": kind})
        rows = tx.run(
            "SELECT count(*) AS n FROM corral_tasks "  # the partial index on queued tasks
            "WHERE model = :model AND status = 'queued' AND kind = :kind",
            {"model": model, "kind": kind},
        )
        queued = int(rows[0]["n"])
        if queued + adding > max_queued:
            raise QueueFull.of(kind, queued, adding, max_queued)

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        tx.run_many(INSERT, rows)

    def claim(
        self,
        model: str,
        worker_id: str,
        limit: int,
        lease_s: float,
        start: int | None = None,
        group: bool = False,
    ) -> builtins.list[Task]:
        params = {
            "worker": worker_id,
            "model": model,
            "limit": limit,
            "start": limit if start is None else start,
            "grp": int(group),
        }
        return self._claim(self._claim_sql(), params, lease_s)

    def _claim(self, sql: str, params: Mapping[str, Any], lease_s: float) -> builtins.list[Task]:
        """Run a claim statement (or a read of a claim's tasks) with `:now` and `:expires`
        added; the tasks in claim order."""
        now = self._clock()
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(sql, {**params, "now": now, "expires": now + lease_s})
        tasks = (to_task(r) for r in rows)
        return sorted(tasks, key=lambda t: (not t.interactive, -t.priority, t.seq))

    def _claim_sql(self) -> str:
        """The claim: one statement taking `:limit` claimable tasks of `:model`, the first
        `:start` of them started, the rest reserved; RETURNING the tasks' columns."""
        # Rank the picked rows so the best `start` of them start and the rest are reserved, in
        # one statement (window functions cannot share a SELECT with FOR UPDATE: hence the nest).
        # Several started at once are a group, which never includes a task that must run alone
        # (it comes back reserved: the worker starts it by itself).
        starts = (
            "p.rn <= :start AND ((:grp = 0 AND (:start <= 1 OR p.picked <= 1)) OR p.run_alone = 0)"
        )
        return f"""
UPDATE corral_tasks SET status = 'running',
    attempts = attempts + CASE WHEN {starts} THEN 1 ELSE 0 END,
    started_at = CASE WHEN {starts} THEN :now ELSE NULL END,
    started_in_group = CASE WHEN {starts} AND (:grp = 1 OR (:start > 1 AND p.picked > 1))
                       THEN 1 ELSE 0 END,
    lease_token = {self.dialect.new_token}, lease_expires_at = :expires, worker_id = :worker
FROM (SELECT s.seq, s.run_alone,
             row_number() OVER (ORDER BY s.interactive DESC, s.priority DESC, s.seq) AS rn,
             count(*) OVER () AS picked
      FROM (SELECT t.seq, t.interactive, t.priority, t.run_alone FROM corral_tasks t
            WHERE t.model = :model AND {CLAIMABLE}
            ORDER BY t.interactive DESC, t.priority DESC, t.seq
            LIMIT :limit {self.dialect.lock_skip}) s) p
WHERE corral_tasks.seq = p.seq
RETURNING {QUALIFIED}"""

    def start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        with self._tx(write=True, single=len(tasks) == 1) as tx:
            return self._start(tx, tasks, group)

    def _start(self, tx: Tx, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        started: list[str] = []
        now = self._clock()
        grouped = int(group or len(tasks) > 1)
        for task_id, token in tasks:
            rows = tx.run(
                START,
                {
                    "start_id": task_id,
                    "start_token": token,
                    "start_now": now,
                    "start_group": grouped,
                },
            )
            started.extend(r["id"] for r in rows)
        return started

    def _update_held(
        self,
        task_id: str,
        token: str,
        sets: str,
        params: dict[str, Any],
        then_start: Sequence[tuple[str, str]] = (),
    ) -> list[Mapping[str, Any]]:
        sql = (
            f"UPDATE corral_tasks SET {sets} WHERE id = :id AND status = 'running' "
            f"AND lease_token = :token RETURNING cancel_requested, serial_key"
        )
        params = {"id": task_id, "token": token, **params}
        if len(then_start) == 1 and self.dialect.cte_writes:
            (params["start_id"], params["start_token"]) = then_start[0]
            params["start_now"] = self._clock()
            params["start_group"] = 0
            with self._tx(write=True, single=True) as tx:
                return tx.run(f"WITH started AS ({START}) {sql}", params)
        with self._tx(write=True, single=not then_start) as tx:
            self._start(tx, then_start)
            return tx.run(sql, params)

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        rows = self._update_held(
            task_id, token, "lease_expires_at = :expires", {"expires": self._clock() + lease_s}
        )
        if not rows:
            return Lease.LOST
        return Lease.CANCEL if rows[0]["cancel_requested"] else Lease.HELD

    def finish(
        self, task_id: str, token: str, result: Any, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        encoded = json.dumps(result, allow_nan=False)
        return self._ended(
            self._update_held(
                task_id,
                token,
                FINISH_SETS,
                {"result": encoded, "now": self._clock()},
                then_start,
            )
        )

    def _ended(self, rows: list[Mapping[str, Any]]) -> bool:
        """After a task's attempt ended: its serial key's next task may run now."""
        if rows and rows[0]["serial_key"] is not None:
            self._woken(announce=True)
        return bool(rows)

    def fail(
        self,
        task_id: str,
        token: str,
        error: str,
        retry_in_s: float | None,
        then_start: Sequence[tuple[str, str]] = (),
    ) -> bool:
        now = self._clock()
        with self._tx(write=True) as tx:
            self._start(tx, then_start)
            rows = tx.run(
                "SELECT attempts, max_attempts, errors, serial_key FROM corral_tasks "
                "WHERE id = :id AND status = 'running' AND lease_token = :token",
                {"id": task_id, "token": token},
            )
            if not rows:
                return False
            row = rows[0]
            if row["serial_key"] is not None:
                self._announce(tx)
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
        if row["serial_key"] is not None:
            self._woken()
        return True

    def release(self, task_id: str, token: str) -> bool:
        released = bool(
            self._update_held(
                task_id,
                token,
                "status = 'queued', attempts = attempts - CASE WHEN started_at IS NULL THEN 0 "
                "ELSE 1 END, lease_token = NULL, started_in_group = 0, "
                "lease_expires_at = NULL, worker_id = NULL, started_at = NULL",
                {},
            )
        )
        if released:
            self._woken(announce=True)
        return released

    def acknowledge_cancel(
        self, task_id: str, token: str, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        return self._ended(
            self._update_held(
                task_id,
                token,
                "status = 'cancelled', lease_token = NULL, lease_expires_at = NULL, "
                "finished_at = :now",
                {"now": self._clock()},
                then_start,
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
                "finished_at = NULL, cancel_requested = 0, worker_id = NULL, started_at = NULL, "
                "started_in_group = 0, run_alone = 0 "
                "WHERE id = :id AND status IN ('failed', 'cancelled')",
                {"id": task_id, "now": self._clock()},
            )
            rows = tx.run("SELECT status FROM corral_tasks WHERE id = :id", {"id": task_id})
            if rows and rows[0]["status"] == "queued":
                self._announce(tx)
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        self._woken()
        return TaskStatus(rows[0]["status"])

    def reclaim_expired(self) -> int:
        now = self._clock()
        with self._tx(write=True) as tx:
            rows = tx.run(
                "SELECT id, attempts, max_attempts, worker_id, errors, started_at, "
                "started_in_group, cancel_requested FROM corral_tasks "
                "WHERE status = 'running' AND lease_expires_at < :now",
                {"now": now},
            )
            for row in rows:
                error, errors, refund = None, row["errors"], 0
                if row["cancel_requested"]:
                    status = "cancelled"
                elif row["started_at"] is None:  # reserved, never started: no attempt used
                    status = "queued"
                elif row["started_in_group"]:  # any task of its group may have killed it ...
                    status, refund = "queued", int(row["started_in_group"])  # (2: cleared)
                    error = grouped_expiry(row["worker_id"], cleared=refund == 2)
                    entry = {"attempt": int(row["attempts"]), "error": error, "at": now}
                    errors = json.dumps([*json.loads(row["errors"]), {**entry, "counted": False}])
                else:
                    error = f"lease expired on worker {row['worker_id']} (worker died or stalled)"
                    errors = json.dumps(
                        [
                            *json.loads(row["errors"]),
                            {"attempt": int(row["attempts"]), "error": error, "at": now},
                        ]
                    )
                    final = int(row["attempts"]) >= int(row["max_attempts"])
                    status = "failed" if final else "queued"
                tx.run(
                    "UPDATE corral_tasks SET status = :status, lease_token = NULL, "
                    "lease_expires_at = NULL, worker_id = CASE WHEN :status = 'queued' THEN NULL "
                    "ELSE worker_id END, finished_at = :finished, error = COALESCE(:error, error), "
                    "errors = :errors, attempts = attempts - CASE WHEN :refund > 0 THEN 1 "
                    "ELSE 0 END, started_in_group = 0, "
                    "run_alone = CASE WHEN :refund = 1 THEN 1 ELSE run_alone END "
                    "WHERE id = :id AND status = 'running'",
                    {
                        "status": status,
                        "finished": None if status == "queued" else now,
                        "error": error,
                        "errors": errors,
                        "refund": refund,
                        "id": row["id"],
                    },
                )
            if rows:
                self._announce(tx)
        if rows:
            self._woken()
        return len(rows)

    def blame_death(self, worker_id: str, running: Sequence[tuple[str, str]]) -> int:
        """`started_in_group` 2 marks a grouped task cleared by its worker's last words (see
        `reclaim_expired`); a blamed one goes to 0, as if started alone."""
        with self._tx(write=True) as tx:
            for task_id, token in running:
                if not tx.run(
                    "SELECT 1 AS x FROM corral_tasks WHERE id = :id AND lease_token = :token "
                    "AND worker_id = :worker AND status = 'running' AND started_at IS NOT NULL",
                    {"id": task_id, "token": token, "worker": worker_id},
                ):
                    return 0
            cleared = tx.run(
                "UPDATE corral_tasks SET started_in_group = 2 WHERE worker_id = :worker "
                "AND status = 'running' AND started_in_group IN (1, 2) RETURNING id",
                {"worker": worker_id},
            )
            for task_id, token in running:
                tx.run(
                    "UPDATE corral_tasks SET started_in_group = 0 WHERE id = :id "
                    "AND lease_token = :token",
                    {"id": task_id, "token": token},
                )
        return len({r["id"] for r in cleared} | {task_id for task_id, _ in running})

    def purge(self, finished_before: float, limit: int = 10_000) -> int:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(
                "DELETE FROM corral_tasks WHERE seq IN (SELECT seq FROM corral_tasks "
                "WHERE status IN ('succeeded', 'failed', 'cancelled') AND batch_id IS NULL "
                "AND finished_at < :before ORDER BY finished_at LIMIT :limit) RETURNING seq",
                {"before": finished_before, "limit": limit},
            )
        return len(rows)

    def _insert_chunks(self, tx: Tx, tasks: Iterable[NewTask]) -> int:
        """Insert `tasks` (maybe a generator) 2,000 at a time, announcing them if any; returns
        how many (the caller wakes this process's workers after the commit)."""
        added = 0
        it = iter(tasks)
        while chunk := list(itertools.islice(it, 2000)):
            self._insert(tx, self._rows(chunk))
            added += len(chunk)
        if added:
            self._announce(tx)
        return added

    # --- reads --------------------------------------------------------------------------------
    def get(self, task_id: str) -> Task:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(f"SELECT {COLUMNS} FROM corral_tasks WHERE id = :id", {"id": task_id})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return to_task(rows[0])

    def list(
        self,
        status: TaskStatus | None = None,
        model: str | None = None,
        limit: int = 100,
        full: bool = True,
    ) -> builtins.list[Task]:
        where, params = task_filters(status, model)
        params["limit"] = limit
        columns = COLUMNS if full else LIGHT
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                f"SELECT {columns} FROM corral_tasks{where} ORDER BY seq DESC LIMIT :limit", params
            )
        return [to_task(r) for r in rows]

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                "SELECT model, status, COUNT(*) AS n FROM corral_tasks GROUP BY model, status"
            )
        out: dict[str, dict[TaskStatus, int]] = {}
        for r in rows:
            out.setdefault(r["model"], {})[TaskStatus(r["status"])] = int(r["n"])
        return out

    def ready_counts(self) -> dict[str, dict[Level, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(
                f"SELECT t.model, t.interactive, t.priority, COUNT(*) AS n FROM corral_tasks t "
                f"WHERE {CLAIMABLE} GROUP BY t.model, t.interactive, t.priority",
                {"now": self._clock()},
            )
        out: dict[str, dict[Level, int]] = {}
        for r in rows:
            level = (bool(r["interactive"]), int(r["priority"]))
            out.setdefault(r["model"], {})[level] = int(r["n"])
        return out
