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
from corral.store.queries import SQL, Tx, task_filters, task_rows, to_task
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
            tx.run(SQL["insert_announced"].format(notify=self._notify_sql()), row)
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
        rows = tx.run(SQL["queued_of_kind"], {"model": model, "kind": kind})
        queued = int(rows[0]["n"])
        if queued + adding > max_queued:
            raise QueueFull.of(kind, queued, adding, max_queued)

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        tx.run_many(SQL["insert_task"], rows)

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
        return SQL["claim"].format(
            new_token=self.dialect.new_token, lock_skip=self.dialect.lock_skip
        )

    def start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        with self._tx(write=True, single=len(tasks) == 1) as tx:
            return self._start(tx, tasks, group)

    def _start(self, tx: Tx, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        started: list[str] = []
        now = self._clock()
        grouped = int(group or len(tasks) > 1)
        for task_id, token in tasks:
            rows = tx.run(
                SQL["start"],
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
        params = {"id": task_id, "token": token, **params}
        if len(then_start) == 1 and self.dialect.cte_writes:
            (params["start_id"], params["start_token"]) = then_start[0]
            params["start_now"] = self._clock()
            params["start_group"] = 0
            with self._tx(write=True, single=True) as tx:
                return tx.run(SQL["update_held_then_start"].format(sets=sets), params)
        with self._tx(write=True, single=not then_start) as tx:
            self._start(tx, then_start)
            return tx.run(SQL["update_held"].format(sets=sets), params)

    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        rows = self._update_held(
            task_id, token, SQL["heartbeat_sets"], {"expires": self._clock() + lease_s}
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
                SQL["finish_sets"],
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
            rows = tx.run(SQL["held_for_fail"], {"id": task_id, "token": token})
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
            tx.run(
                SQL["fail_again" if again else "fail_for_good"],
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
                SQL["release_sets"],
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
                SQL["cancelled_sets"],
                {"now": self._clock()},
                then_start,
            )
        )

    def cancel(self, task_id: str) -> TaskStatus:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(SQL["cancel"], {"id": task_id, "now": self._clock()})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return TaskStatus(rows[0]["status"])

    def retry(self, task_id: str) -> TaskStatus:
        with self._tx(write=True) as tx:
            tx.run(SQL["retry"], {"id": task_id, "now": self._clock()})
            rows = tx.run(SQL["task_status"], {"id": task_id})
            if rows and rows[0]["status"] == "queued":
                self._announce(tx)
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        self._woken()
        return TaskStatus(rows[0]["status"])

    def reclaim_expired(self) -> int:
        now = self._clock()
        with self._tx(write=True) as tx:
            rows = tx.run(SQL["expired"], {"now": now})
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
                    SQL["reclaim"],
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
                held = {"id": task_id, "token": token, "worker": worker_id}
                if not tx.run(SQL["running_under"], held):
                    return 0
            cleared = tx.run(SQL["clear_groups"], {"worker": worker_id})
            for task_id, token in running:
                tx.run(SQL["blame"], {"id": task_id, "token": token})
        return len({r["id"] for r in cleared} | {task_id for task_id, _ in running})

    def purge(self, finished_before: float, limit: int = 10_000) -> int:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(SQL["purge"], {"before": finished_before, "limit": limit})
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
            rows = tx.run(SQL["get_task"], {"id": task_id})
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
        shown = SQL["columns" if full else "light_columns"]
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["list_tasks"].format(shown=shown, where=where), params)
        return [to_task(r) for r in rows]

    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["counts"])
        out: dict[str, dict[TaskStatus, int]] = {}
        for r in rows:
            out.setdefault(r["model"], {})[TaskStatus(r["status"])] = int(r["n"])
        return out

    def ready_counts(self) -> dict[str, dict[Level, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["ready_counts"], {"now": self._clock()})
        out: dict[str, dict[Level, int]] = {}
        for r in rows:
            level = (bool(r["interactive"]), int(r["priority"]))
            out.setdefault(r["model"], {})[level] = int(r["n"])
        return out
