"""A large batch's file checked, and its lines stored, in a process of its own.

Checking a 50,000-line file and storing its lines is about a second of Python; in the
scheduler's process it takes the interpreter from every request, stream and `/health` for as
long (docs/benchmarks.md, "The event loop"). So `BatchRuntime` checks each `validating` batch
in a child process, started through multiprocessing's forkserver (never a fork of a process
with threads) at a lower CPU priority (`NICE`): it opens the same store by its URL and runs
`BatchService.validate` there, as the tick would have. The tick's thread waits for its answer
without holding the interpreter.

Failures: a child that dies midway (the OOM killer, a kill) leaves the batch `validating` with
its lines held back, never run; the next tick's attempt stores its own and drops those
(store/sql_batches.py), after `RESTART_S`, doubling up to `MAX_RESTART_S` while children keep
dying. What the child meets (a store outage, a file gone) is raised in the tick as a
RuntimeError naming it, and the batch is checked again at a later tick. On a stop the running
check is killed; the next start checks the batch again. A store only this process can open
(`memory://`) is checked in the tick's thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.batch.files import FileStorage
from corral.batch.service import BatchService
from corral.child import ChildDied, ChildError, Children
from corral.config import BatchConfig
from corral.config.schema import Names
from corral.store import open_store

log = logging.getLogger("corral.batch")

NICE = 10  # below the scheduler's process: a person's request goes first
RESTART_S = 1.0
MAX_RESTART_S = 60.0


@dataclass(frozen=True)
class CheckSpec:
    """What the child needs to check a batch as `BatchService` does in the scheduler's
    process (pickled to it with each batch: the names change with a reload)."""

    store_url: str
    files_root: str
    limits: BatchConfig
    max_line_bytes: int
    names: Names


def _validate(spec: CheckSpec, batch_id: str) -> tuple[str, int, int]:
    """In the child: check and start (or fail) `batch_id`; its status after, the child's
    process id and its nice value."""
    store = open_store(spec.store_url, migrate=False)
    try:
        files = FileStorage(Path(spec.files_root))
        service = BatchService(
            store, files, spec.limits, spec.names, max_line_bytes=spec.max_line_bytes
        )
        return service.validate(batch_id).status, os.getpid(), os.nice(0)
    finally:
        store.close()


class Checker:
    """Checks each large batch's file in a child of its own; called from the tick's thread
    (blocking). `names`: the configuration's names now (a reload changes them)."""

    def __init__(
        self,
        store_url: str,
        files_root: Path,
        limits: BatchConfig,
        max_line_bytes: int,
        names: Callable[[], Names],
    ) -> None:
        self._spec = (store_url, str(files_root), limits, max_line_bytes)
        self.names = names
        self.children = Children("corral-batch-check", NICE)
        self._deaths = 0
        self._not_before = 0.0

    def __call__(self, batch_id: str) -> None:
        """Check and start (or fail) `batch_id` in a child. RuntimeError with what the child
        met, or if it died (the batch is tried again at a later tick)."""
        wait_s = self._not_before - time.monotonic()
        if wait_s > 0:
            raise RuntimeError(f"a batch file's check died; the next starts in {wait_s:.0f} s")
        started_s = time.monotonic()
        try:
            status, pid, nice = self.children.call(
                _validate, CheckSpec(*self._spec, self.names()), batch_id
            )
        except ChildDied as exc:
            self._not_before = time.monotonic() + min(MAX_RESTART_S, RESTART_S * 2**self._deaths)
            self._deaths += 1
            raise RuntimeError(
                f"the process checking batch {batch_id}'s file died ({exc}); it is checked again"
            ) from None
        except ChildError as exc:
            raise RuntimeError(
                f"checking batch {batch_id}'s file: {exc.type_name}: {exc}"
            ) from None
        self._deaths = 0
        log.info(
            "batch %s is %s: its file was checked in %.1f s by process %d (nice %d)",
            batch_id,
            status,
            time.monotonic() - started_s,
            pid,
            nice,
        )

    def running(self) -> list[int]:
        """The process ids of the checks running now."""
        return self.children.running()

    def close(self) -> None:
        """Stop the checks running now (each batch stays `validating`; the next start checks
        it again) and start no more."""
        self.children.close()
