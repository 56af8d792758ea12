"""Usage over SQL (the `UsageBook` role): per hour, principal and model, what `Usage`
(access/usage.py) counted, added to what is kept so that `corral usage` outlives a restart.
Each operation runs under the store's guard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from corral.store.base import UsageRow
from corral.store.outage import Guard
from corral.store.queries import SQL, Transactions, run_one


class SqlUsage:
    def __init__(self, tx: Transactions, guard: Guard) -> None:
        self._tx = tx
        self._guard = guard

    def add(self, rows: Sequence[UsageRow]) -> None:
        if not rows:
            return
        params = [asdict(r) for r in rows]

        def add() -> None:
            with self._tx(write=True) as tx:
                tx.run_many(SQL["usage_add"], params)

        self._guard("usage.add", add)

    def since(self, hour: int) -> list[UsageRow]:
        rows = self._guard(
            "usage.since", lambda: run_one(self._tx, SQL["usage_since"], {"since": hour})
        )
        return [
            UsageRow(
                int(r["hour"]), r["principal"], r["model"], int(r["requests"]),
                int(r["input_tokens"]), int(r["output_tokens"]), float(r["wait_s"]),
                float(r["service_s"]), float(r["load_s"]),
            )
            for r in rows
        ]  # fmt: skip

    def forget_before(self, hour: int) -> int:
        sql = SQL["usage_forget"]
        rows = self._guard(
            "usage.forget", lambda: run_one(self._tx, sql, {"before": hour}, write=True)
        )
        return len(rows)
