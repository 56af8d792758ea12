"""The audit log over SQL (the `Audit` role): admin actions and key changes, who did them and
when: the SQL store's `audit`. Each operation runs under the store's guard and may run again
(a key change is kept once however often it is told)."""

from __future__ import annotations

from collections.abc import Callable

from corral.store.base import AuditEntry
from corral.store.outage import Guard
from corral.store.queries import SQL, Transactions, run_one

MAX_FIELD = 2000  # characters kept of a field: an entry's size is bounded, whatever it says


class SqlAudit:
    def __init__(self, tx: Transactions, guard: Guard, clock: Callable[[], float]) -> None:
        self._tx = tx
        self._guard = guard
        self._clock = clock

    def record(
        self,
        principal: str,
        action: str,
        target: str,
        detail: str = "",
        at: float | None = None,
        once: bool = False,
    ) -> None:
        params = {
            "at": self._clock() if at is None else at,
            "principal": principal[:MAX_FIELD],
            "action": action[:MAX_FIELD],
            "target": target[:MAX_FIELD],
            "detail": detail[:MAX_FIELD],
        }
        sql = SQL["audit_record_once" if once else "audit_record"]
        self._guard("audit.record", lambda: run_one(self._tx, sql, params, write=True))

    def list(self, since: float = 0.0, limit: int = 100) -> list[AuditEntry]:
        params = {"since": since, "limit": max(1, min(limit, 10_000))}
        rows = self._guard("audit.list", lambda: run_one(self._tx, SQL["audit_list"], params))
        return [
            AuditEntry(
                int(r["seq"]),
                float(r["at"]),
                r["principal"],
                r["action"],
                r["target"],
                r["detail"],
            )
            for r in rows
        ]
