"""One implementation of the store's SQL for every SQL dialect; adapters supply a connection,
transactions and the few phrases that differ (see `Dialect`)."""

from __future__ import annotations

import builtins
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
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
from corral.store.migrations import Dialect, Schema
from corral.store.outage import Guard, guarded, unguarded
from corral.store.queries import SQL, Transactions, Tx, run_one, task_filters, task_rows, to_task
from corral.store.sql_audit import SqlAudit
from corral.store.sql_batches import SqlBatches, SqlFiles
from corral.store.sql_cluster import SqlMembership
from corral.store.sql_usage import SqlUsage
from corral.store.wakeups import Wakeups

__all__ = ["SqlStore", "Tx"]


class SqlStore:
    """The `Store` over SQL: the tasks' operations, and the other roles as attributes.
    Subclasses implement `_tx(write)` and set `dialect`. Every operation runs under `guard`
    (store/outage.py: `@guarded` here, the roles' own calls there)."""

    dialect: Dialect
    wakes_other_processes = False
    identity: str | None = None

    def __init__(self, clock: Callable[[], float] = time.time, guard: Guard = unguarded) -> None:
        self._clock = clock
        self._guard = guard
        self._wakeups = Wakeups()
        # A SELECT announcing new work to other processes, where there are any (PostgreSQL).
        self._notify = ""
        self._claim_sql = SQL["claim"].format(
            new_token=self.dialect.new_token, lock_skip=self.dialect.lock_skip
        )
        # The other roles: they share this store's transactions and guard.
        self.schema = Schema(self._tx, self.dialect, guard)
        self.files = SqlFiles(self._tx, guard)
        self.batches = SqlBatches(self._tx, guard, clock, self._insert, self._woken, self._announce)
        self.members = SqlMembership(self._tx, guard, clock)
        self.audit = SqlAudit(self._tx, guard, clock)
        self.usage = SqlUsage(self._tx, guard)

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

    def _insert(self, tx: Tx, rows: list[dict[str, Any]]) -> None:
        """Insert task rows (`task_rows`); an adapter may stream many (PostgreSQL's COPY)."""
        tx.run_many(SQL["insert_task"], rows)

    # --- writes -------------------------------------------------------------------------------
    def enqueue(self, task: NewTask) -> str:
        return self.enqueue_many([task])[0]

    def enqueue_many(self, tasks: Sequence[NewTask], max_queued: int | None = None) -> list[str]:
        rows = task_rows(tasks, self._clock())  # the ids are known before the first try
        ids = [str(r["id"]) for r in rows]

        def store() -> list[str]:
            if len(rows) == 1 and max_queued is None and self._notify and self.dialect.cte_writes:
                # One statement, so one round trip in autocommit: the insert, announced.
                statement = SQL["insert_announced"].format(notify=self._notify)
                run_one(self._tx, statement, rows[0], write=True)
            else:
                with self._tx(write=True) as tx:
                    if max_queued is not None and rows:
                        check_room(tx, self.dialect, rows[0], len(rows), max_queued)
                    self._insert(tx, rows)
                    self._announce(tx)
            self._woken()
            return ids

        def stored() -> list[str] | None:
            """Whether a try whose commit was lost landed (all or none: one transaction)."""
            return ids if not ids or run_one(self._tx, SQL["task_stored"], {"id": ids[0]}) else None

        return self._guard("an enqueue", store, idempotent=False, resolve=stored)

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
        # Not tried again where a connection may drop: PostgresStore claims its own way.
        return claimed(self._tx, self._claim_sql, params, self._clock(), lease_s)

    @guarded
    def start(self, tasks: Sequence[tuple[str, str]], group: bool = False) -> list[str]:
        with self._tx(write=True, single=len(tasks) == 1) as tx:
            return start_reserved(tx, tasks, self._clock(), group)

    def _update_held(
        self,
        task_id: str,
        token: str,
        sets: str,
        params: dict[str, Any],
        then_start: Sequence[tuple[str, str]] = (),
        ends: bool = False,
    ) -> list[Mapping[str, Any]]:
        """A write by the worker holding the lease: its row (none if the lease was lost);
        `then_start` as in `finish`. `ends`: the task's attempt ended, so its serial key's next
        task may run."""
        params = {"id": task_id, "token": token, **params}
        if len(then_start) == 1 and self.dialect.cte_writes:
            (params["start_id"], params["start_token"]) = then_start[0]
            params["start_now"] = self._clock()
            params["start_group"] = 0
            statement = _held("update_held_then_start", sets)
            rows = run_one(self._tx, statement, params, write=True)
        else:
            with self._tx(write=True, single=not then_start) as tx:
                start_reserved(tx, then_start, self._clock())
                rows = tx.run(_held("update_held", sets), params)
        if ends and rows and rows[0]["serial_key"] is not None:
            self._woken(announce=True)
        return rows

    @guarded
    def heartbeat(self, task_id: str, token: str, lease_s: float) -> Lease:
        expires = {"expires": self._clock() + lease_s}
        rows = self._update_held(task_id, token, SQL["heartbeat_sets"], expires)
        if not rows:
            return Lease.LOST
        return Lease.CANCEL if rows[0]["cancel_requested"] else Lease.HELD

    @guarded
    def finish(
        self, task_id: str, token: str, result: Any, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        encoded = json.dumps(result, allow_nan=False)
        params = {"result": encoded, "now": self._clock()}
        return bool(self._update_held(task_id, token, SQL["finish_sets"], params, then_start, True))

    @guarded
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
            start_reserved(tx, then_start, now)
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

    @guarded
    def release(self, task_id: str, token: str) -> bool:
        released = bool(self._update_held(task_id, token, SQL["release_sets"], {}))
        if released:
            self._woken(announce=True)
        return released

    @guarded
    def acknowledge_cancel(
        self, task_id: str, token: str, then_start: Sequence[tuple[str, str]] = ()
    ) -> bool:
        params = {"now": self._clock()}
        return bool(
            self._update_held(task_id, token, SQL["cancelled_sets"], params, then_start, True)
        )

    @guarded
    def cancel(self, task_id: str) -> TaskStatus:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(SQL["cancel"], {"id": task_id, "now": self._clock()})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return TaskStatus(rows[0]["status"])

    @guarded
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

    @guarded
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

    @guarded
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

    @guarded
    def purge(self, finished_before: float, limit: int = 10_000) -> int:
        with self._tx(write=True, single=True) as tx:
            rows = tx.run(SQL["purge"], {"before": finished_before, "limit": limit})
        return len(rows)

    @guarded
    def get(self, task_id: str) -> Task:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["get_task"], {"id": task_id})
        if not rows:
            raise TaskNotFound(f"no task with id {task_id!r}")
        return to_task(rows[0])

    @guarded
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

    @guarded
    def counts(self) -> dict[str, dict[TaskStatus, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["counts"])
        out: dict[str, dict[TaskStatus, int]] = {}
        for r in rows:
            out.setdefault(r["model"], {})[TaskStatus(r["status"])] = int(r["n"])
        return out

    @guarded
    def ready_counts(self) -> dict[str, dict[Level, int]]:
        with self._tx(write=False, single=True) as tx:
            rows = tx.run(SQL["ready_counts"], {"now": self._clock()})
        out: dict[str, dict[Level, int]] = {}
        for r in rows:
            level = (bool(r["interactive"]), int(r["priority"]))
            out.setdefault(r["model"], {})[level] = int(r["n"])
        return out


def check_room(
    tx: Tx, dialect: Dialect, row: Mapping[str, Any], adding: int, max_queued: int
) -> None:
    """Raise `QueueFull` if the kind of task `row` cannot take `adding` more queued tasks of
    its model. Concurrent submitters of one kind are serialised first (SQLite: by BEGIN
    IMMEDIATE already)."""
    kind, model = row["kind"], row["model"]
    if dialect.kind_lock:
        tx.run(dialect.kind_lock, {"kind": kind})
    queued = int(tx.run(SQL["queued_of_kind"], {"model": model, "kind": kind})[0]["n"])
    if queued + adding > max_queued:
        raise QueueFull.of(kind, queued, adding, max_queued)


def claimed(
    transactions: Transactions,
    statement: str,
    params: Mapping[str, Any],
    now: float,
    lease_s: float,
) -> list[Task]:
    """Run a claim statement (or a read of a claim's tasks) with `:now` and `:expires`
    added; the tasks in claim order."""
    rows = run_one(
        transactions, statement, {**params, "now": now, "expires": now + lease_s}, write=True
    )
    tasks = (to_task(r) for r in rows)
    return sorted(tasks, key=lambda t: (not t.interactive, -t.priority, t.seq))


def start_reserved(
    tx: Tx, tasks: Sequence[tuple[str, str]], now: float, group: bool = False
) -> list[str]:
    """Start reserved tasks, (id, lease token) each, in `tx`: the ids started (see
    `TaskQueue.start`)."""
    started: list[str] = []
    grouped = int(group or len(tasks) > 1)
    for task_id, token in tasks:
        params = {
            "start_id": task_id,
            "start_token": token,
            "start_now": now,
            "start_group": grouped,
        }
        started.extend(r["id"] for r in tx.run(SQL["start"], params))
    return started


@functools.cache
def _held(entry: str, sets: str) -> str:
    """A lease-holder's write (`entry` with `sets`, one of queries.sql's `*_sets`), written
    once per kind: every commit and heartbeat runs one."""
    return SQL[entry].format(sets=sets)
