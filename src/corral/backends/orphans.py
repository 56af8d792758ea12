"""The model servers a gateway started, recorded in a file, so that when a gateway dies without
stopping them (kill -9, the OOM killer) the next one started on the same folder stops them
first: a killed gateway must not leave a model holding the GPU's memory.

Each line is a server's process group id and its start time (from /proc), so a recycled pid of
an unrelated process is never touched.

`DirLock` makes the folder one gateway's: the record is reaped only by the gateway that holds the
lock, so a second `corral serve` on the same folder is refused instead of stopping the servers of
the first one, which is still running.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from pathlib import Path
from typing import IO

from corral.errors import CorralError


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


class ServerRecord:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def add(self, pid: int) -> None:
        started = _started(pid)
        if started is None:
            return
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(f"{pid} {started}\n")

    def remove(self, pid: int) -> None:
        with self._lock:
            kept = [x for x in self._read() if x[0] != pid]
            self._write(kept)

    def reap(self, grace_s: float = 2.0) -> list[int]:
        """Stop every recorded server still running (SIGTERM to its group, SIGKILL after
        `grace_s`); returns their pids. The record is empty afterwards."""
        with self._lock:
            alive = [pid for pid, started in self._read() if _started(pid) == started]
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while alive and time.monotonic() < deadline and any(_started(p) for p in alive):
                time.sleep(0.02)
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            self._write([])
            return alive

    def _read(self) -> list[tuple[int, str]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            pid, _, started = line.partition(" ")
            if pid.isdigit() and started:
                out.append((int(pid), started))
        return out

    def _write(self, rows: list[tuple[int, str]]) -> None:
        if not rows:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{pid} {started}\n" for pid, started in rows))
        tmp.replace(self.path)


class DirLock:
    """An exclusive `flock` on `path`, held while the process lives (the kernel drops it when the
    process dies, kill -9 included, so a stale lock never blocks a restart). The file holds the
    holder's pid, for the error a second process gets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, what: str) -> None:
        """Take the lock (no-op if this object holds it); CorralError naming the holder if another
        process does. `what` names the folder's use in that error."""
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise CorralError(
                f"another {what} (pid {holder}) is running on {self.path.parent}; stop it first, "
                "or give this one a folder of its own (server.log_dir and server.data_dir)"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None
