"""Tasks in motion between the store's queue and this worker (`Moves`, a part the `Worker`
owns): claims and give-backs under way and done, per model, so that a count of the store taken
meanwhile is known to be off (it counts those tasks twice or not at all)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence


class Moves:
    """`move(model)` around a claim or a give-back; `seen()` before reading the store and
    `off(model, seen)` after it tell whether the read can be trusted for `model`."""

    def __init__(
        self, models: Sequence[str], moving: Callable[[str], None], wake: asyncio.Event
    ) -> None:
        self.models = models
        self._moving_now = moving  # the scheduler hears of each move (`on_backlog_moved`)
        self._wake = wake
        self._moving: dict[str, int] = defaultdict(int)  # claims/releases under way
        self._moved: dict[str, int] = defaultdict(int)  # ... and finished
        self._stale: set[str] = set()  # models whose last report was only a bound

    def seen(self) -> dict[str, int | None]:
        """Per model, the count of finished moves, or None while one is under way: taken
        before reading the store, compared after (`off`)."""
        return {m: None if self._moving[m] else self._moved[m] for m in self.models}

    def off(self, model: str, seen: dict[str, int | None]) -> bool:
        """Tasks of `model` moved while the store was read: its count may be off either way
        (the next move's end wakes the worker to count again)."""
        if seen.get(model) is None or seen[model] != self._moved[model] or self._moving[model]:
            self._stale.add(model)
            return True
        return False

    def moving(self, model: str) -> int:
        """Claims or give-backs of `model` under way."""
        return self._moving[model]

    @contextlib.asynccontextmanager
    async def move(self, model: str) -> AsyncIterator[None]:
        """Around a claim or a give-back of `model`'s tasks."""
        self._moving_now(model)
        self._moving[model] += 1
        try:
            yield
        finally:
            self._moving[model] -= 1
            self._moved[model] += 1
            if model in self._stale:
                self._stale.discard(model)
                self._wake.set()  # its last report was a bound: report exactly now
