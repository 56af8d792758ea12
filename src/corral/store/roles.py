"""The store's roles combined, for a part that uses two or three of them. Each role is a
Protocol in store/base.py: the tasks (`TaskQueue`, `TaskControl`) are the store's own methods,
the others its attributes (`files`, `batches`, `members`). A part that uses one role takes that
one (`store.members`, not the store); the whole `Store` is left to the few that compose the
others: the worker, the Batch API's runtime, the CLI's maintenance."""

from __future__ import annotations

from typing import Protocol

from corral.store.base import BatchStore, FileStore, Membership, TaskControl, TaskQueue


class TaskWork(TaskQueue, TaskControl, Protocol):
    """Running tasks and reading one back (the worker's executor; a dead worker's last words)."""


class Liveness(TaskControl, Protocol):
    """Saying this worker is alive, and reading what waits that nobody serves."""

    @property
    def members(self) -> Membership: ...


class BatchFiles(Protocol):
    """Batches and their files (ending a batch)."""

    @property
    def files(self) -> FileStore: ...

    @property
    def batches(self) -> BatchStore: ...


class BatchWork(TaskControl, Protocol):
    """Batches, their files and their lines' counts (the Batch API's service)."""

    @property
    def files(self) -> FileStore: ...

    @property
    def batches(self) -> BatchStore: ...
