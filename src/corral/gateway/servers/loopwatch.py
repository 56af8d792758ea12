"""The gateway's event loop, watched from a thread of its own: `LoopWatch`.

Every stream Corral relays and every request it admits waits on one event loop; anything that
blocks it (a subprocess waited for, a file or database call, a big parse) stalls all of them.
The watch posts a callback to the loop every `EVERY_S` and measures how late it runs: each lag
goes to `corral_event_loop_lag_seconds`, and a loop that has not run the callback for `STALL_S`
is logged once per stall with the loop thread's stack at that moment, so the log names the code
that blocked it. Blocking calls belong in a thread (`asyncio.to_thread`) or another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque

from prometheus_client import CollectorRegistry, Gauge, Histogram

log = logging.getLogger("corral.gateway")
EVERY_S = 0.05  # how often the loop is asked to run the watch's callback
# A loop late by this much is stalled: logged, with what it runs. CORRAL_LOOP_STALL_S sets it
# (a smaller figure logs shorter stalls: the tests use one to catch code that must never run
# on the loop at all).
STALL_S = float(os.environ.get("CORRAL_LOOP_STALL_S") or 0.25)
STALLS_KEPT = 32  # the last stalls, for tests and `/api/status` readers
TASKS_EVERY_S = 1.0  # how often the loop's task count is taken (it walks every task)


class LoopWatch:
    """Watches `loop` until `stop()`; `stalls` holds the last stalls seen, each (seconds it had
    stalled when seen, the innermost frames of the loop's thread then). With a `registry`, each
    lag goes to its `corral_event_loop_lag_seconds`, and the loop's task count to
    `corral_event_loop_tasks` (each second: what a long run watches for growth)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, registry: CollectorRegistry | None = None
    ) -> None:
        self.loop = loop
        self.lag = (
            Histogram(
                "corral_event_loop_lag_seconds",
                "How late the gateway's event loop ran a callback posted every 50 ms: what "
                "every stream and request waited for it meanwhile.",
                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                registry=registry,
            )
            if registry is not None
            else None
        )
        self.tasks = (
            Gauge(
                "corral_event_loop_tasks",
                "asyncio tasks alive on the gateway's event loop (taken each second).",
                registry=registry,
            )
            if registry is not None
            else None
        )
        self._tasks_at = 0.0
        self.stalls: deque[tuple[float, list[str]]] = deque(maxlen=STALLS_KEPT)
        self._loop_thread = threading.get_ident()  # made on the loop's own thread
        self._posted = 0.0  # when the pending callback was posted; 0: none pending
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="corral-loopwatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _main(self) -> None:
        seen_stall = False
        while not self._stop.wait(EVERY_S):
            posted = self._posted
            if posted:  # the last callback has not run yet
                late_s = time.monotonic() - posted
                if late_s >= STALL_S and not seen_stall:
                    seen_stall = True
                    self._stalled(late_s)
                continue
            seen_stall = False
            self._posted = time.monotonic()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to watch
                self.loop.call_soon_threadsafe(self._ran, self._posted)

    def _ran(self, posted: float) -> None:
        """On the loop: the callback ran, `lag` after it was posted."""
        lag_s = time.monotonic() - posted
        self._posted = 0.0
        if self.lag is not None:
            self.lag.observe(lag_s)
        if self.tasks is not None and posted - self._tasks_at >= TASKS_EVERY_S:
            self._tasks_at = posted
            self.tasks.set(len(asyncio.all_tasks(self.loop)))

    def _stalled(self, late_s: float) -> None:
        frame = sys._current_frames().get(self._loop_thread)
        where = _where(traceback.extract_stack(frame)) if frame is not None else []
        self.stalls.append((late_s, where))
        log.warning(
            "the gateway's event loop has not run for %.2f s: every stream and request waits "
            "meanwhile. It is running (innermost first): %s",
            late_s,
            " <- ".join(reversed(where)) or "unknown",
        )


INNERMOST = 8  # frames of a stalled loop's stack always shown
OWNERS = 8  # and the nearest of Corral's own beyond them: whose call it was (a library's parse)


def _where(stack: traceback.StackSummary) -> list[str]:
    """A stalled loop's stack, outermost first as `extract_stack` gives it: its `INNERMOST`
    frames and, beyond them, the nearest `OWNERS` of Corral's own, as `File "...", line N,
    in f`."""
    inner = list(stack)[-INNERMOST:]
    owners = [f for f in list(stack)[:-INNERMOST] if f"{os.sep}corral{os.sep}" in f.filename]
    return [f'File "{f.filename}", line {f.lineno}, in {f.name}' for f in owners[-OWNERS:] + inner]
