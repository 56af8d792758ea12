"""Cluster membership over SQL (the `Membership` role): which workers and nodes are alive, and
what each holds: the SQL store's `members`. The store supplies the transactions and the guard
each operation runs under (store/outage.py); every one of them may run again."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from corral.store.base import Residency
from corral.store.outage import Guard
from corral.store.queries import Transactions, in_list, run_one


class SqlMembership:
    def __init__(self, tx: Transactions, guard: Guard, clock: Callable[[], float]) -> None:
        self._tx = tx
        self._guard = guard
        self._clock = clock

    def worker_seen(self, worker_id: str, models: Sequence[str], url: str | None = None) -> None:
        sql = (
            "INSERT INTO corral_workers (id, models, seen_at, url) "
            "VALUES (:id, :models, :now, :url) "
            "ON CONFLICT (id) DO UPDATE SET models = excluded.models, "
            "seen_at = excluded.seen_at, url = excluded.url"
        )
        params = {
            "id": worker_id,
            "models": json.dumps(list(models)),
            "now": self._clock(),
            "url": url,
        }
        self._guard("members.worker_seen", lambda: run_one(self._tx, sql, params, write=True))

    def worker_gone(self, worker_id: str) -> None:
        self._guard("members.worker_gone", lambda: self._gone(worker_id))

    def _gone(self, worker_id: str) -> None:
        with self._tx(write=True) as tx:
            tx.run("DELETE FROM corral_workers WHERE id = :id", {"id": worker_id})
            tx.run("DELETE FROM corral_residency WHERE worker_id = :id", {"id": worker_id})

    def set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        # It replaces the worker's rows: the same rows again if it runs twice.
        self._guard("members.set_residency", lambda: self._set_residency(worker_id, resident))

    def _set_residency(self, worker_id: str, resident: Sequence[tuple[str, str, str]]) -> None:
        now = self._clock()
        params: dict[str, Any] = {"id": worker_id}
        others = ""  # the rows of models it no longer holds go (all of them if it holds none)
        if resident:
            others = f" AND model NOT IN ({in_list('keep', [m for _, m, _ in resident], params)})"
        with self._tx(write=True) as tx:
            # An upsert, not delete-then-insert: two calls at once cannot collide.
            tx.run(f"DELETE FROM corral_residency WHERE worker_id = :id{others}", params)
            if resident:
                tx.run_many(
                    "INSERT INTO corral_residency (worker_id, device, model, state, seen_at) "
                    "VALUES (:w, :device, :model, :state, :now) ON CONFLICT (worker_id, model) "
                    "DO UPDATE SET device = excluded.device, state = excluded.state, "
                    "seen_at = excluded.seen_at",
                    [
                        {"w": worker_id, "device": dev, "model": m, "state": st, "now": now}
                        for dev, m, st in resident
                    ],
                )

    def residency(self, seen_after: float) -> list[Residency]:
        sql = (
            "SELECT worker_id, device, model, state, seen_at FROM corral_residency "
            "WHERE seen_at > :t ORDER BY worker_id, model"
        )
        rows = self._guard("members.residency", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return [
            Residency(r["worker_id"], r["device"], r["model"], r["state"], float(r["seen_at"]))
            for r in rows
        ]

    def workers(self, seen_after: float) -> dict[str, list[str]]:
        sql = "SELECT id, models FROM corral_workers WHERE seen_at > :t ORDER BY id"
        rows = self._guard("members.workers", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return {r["id"]: json.loads(r["models"]) for r in rows}

    def nodes(self, seen_after: float) -> dict[str, str]:
        sql = (
            "SELECT id, url FROM corral_workers WHERE seen_at > :t AND url IS NOT NULL ORDER BY id"
        )
        rows = self._guard("members.nodes", lambda: run_one(self._tx, sql, {"t": seen_after}))
        return {r["id"]: r["url"] for r in rows}
