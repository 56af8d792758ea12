"""The store in memory: SQLite's `:memory:` database, for unit tests and users' own tests.

It runs the SQL adapter's statements, so every rule of the store exists once (an
in-memory copy of each rule in Python drifted from the SQL one); nothing survives the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from corral.store.sqlite import SqliteStore


class MemoryStore(SqliteStore):
    """Thread-safe (one connection behind a lock); `clock` stamps times, as in every store."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(":memory:", clock=clock)
