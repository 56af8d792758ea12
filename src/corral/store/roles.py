"""The store's roles combined, for a part that uses two or three of them (each role is a
Protocol in store/base.py; a part that uses one takes that one). The whole `Store` is left to
the few that compose the others: the worker, the Batch API's runtime, the CLI's maintenance."""

from __future__ import annotations

from typing import Protocol

from corral.store.base import BatchStore, FileStore, Membership, TaskControl, TaskQueue


class TaskWork(TaskQueue, TaskControl, Protocol):
    """Running tasks and reading one back (the worker's executor; a dead worker's last words)."""


class Liveness(Membership, TaskControl, Protocol):
    """Saying this worker is alive, and reading what waits that nobody serves."""


class BatchFiles(BatchStore, FileStore, Protocol):
    """Batches and their files (ending a batch)."""


class BatchWork(BatchStore, FileStore, TaskControl, Protocol):
    """Batches, their files and their lines' counts (the Batch API's service)."""
