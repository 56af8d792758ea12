"""Background operations an owner starts on its event loop and must not lose: `Background`.

asyncio keeps only a weak reference to a task, so a task nobody holds may be collected before
it ends; and an exception in one nobody awaits surfaces only when it is collected, or never.
The gateway's and the worker's runtimes each hold one `Background` for their swaps, stops and
claims."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


class Background:
    """Holds each task it `spawn`s until the task ends, and logs one that raised at once, as
    `"<owner>: a background operation failed"`."""

    def __init__(self, owner: str, log: logging.Logger) -> None:
        self.owner = owner
        self.log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(self._log_failure)
        return t

    def running(self) -> list[asyncio.Task[Any]]:
        """The tasks not done yet."""
        return [t for t in self._tasks if not t.done()]

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def cancel_and_wait(self, wait_s: float = 5.0) -> None:
        """Cancel every task and wait up to `wait_s` for them to end, so their `finally` blocks
        run before the loop closes (a task still pending then is destroyed unfinished)."""
        self.cancel()
        running = self.running()
        if running:
            await asyncio.wait(running, timeout=wait_s)

    def _log_failure(self, t: asyncio.Task[Any]) -> None:
        if not t.cancelled() and t.exception() is not None:
            self.log.error("%s: a background operation failed", self.owner, exc_info=t.exception())
