"""Lease heartbeats for a worker's running tasks, from a thread of their own.

A handler may block the worker's event loop (`time.sleep` in an `async def`, a CPU-bound loop):
heartbeats sent from that loop would stop, the lease would lapse, another worker would run the
task again and every result would be dropped as "lease lost". From a thread they keep going
whatever the loop does, and the thread notices a loop that has stopped answering and names the
async handlers running at the time, so the cause is in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from corral.store import Lease, StoreUnavailable, Task, TaskQueue
from corral.worker.registry import TaskContext

log = logging.getLogger("corral.worker")


@dataclass
class _Beat:
    task: Task
    token: str
    ctx: TaskContext
    work: asyncio.Future[None]
    is_async: bool
    lost: bool = False


def beat_every_s(lease_s: float) -> float:
    """How often a held lease is renewed: thrice a lease, and at least every second (so a
    cancellation reaches a handler within a second)."""
    return min(lease_s / 3, 1.0)


class Heartbeats:
    """Extends the lease of every task `add`ed until it is `remove`d, every `beat_every_s`: a
    cancellation sets the task's context (sync handlers poll it) and cancels an async handler's
    work; a lost lease is logged. `stop()` ends the thread."""

    def __init__(self, store: TaskQueue, lease_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.lease_s = lease_s
        self.every_s = beat_every_s(lease_s)
        self.loop = loop
        self._beats: dict[str, _Beat] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop_seen = time.monotonic()  # the last time the loop ran a callback of ours
        self._posted_at: float | None = None  # when the callback now pending was posted
        self._blocked_since: float | None = None
        self._thread = threading.Thread(target=self._main, name="corral-heartbeats", daemon=True)
        self._thread.start()

    def add(
        self, task: Task, token: str, ctx: TaskContext, work: asyncio.Future[None], is_async: bool
    ) -> None:
        with self._lock:
            self._beats[task.id] = _Beat(task, token, ctx, work, is_async)

    def remove(self, task_id: str) -> None:
        """Stop beating for the task (idempotent): call it before its commit, so a heartbeat
        that finds the lease gone after the commit is not mistaken for a lost lease."""
        with self._lock:
            self._beats.pop(task_id, None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _main(self) -> None:
        while not self._stop.wait(self.every_s):
            self._check_loop()
            with self._lock:
                beats = [b for b in self._beats.values() if not b.lost]
            for b in beats:
                try:
                    state = self.store.heartbeat(b.task.id, b.token, self.lease_s)
                except StoreUnavailable:  # the store said so; the next round tries again
                    break
                except Exception as exc:  # a database blip: the next round tries again
                    log.warning("task %s: heartbeat failed: %s", b.task.id, exc)
                    continue
                if state is Lease.CANCEL:
                    b.ctx._cancel()  # sync handlers poll it; async ones are cancelled
                    if b.is_async:
                        self._on_loop(b.work.cancel)
                elif state is Lease.LOST:
                    b.lost = True
                    with self._lock:  # removed meanwhile: its commit ended the lease, not a loss
                        still = self._beats.get(b.task.id) is b
                    if still:
                        log.warning("task %s: lease lost (another worker may run it)", b.task.id)

    def _check_loop(self) -> None:
        """Warn, once per stall, when the loop has not run our callback for two rounds since it
        was posted (timed from the post: a round of heartbeats that waited on a busy store
        is this thread's delay, not the loop's); post the next once it ran."""
        now = time.monotonic()
        posted = self._posted_at
        pending = posted is not None and self._loop_seen < posted
        stalled_s = now - posted if pending and posted is not None else 0.0
        if not pending:
            self._posted_at = now
            self._on_loop(self._seen)
        if stalled_s > max(2 * self.every_s, 1.0):
            if self._blocked_since is None:
                self._blocked_since = self._loop_seen
                with self._lock:
                    running = sorted(
                        {repr(b.task.kind) for b in self._beats.values() if b.is_async}
                    )
                log.warning(
                    "the worker's event loop has not run for %.1f s: an async handler blocks it "
                    "(running: %s). Await instead (asyncio.sleep, asyncio.to_thread for blocking "
                    "calls) or make it a sync handler; leases are kept meanwhile",
                    stalled_s,
                    ", ".join(running) or "none",
                )
        else:
            self._blocked_since = None

    def _seen(self) -> None:
        self._loop_seen = time.monotonic()

    def _on_loop(self, fn: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to tell it
            self.loop.call_soon_threadsafe(fn)  # type: ignore[arg-type]
