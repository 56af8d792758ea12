"""The Batch API's files and batches over SQL (the `FileStore` and `BatchStore` roles): the SQL
store's `files` and `batches`. The store supplies the transactions, the guard each operation
runs under (store/outage.py) and, for a batch's lines, the task insert."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import itertools
import json
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from corral.store.base import (
    Batch,
    BatchNotFound,
    FileNotFound,
    NewTask,
    StoredFile,
    Task,
    TaskStatus,
)
from corral.store.outage import Guard
from corral.store.queries import (
    SQL,
    Transactions,
    Tx,
    in_list,
    page,
    run_one,
    task_rows,
    to_batch,
    to_file,
    to_task,
)

# A batch's lines are stored this many to a transaction: the store's lock is held for about
# 20 ms at a time on SQLite, however large the batch.
LINES_PER_TX = 2000
# A line's `run_after` while its batch is being stored: never due. Each attempt at storing a
# batch holds its lines at its own value at or above this (`_hold`), so that it starts, or
# drops, only its own.
HELD_S = 1e18


def _hold() -> float:
    """One attempt's `run_after` for the lines it holds back: `HELD_S` plus a random multiple
    of 1,024 (exact in a double at this size, so that equality finds them again)."""
    return HELD_S + secrets.randbelow(1 << 30) * 1024


class SqlFiles:
    """Uploaded files' records (`corral_files`); the bytes live on disk (batch/files.py)."""

    def __init__(self, tx: Transactions, guard: Guard) -> None:
        self._tx = tx
        self._guard = guard

    def add(self, file: StoredFile) -> None:
        self._guard(
            "a file's record",
            lambda: run_one(self._tx, SQL["add_file"], dataclasses.asdict(file), write=True),
            idempotent=False,
            resolve=lambda: self._stored(file.id),
        )

    def _stored(self, file_id: str) -> builtins.list[Mapping[str, Any]] | None:
        """The record whose commit may have been lost, if it landed."""
        return run_one(self._tx, SQL["file_stored"], {"id": file_id}) or None

    def get(self, file_id: str) -> StoredFile:
        rows = self._guard("files.get", lambda: run_one(self._tx, SQL["get_file"], {"id": file_id}))
        if not rows:
            raise FileNotFound(f"no file with id {file_id!r}")
        return to_file(rows[0])

    def list(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 100,
        order: Literal["asc", "desc"] = "desc",
        owner: str | None = None,
    ) -> builtins.list[StoredFile]:
        where, params = page("corral_files", after, limit, order)
        if purpose is not None:
            where += " AND purpose = :purpose"
            params["purpose"] = purpose
        if owner is not None:
            where += " AND owner = :owner"
            params["owner"] = owner
        direction = "ASC" if order == "asc" else "DESC"
        sql = SQL["list_files"].format(where=where, direction=direction)
        rows = self._guard("files.list", lambda: run_one(self._tx, sql, params))
        return [to_file(r) for r in rows]

    def delete(self, file_id: str) -> StoredFile:
        rows = self._guard(
            "a file's deletion",
            lambda: run_one(self._tx, SQL["delete_file"], {"id": file_id}, write=True),
            idempotent=False,
        )
        if not rows:
            raise FileNotFound(f"no file with id {file_id!r}")
        return to_file(rows[0])


class SqlBatches:
    """Batches (`corral_batches`) and their lines, which are tasks with a `batch_id`.
    `insert(tx, rows)` inserts task rows (the store's); `woken` tells this process's workers
    after the commit; `announce(tx)` tells other processes."""

    def __init__(
        self,
        tx: Transactions,
        guard: Guard,
        clock: Callable[[], float],
        insert: Callable[[Tx, list[dict[str, Any]]], None],
        woken: Callable[[], None],
        announce: Callable[[Tx], None],
    ) -> None:
        self._tx = tx
        self._guard = guard
        self._clock = clock
        self._insert = insert
        self._woken = woken
        self._announce = announce

    def create(self, batch: Batch, tasks: Iterable[NewTask]) -> Batch:
        # Each transaction is tried again on its own, with the lines it read kept: `tasks`
        # may be a generator, read once.
        lines = iter(tasks)
        first = list(itertools.islice(lines, LINES_PER_TX))
        if len(first) < LINES_PER_TX:  # one transaction, as a small batch always was
            return self._guard(
                "a batch's creation", lambda: self._create(batch, first, None), idempotent=False
            )
        # A batch of more lines than one transaction takes is `validating` until all are
        # stored, and its lines are held back (`_store`): other work on the store runs between
        # its transactions, and a crash leaves nothing that can run.
        hold = _hold()
        made = self._guard(
            "a batch's creation", lambda: self._create(batch, first, hold), idempotent=False
        )
        if made.id != batch.id:  # its idempotency key named an earlier batch
            return made
        try:
            started = self._store(batch.id, batch.status, batch.data, lines, hold)
        except Exception:
            # As if it had been one transaction: a batch whose lines could not be stored (a
            # bad one, the store gone) is not kept; what cannot be dropped now, `tick` checks
            # again from its file once its creator is taken for gone.
            with contextlib.suppress(Exception):
                self._guard("a batch's removal", lambda: self._drop_storing(batch.id, hold))
            raise
        return started if started is not None else self.get(batch.id)

    def _create(self, batch: Batch, first: list[NewTask], hold: float | None) -> Batch:
        """Store `batch` with its `first` lines: whole (`hold` None), or `validating` with
        them held back at `hold`."""
        with self._tx(write=True) as tx:
            if batch.idempotency_key is not None:
                found = tx.run(SQL["batch_by_key"], {"k": batch.idempotency_key})
                if found:
                    return to_batch(found[0])
            data = batch.data if hold is None else {**batch.data, "storing_at": self._clock()}
            (row,) = tx.run(
                SQL["add_batch"],
                {
                    "id": batch.id,
                    "status": batch.status if hold is None else "validating",
                    "created_at": batch.created_at,
                    "key": batch.idempotency_key,
                    "data": json.dumps(data),
                    "owner": batch.owner,
                },
            )
            if first:
                self._insert(tx, task_rows(first, self._clock(), hold))
                if hold is None:
                    self._announce(tx)
        if first and hold is None:
            self._woken()
        return to_batch(row)

    def start(
        self, batch_id: str, status: str, data: dict[str, Any], tasks: Iterable[NewTask]
    ) -> Batch | None:
        return self._store(batch_id, status, data, iter(tasks), _hold())

    def _store(
        self, batch_id: str, status: str, data: dict[str, Any], lines: Iterator[NewTask],
        hold: float,
    ) -> Batch | None:  # fmt: skip
        """Store a `validating` batch's `lines`, `LINES_PER_TX` to a transaction, held back
        (`run_after` = `hold`, this attempt's own); the transaction with the last of them
        starts the batch (`status`, `data`) and makes them all due. Another attempt at the
        same batch (a tick that took over a stalled one) stores its own; the first to start
        the batch wins, the other drops its lines (None), and the winner drops whatever an
        attempt that died left. Each transaction is tried again on a dropped connection with
        the lines it read; one that may have committed is resolved by looking."""
        try:
            while len(chunk := list(itertools.islice(lines, LINES_PER_TX))) == LINES_PER_TX:
                rows = task_rows(chunk, self._clock(), hold)  # its ids, for `resolve`
                self._guard(
                    "a batch's lines",
                    functools.partial(self._held_rows, rows),
                    idempotent=False,
                    resolve=functools.partial(self._landed, rows),
                )
            started = self._guard(
                "a batch's start",
                functools.partial(self._start, batch_id, status, data, chunk, hold),
                idempotent=False,
            )
        except BaseException:
            # Else the attempt that starts the batch drops them.
            with contextlib.suppress(Exception):
                self._guard("a batch's lines", lambda: self._drop_own(batch_id, hold))
            raise
        if started is not None:
            self._woken()
        return started

    def _held_rows(self, rows: builtins.list[dict[str, Any]]) -> bool:
        with self._tx(write=True) as tx:
            self._insert(tx, rows)
        return True

    def _landed(self, rows: builtins.list[dict[str, Any]]) -> bool | None:
        """Whether a transaction of `rows` that may have committed did."""
        found = run_one(self._tx, SQL["task_stored"], {"id": rows[0]["id"]})
        return True if found else None

    def _start(
        self, batch_id: str, status: str, data: dict[str, Any], last: list[NewTask], hold: float
    ) -> Batch | None:
        with self._tx(write=True) as tx:
            rows = tx.run(
                SQL["start_batch"], {"id": batch_id, "status": status, "data": json.dumps(data)}
            )
            if not rows:
                if not tx.run(SQL["batch_exists"], {"id": batch_id}):
                    raise BatchNotFound(f"no batch with id {batch_id!r}")
                self._drop_held(tx, batch_id, hold)
                return None
            now = self._clock()
            if last:
                self._insert(tx, task_rows(last, now))
            tx.run(SQL["release_lines"], {"b": batch_id, "hold": hold, "now": now})
            self._drop_held(tx, batch_id, None)
            self._announce(tx)
        return to_batch(rows[0])

    def _drop_own(self, batch_id: str, hold: float) -> None:
        with self._tx(write=True) as tx:
            self._drop_held(tx, batch_id, hold)

    def _drop_storing(self, batch_id: str, hold: float) -> None:
        with self._tx(write=True) as tx:
            self._drop_held(tx, batch_id, hold)
            tx.run(SQL["drop_storing_batch"], {"id": batch_id})

    @staticmethod
    def _drop_held(tx: Tx, batch_id: str, hold: float | None) -> None:
        """Delete the lines `hold`'s attempt held back (None: every attempt's)."""
        if hold is None:
            sql, params = SQL["drop_all_held_lines"], {"held": HELD_S}
        else:
            sql, params = SQL["drop_held_lines"], {"hold": hold}
        tx.run(sql, {"b": batch_id, **params})

    def get(self, batch_id: str) -> Batch:
        sql = SQL["get_batch"]
        rows = self._guard("batches.get", lambda: run_one(self._tx, sql, {"id": batch_id}))
        if not rows:
            raise BatchNotFound(f"no batch with id {batch_id!r}")
        return to_batch(rows[0])

    def list(
        self,
        after: str | None = None,
        limit: int = 100,
        status: Sequence[str] | None = None,
        owner: str | None = None,
    ) -> builtins.list[Batch]:
        where, params = page("corral_batches", after, limit)
        if status is not None:
            where += f" AND status IN ({in_list('status', status, params)})"
        if owner is not None:
            where += " AND owner = :owner"
            params["owner"] = owner
        sql = SQL["list_batches"].format(where=where)
        rows = self._guard("batches.list", lambda: run_one(self._tx, sql, params))
        return [to_batch(r) for r in rows]

    def update(
        self, batch_id: str, status: str, data: dict[str, Any], expect: Sequence[str]
    ) -> Batch | None:
        return self._guard(  # a compare-and-set: a lost "set" would read as a lost race
            "a batch's update",
            lambda: self._update(batch_id, status, data, expect),
            idempotent=False,
        )

    def _update(
        self, batch_id: str, status: str, data: dict[str, Any], expect: Sequence[str]
    ) -> Batch | None:
        params: dict[str, Any] = {"id": batch_id, "status": status, "data": json.dumps(data)}
        marks = in_list("expect", expect, params)
        with self._tx(write=True) as tx:
            rows = tx.run(SQL["update_batch"].format(expect=marks), params)
            if not rows and not tx.run(SQL["batch_exists"], {"id": batch_id}):
                raise BatchNotFound(f"no batch with id {batch_id!r}")
        return to_batch(rows[0]) if rows else None

    def starts(self, models: Iterable[str], owner: str | None, priority: int) -> dict[str, float]:
        return self._guard("batches.starts", lambda: self._starts(models, owner, priority))

    def _starts(self, models: Iterable[str], owner: str | None, priority: int) -> dict[str, float]:
        out: dict[str, float] = {}
        with self._tx(write=False) as tx:
            last = float(tx.run(SQL["last_seq"])[0]["seq"])
            for model in models:
                params = {"model": model, "interactive": 0, "priority": priority, "owner": owner}
                head = tx.run(SQL["turn_head"], params)[0]["head"]
                tail = tx.run(SQL["turn_tail"], params)[0]["tail"]
                start = last if head is None else float(head)
                out[model] = start if tail is None else max(start, float(tail))
        return out

    def counts(self, batch_id: str) -> dict[TaskStatus, int]:
        sql = SQL["batch_counts"]
        rows = self._guard("batches.counts", lambda: run_one(self._tx, sql, {"b": batch_id}))
        return {TaskStatus(r["status"]): int(r["n"]) for r in rows}

    def tasks(self, batch_id: str, after_seq: int = 0, limit: int = 1000) -> builtins.list[Task]:
        sql = SQL["batch_tasks"]
        params = {"b": batch_id, "after": after_seq, "limit": limit}
        return [
            to_task(r) for r in self._guard("batches.tasks", lambda: run_one(self._tx, sql, params))
        ]

    def cancel(self, batch_id: str) -> int:
        return self._guard("batches.cancel", lambda: self._cancel(batch_id))

    def _cancel(self, batch_id: str) -> int:
        now = self._clock()
        with self._tx(write=True) as tx:
            queued = tx.run(SQL["cancel_batch_queued"], {"b": batch_id, "now": now})
            running = tx.run(SQL["cancel_batch_running"], {"b": batch_id})
            self._announce(tx)
        self._woken()  # workers drop the cancelled lines from their schedule now
        return len(queued) + len(running)
