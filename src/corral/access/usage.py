"""Who used what (`Usage`, a part the gateway owns): per principal, model and hour, the model
calls answered, their input and output tokens, their waits, and the device-seconds of service
and of loads that fair shares charged the principal (core/shares.py). In memory, bounded
(`KEEP_HOURS` hours), and kept in the store by `UsageSaver` (what was counted since its last
save, added every `SAVE_EVERY_S`; read back when the gateway starts); read by
`GET /api/usage`, `/metrics` and `corral usage`.

Tokens are the server's own counts (`usage.prompt_tokens`/`input_tokens` and
`completion_tokens`) where its answer carries them, else the stream's pieces of text for the
output; device-seconds are the scheduler's own books, so usage adds up to what it charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from corral.store import StoreError, UsageBook
from corral.store.base import UsageRow

KEEP_HOURS = 24 * 32  # buckets kept: a month and a day
SAVE_EVERY_S = 10.0  # how often what was counted goes to the store
log = logging.getLogger("corral.access")
Period = Literal["hour", "day", "total"]
PERIODS: tuple[Period, ...] = ("hour", "day", "total")
Ledger = Callable[[], Mapping[tuple[str | None, str], list[float]]]


@dataclass(slots=True)
class Row:
    """One principal's use of one model in one period."""

    period_start: float  # epoch seconds (0 for the total)
    principal: str
    model: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    wait_s: float = 0.0
    service_s: float = 0.0
    load_s: float = 0.0

    def add(self, other: Row) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.wait_s += other.wait_s
        self.service_s += other.service_s
        self.load_s += other.load_s


class Usage:
    """Usage per (hour, principal, model). `ledger`: the scheduler's charged device-seconds per
    (its principal key, model): [service_s, load_s] (None: no scheduler here, none counted)."""

    def __init__(self, ledger: Ledger | None = None, keep_hours: int = KEEP_HOURS) -> None:
        self._ledger = ledger
        self._keep_hours = keep_hours
        self._hours: dict[tuple[int, str, str], Row] = {}
        self._seen: dict[tuple[str | None, str], tuple[float, float]] = {}
        self._totals: dict[tuple[str, str], Row] = {}
        self._unsaved: dict[tuple[int, str, str], Row] = {}  # counted since the last `unsaved`
        self._newest_hour = 0

    def record(
        self,
        principal: str,
        owner: str | None,
        model: str,
        input_tokens: int,
        output_tokens: int,
        wait_s: float,
        now: float | None = None,
    ) -> None:
        """A model call of `principal` (the scheduler's key for it: `owner`) ended. Its
        device-seconds are what the scheduler charged `owner` on `model` since the last call
        recorded: its service, and the loads its waiting work caused."""
        at = time.time() if now is None else now
        service_s = load_s = 0.0
        if self._ledger is not None:
            books = self._ledger().get((owner, model))
            if books is not None:
                was_s, was_l = self._seen.get((owner, model), (0.0, 0.0))
                service_s, load_s = books[0] - was_s, books[1] - was_l
                self._seen[(owner, model)] = (books[0], books[1])
        hour = int(at // 3600) * 3600
        d = Row(0, principal, model, 1, input_tokens, output_tokens, wait_s, service_s, load_s)
        key = (hour, principal, model)
        row = self._hours.get(key)
        if row is None:
            row = self._hours[key] = Row(float(hour), principal, model)
            if hour > self._newest_hour:  # a new hour: the oldest one goes
                self._newest_hour = hour
                self._forget_before(hour - self._keep_hours * 3600)
        row.add(d)
        fresh = self._unsaved.get(key)
        if fresh is None:
            fresh = self._unsaved[key] = Row(float(hour), principal, model)
        fresh.add(d)
        total = self._totals.get((principal, model))
        if total is None:
            total = self._totals[(principal, model)] = Row(0.0, principal, model)
        total.add(d)

    def unsaved(self) -> list[UsageRow]:
        """What was counted since the last call, per hour, principal and model (to add to the
        store); the caller hands back what it could not save (`restore`)."""
        rows, self._unsaved = self._unsaved, {}
        return [
            UsageRow(
                int(r.period_start),
                r.principal,
                r.model,
                r.requests,
                r.input_tokens,
                r.output_tokens,
                r.wait_s,
                r.service_s,
                r.load_s,
            )
            for r in rows.values()
        ]

    def restore(self, rows: Iterable[UsageRow], saved: bool = True) -> None:
        """Add rows read back from the store (`saved`), or rows a save failed on (not
        `saved`: they go with the next save). The hours past `KEEP_HOURS` are left out."""
        oldest = self._newest_hour - self._keep_hours * 3600
        for u in rows:
            row = Row(
                float(u.hour),
                u.principal,
                u.model,
                u.requests,
                u.input_tokens,
                u.output_tokens,
                u.wait_s,
                u.service_s,
                u.load_s,
            )
            if not saved:
                fresh = self._unsaved.setdefault(
                    (u.hour, u.principal, u.model), Row(float(u.hour), u.principal, u.model)
                )
                fresh.add(row)
                continue
            if u.hour < oldest:
                continue
            kept = self._hours.setdefault(
                (u.hour, u.principal, u.model), Row(float(u.hour), u.principal, u.model)
            )
            kept.add(row)
            self._newest_hour = max(self._newest_hour, u.hour)

    def _forget_before(self, hour: int) -> None:
        for key in [k for k in self._hours if k[0] < hour]:
            del self._hours[key]

    def rows(
        self,
        by: Period = "hour",
        since: float | None = None,
        until: float | None = None,
        principal: str | None = None,
    ) -> list[dict[str, object]]:
        """Rows per period (`by`), oldest first, of hours starting in [`since`, `until`), of
        `principal` only if given. `total`: since the server started (`since`/`until` apply
        to the hours summed, which go back `KEEP_HOURS`)."""
        out: dict[tuple[float, str, str], Row] = {}
        for (hour, who, model), row in sorted(self._hours.items()):
            if principal is not None and who != principal:
                continue
            if (since is not None and hour < since) or (until is not None and hour >= until):
                continue
            start = 0.0 if by == "total" else float(hour - hour % 86400 if by == "day" else hour)
            key = (start, who, model)
            acc = out.get(key)
            if acc is None:
                acc = out[key] = Row(start, who, model)
            acc.add(row)
        return [_rounded(r) for r in out.values()]

    def totals(self) -> Iterator[Row]:
        """Every (principal, model)'s use since the server started."""
        yield from self._totals.values()


def _rounded(r: Row) -> dict[str, object]:
    d = asdict(r)
    for k in ("wait_s", "service_s", "load_s"):
        d[k] = round(d[k], 3)
    return d


class UsageSaver:
    """Keeps `usage` in `book` (the store's `usage` role; None: nothing kept): reads back the
    kept hours when it starts, adds what was counted every `SAVE_EVERY_S` and at `close`,
    forgets hours past `KEEP_HOURS` once an hour. The store is called on threads; a store that
    cannot be reached costs a warning, and what was counted waits for the next save."""

    def __init__(self, usage: Usage, book: UsageBook | None) -> None:
        self._usage = usage
        self._book = book
        self._forgot_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run on the current loop until `close`."""
        self._task = asyncio.ensure_future(self.run())

    async def close(self) -> None:
        """Stop, saving what was counted last."""
        if self._task is not None:
            self._task.cancel()
        await self.save()

    async def run(self) -> None:
        book = self._book
        if book is None:
            return
        oldest = int(time.time() // 3600) * 3600 - KEEP_HOURS * 3600
        try:
            self._usage.restore(await asyncio.to_thread(book.since, oldest))
        except StoreError as exc:
            log.warning("usage: the hours kept in the store could not be read: %s", exc)
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            await self.save()
            if time.time() - self._forgot_at >= 3600:
                self._forgot_at = time.time()
                before = int(time.time() // 3600) * 3600 - KEEP_HOURS * 3600
                with contextlib.suppress(StoreError):
                    await asyncio.to_thread(book.forget_before, before)

    async def save(self) -> None:
        """Add what was counted since the last save to the store."""
        if self._book is None:
            return
        rows = self._usage.unsaved()
        if not rows:
            return
        try:
            await asyncio.to_thread(self._book.add, rows)
        except StoreError as exc:
            log.warning("usage: %d rows not saved yet (tried again shortly): %s", len(rows), exc)
            self._usage.restore(rows, saved=False)
