"""Log lines that a fault repeats every tick, written once per cause per minute (a full
disk wrote 1,091 lines and 33 tracebacks in 10 s)."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: BaseException) -> bool:
    """Is `exc` a full disk (or a spent quota)?"""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


class Throttle:
    """`warning(cause, ...)` logs at most once per `every_s` for each cause; the next line that
    gets through says how many were held back."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, cause: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log it unless `cause` was logged less than `every_s` ago; returns whether it was."""
        now = self.clock()
        last = self._last.get(cause)
        if last is not None and now - last < self.every_s:
            self._held[cause] = self._held.get(cause, 0) + 1
            return False
        self._last[cause] = now
        held = self._held.pop(cause, 0)
        if held:
            message += f" ({held} more like it since the last line)"
        self.logger.warning(message, *args, exc_info=exc_info)
        return True
