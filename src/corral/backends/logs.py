"""A model server's log, bounded: its output is copied by a thread (never the serving loop)
into `<model>.log`, which is rotated by size (`<model>.log.1` the previous one, up to
`files - 1` old ones), so a server left running for weeks keeps at most `max_bytes * files`
on disk. Readers (`tail`) read across the rotation."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import termios
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_LINE_MAX = 1 << 16  # a line without an end is written as it is past this


@dataclass(frozen=True)
class LogLimits:
    """`max_bytes`: the size at which a log is rotated; `files`: how many are kept, the current
    one included (at least 1; 1 keeps only the current one, cut when it is full)."""

    max_bytes: int = 32 << 20
    files: int = 3

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.files < 1:
            raise ValueError("a log needs max_bytes >= 1 and files >= 1")


def rotated(path: Path, files: int) -> list[Path]:
    """The log's files, oldest first, the current one last (those that exist)."""
    every = [path.with_name(f"{path.name}.{k}") for k in range(files - 1, 0, -1)] + [path]
    return [p for p in every if p.exists()]


def tail(path: Path, files: int, limit_bytes: int) -> bytes:
    """The last `limit_bytes` of the log, read across its rotated files."""
    parts: list[bytes] = []
    left = limit_bytes
    for p in reversed(rotated(path, files)):
        try:
            with p.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - left))
                data = f.read(left)
        except OSError:
            continue
        parts.append(data)
        left -= len(data)
        if left <= 0:
            break
    return b"".join(reversed(parts))


class RotatingLog:
    """An append-only log file rotated at `limits.max_bytes`. Thread-safe: the pump thread and
    the backend's own notes (start, stop) write to it."""

    def __init__(self, path: Path, limits: LogLimits) -> None:
        self.path = path
        self.limits = limits
        self.rotations = 0  # how many times it was rotated (a reader's offset is in `.1` after)
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._size = 0

    def _open(self) -> BinaryIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
            self._size = self._file.tell()
        return self._file

    @property
    def size(self) -> int:
        """Bytes in the current file."""
        with self._lock:
            self._open()
            return self._size

    def write(self, data: bytes) -> None:
        """Append `data` (whole lines, ideally) and rotate if the file is now full."""
        with self._lock:
            f = self._open()
            f.write(data)
            f.flush()
            self._size += len(data)
            if self._size >= self.limits.max_bytes:
                self._rotate()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        keep = self.limits.files
        with contextlib.suppress(OSError):
            if keep == 1:
                self.path.unlink()
            else:
                for k in range(keep - 1, 1, -1):
                    older = self.path.with_name(f"{self.path.name}.{k - 1}")
                    if older.exists():
                        older.replace(self.path.with_name(f"{self.path.name}.{k}"))
                self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self.rotations += 1
        # The log's own name always names a file (`tail -F`, a glob, a reader between two
        # writes): the next one begins now, not at the next write, which may never come.
        with contextlib.suppress(OSError):  # the next write tries again
            self._open()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Pump:
    """Copies a server's output (the read end of its pipe) into its log on a thread of its own.
    Once `ready()` was called, lines matching `quiet` are left out; `heard(line)` is called
    (from the thread) with each line matching `ready_line` until then. `done` (from the thread)
    when the output ends."""

    def __init__(
        self,
        fd: int,
        log: RotatingLog,
        quiet: str | None,
        ready_line: str | None,
        heard: Callable[[], object],
        done: Callable[[], object],
    ) -> None:
        self._fd = fd
        self._log = log
        self._quiet = re.compile(quiet.encode()) if quiet else None
        self._ready_line = re.compile(ready_line.encode()) if ready_line else None
        self._heard = heard
        self._done = done
        self._ready = threading.Event()
        self._reads = 0  # reads begun; the thread waits in the last one while `_waiting`
        self._waiting = False
        self._thread = threading.Thread(target=self._run, name=f"log {log.path.name}", daemon=True)
        self._thread.start()

    def ready(self) -> None:
        """The server serves: its quiet lines are left out from now on."""
        self._ready.set()

    def idle(self) -> tuple[bool, int]:
        """Whether the thread waits for output with none in the pipe (all written so far is
        in the log), and how many reads it has begun: two answers with the same count, the
        first idle, mean it copied everything written before the first (on a busy machine the
        thread runs seconds behind its server)."""
        reads, waiting = self._reads, self._waiting
        try:
            pending = struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0" * 4))[0]
        except OSError:  # closed: its output ended
            return True, reads
        return waiting and pending == 0, reads

    def _run(self) -> None:
        rest = b""
        heard = False
        try:
            with os.fdopen(self._fd, "rb", buffering=0) as out:
                while True:
                    self._reads += 1
                    self._waiting = True
                    chunk = out.read(1 << 16)
                    self._waiting = False
                    if not chunk:
                        break
                    if self._quiet is None and self._ready_line is None:
                        self._log.write(chunk)
                        continue
                    *lines, rest = (rest + chunk).split(b"\n")
                    if len(rest) > _LINE_MAX:
                        lines, rest = [*lines, rest], b""
                    kept = []
                    was_heard = heard
                    for x in lines:
                        if heard or self._ready.is_set():
                            if self._quiet is not None and self._quiet.match(x):
                                continue
                        elif self._ready_line is not None and self._ready_line.search(x):
                            heard = True
                        kept.append(x + b"\n")
                    if kept:
                        self._log.write(b"".join(kept))
                    if heard and not was_heard:  # once the lines before it are in the log
                        _call(self._heard)
            if rest:
                self._log.write(rest)
        except OSError:
            pass
        finally:
            _call(self._done)


def _call(hear: Callable[[], object]) -> None:
    # Its loop may be closed already (the gateway stopped while a server still wrote).
    with contextlib.suppress(RuntimeError):
        hear()


class Follower:
    """The lines added to a log file since the last `read`, across its rotation (the file
    renamed to `<name>.1` and a new one begun) and a new server run truncating it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode = -1
        self._offset = 0
        self._partial = b""

    def skip(self) -> None:
        """Follow from its present end."""
        with contextlib.suppress(OSError):
            st = self.path.stat()
            self._inode, self._offset = st.st_ino, st.st_size

    def read(self, limit_bytes: int = 1 << 20) -> list[str]:
        data = b""
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self._inode:  # rotated: the rest of the old file first
            old = self.path.with_name(f"{self.path.name}.1")
            with contextlib.suppress(OSError):
                if self._inode >= 0 and old.stat().st_ino == self._inode:
                    data = _read(old, self._offset, limit_bytes)
            self._inode, self._offset = st.st_ino, 0
        elif st.st_size < self._offset:
            self._offset = 0
        new = _read(self.path, self._offset, limit_bytes)
        self._offset += len(new)
        *done, self._partial = (self._partial + data + new).split(b"\n")
        return [line.decode(errors="replace") for line in done]


def _read(path: Path, offset: int, limit_bytes: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(limit_bytes)
    except OSError:
        return b""
