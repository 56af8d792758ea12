"""`Wakeups`: the callbacks a store runs when tasks may have become claimable (`subscribe`)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Wakeups:
    """Callbacks to run when tasks may have become claimable. Thread-safe; a callback must be
    quick and must not raise (it runs on whichever thread noticed the change)."""

    def __init__(self) -> None:
        self._fns: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Register `fn`; returns the function that removes it."""
        with self._lock:
            self._fns.append(fn)

        def remove() -> None:
            with self._lock:
                if fn in self._fns:
                    self._fns.remove(fn)

        return remove

    def fire(self) -> None:
        with self._lock:
            fns = list(self._fns)
        for fn in fns:
            fn()
