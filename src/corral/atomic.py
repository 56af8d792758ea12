"""Files replaced whole: written beside their place, then renamed over it, so a reader (or a
process started after a crash) sees the old file or the new one, never a part."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def replace_text(path: Path, text: str, *, sync: bool = False) -> None:
    """`path` holds `text` (its folder made if missing); OSError if it cannot be written. The
    part file carries the process id: two processes writing at once never share one. With
    `sync`, the text is on the disk before the rename (a power cut keeps old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        with part.open("w", encoding="utf-8") as f:
            f.write(text)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        part.replace(path)
    except OSError:
        part.unlink(missing_ok=True)
        raise


class LatestText:
    """A file rewritten whole from the event loop without waiting on the disk: `write` returns
    at once and a worker thread writes (`replace_text`); texts given while one is being written
    collapse into the latest, so the file ends as the last text given, and writes never run
    out of order. Outside a running loop `write` writes before it returns. `failed` is told of
    an OSError (on the loop that asked, when there is one); the next `write` tries again."""

    def __init__(
        self, path: Path, *, sync: bool = False, failed: Callable[[OSError], None] | None = None
    ) -> None:
        self.path = path
        self.sync = sync
        self.failed = failed
        self._lock = threading.Lock()
        self._next: str | None = None
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()

    def write(self, text: str) -> None:
        with self._lock:
            self._next = text
            if self._busy:
                return  # the running worker takes it next
            self._busy = True
            self._idle.clear()
        _off_loop(self._drain)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is left to write (for a shutdown, or a test reading the file);
        False if `timeout_s` passed first. Never call it on the loop while writes are queued."""
        return self._idle.wait(timeout_s)

    def _drain(self, loop: asyncio.AbstractEventLoop | None) -> None:
        while True:
            with self._lock:
                text, self._next = self._next, None
                if text is None:
                    self._busy = False
                    self._idle.set()
                    return
            try:
                replace_text(self.path, text, sync=self.sync)
            except OSError as exc:
                self._tell(loop, exc)
            except Exception:  # never leaves the writer busy for good
                log.exception("writing %s", self.path)

    def _tell(self, loop: asyncio.AbstractEventLoop | None, exc: OSError) -> None:
        if self.failed is None:
            log.warning("cannot write %s: %s", self.path, exc)
        elif loop is None:
            self.failed(exc)
        else:
            try:
                loop.call_soon_threadsafe(self.failed, exc)
            except RuntimeError:  # the loop closed meanwhile
                log.warning("cannot write %s: %s", self.path, exc)


def remove_soon(path: Path) -> None:
    """Remove `path` (one already gone is fine): on a thread when called on a running loop, as
    freeing a big file's blocks takes the file system a while; a failure is logged."""
    _off_loop(lambda _loop: _remove(path))


def _off_loop(work: Callable[[asyncio.AbstractEventLoop | None], None]) -> None:
    """Run `work` on the running loop's default executor, told that loop; outside a loop, or
    once its executor is shut (its last writes), here and now, told None."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        work(None)
        return
    try:
        loop.run_in_executor(None, work, loop)
    except RuntimeError:
        work(None)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
