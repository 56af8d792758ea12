"""Cluster membership over SQL (the `Membership` role): which workers and nodes are alive, and
what each holds: the SQL store's `members`. The store supplies the transactions and the guard
each operation runs under (store/outage.py); every one of them may run again."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from corral.store.base import Residency
from corral.store.outage import Guard
from corral.store.queries import SQL, Transactions, in_list, run_one


class SqlMembership:
    def __init__(self, tx: Transactions, guard: Guard, clock: Callable[[], float]) -> None:
        self._tx = tx
        self._guard = guard
        self._clock = clock

    def worker_seen(self, worker_id: str, models: Sequence[str], url: str | None = None) -> None:
        params = {
            "id": worker_id,
            "models": json.dumps(list(models)),
            "now": self._clock(),
            "url": url,
        }
        self._guard(
            "members.worker_seen", lambda: run_one(self._tx, SQL["worker_seen"], params, write=True)
        )

    def worker_gone(self, worker_id: str) -> None:
        self._guard("members.worker_gone", lambda: self._gone(worker_id))

    def _gone(self, worker_id: str) -> None:
        with self._tx(write=True) as tx:
            tx.run(SQL["forget_worker"], {"id": worker_id})
            tx.run(SQL["forget_residency"].format(keep=""), {"id": worker_id})

    def set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        # It replaces the worker's rows: the same rows again if it runs twice.
        self._guard("members.set_residency", lambda: self._set_residency(worker_id, resident))

    def _set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        now = self._clock()
        params: dict[str, Any] = {"id": worker_id}
        keep = ""  # the rows of models it no longer holds go (all of them if it holds none)
        if resident:
            keep = f" AND model NOT IN ({in_list('keep', [m for _, m, _ in resident], params)})"
        with self._tx(write=True) as tx:
            tx.run(SQL["forget_residency"].format(keep=keep), params)
            if resident:
                tx.run_many(
                    SQL["hold"],
                    [
                        {"w": worker_id, "device": dev, "model": m, "state": st, "now": now}
                        for dev, m, st in resident
                    ],
                )

    def residency(self, seen_after: float) -> list[Residency]:
        sql = SQL["residency"]
        rows = self._guard("members.residency", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return [
            Residency(r["worker_id"], r["device"], r["model"], r["state"], float(r["seen_at"]))
            for r in rows
        ]

    def workers(self, seen_after: float) -> dict[str, list[str]]:
        sql = SQL["workers"]
        rows = self._guard("members.workers", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return {r["id"]: json.loads(r["models"]) for r in rows}

    def nodes(self, seen_after: float) -> dict[str, str]:
        sql = SQL["nodes"]
        rows = self._guard("members.nodes", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return {r["id"]: r["url"] for r in rows}
