"""The bytes of uploaded and result files, in one folder. Every file is written under a
temporary name (`.<id>.<random>.part`), synced, then renamed: a crash never leaves half a file
visible. The writer holds an exclusive `flock` on its `.part` for as long as it writes, and the
kernel drops it when the writer dies (kill -9 included), so `sweep_parts` can tell a leftover
from a file another process of a cluster is writing into the same folder right now."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO


class TooLarge(Exception):
    """An upload went over its size limit; nothing was kept."""


class FileStorage:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.sweep_parts()  # what a killed run left

    def sweep_parts(self, min_age_s: float = 5.0) -> int:
        """Remove `.part` files nobody is writing (no lock held on them, and untouched for
        `min_age_s`: a writer takes its lock just after it creates the file); returns how
        many."""
        gone = 0
        now = time.time()
        for part in self.root.glob(".*.part"):
            try:
                if now - part.stat().st_mtime < min_age_s:
                    continue
                fd = os.open(part, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            else:
                part.unlink(missing_ok=True)
                gone += 1
            finally:
                os.close(fd)
        return gone

    @staticmethod
    def new_id() -> str:
        return f"file-{uuid.uuid4().hex}"

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def _part(self, file_id: str) -> Path:
        # A name of its own: two nodes of a cluster sharing the folder may write one file.
        return self.root / f".{file_id}.{uuid.uuid4().hex[:8]}.part"

    @contextlib.contextmanager
    def _atomic(self, file_id: str) -> Iterator[BinaryIO]:
        """An open file that becomes `file_id` (whole, synced) only if the block succeeds."""
        tmp = self._part(file_id)
        try:
            with _open_locked(tmp) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def save(self, file_id: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Write `chunks` as `file_id`; returns its size. `TooLarge` past `max_bytes`. The
        writes and the sync run in a thread: a 200 MB upload never blocks the event loop."""
        size = 0
        tmp = self._part(file_id)
        try:
            f = await asyncio.to_thread(_open_locked, tmp)
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(f"over {max_bytes} bytes")
                    await asyncio.to_thread(f.write, chunk)
                await asyncio.to_thread(_sync, f)
            finally:
                f.close()
            tmp.replace(self.path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def write(self, file_id: str, lines: Iterable[bytes]) -> int:
        """Write `lines` as `file_id` (replacing it whole if it exists); returns its size."""
        size = 0
        with self._atomic(file_id) as f:
            for line in lines:
                f.write(line)
                size += len(line)
        return size

    def remove(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(file_id).unlink()


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _open_locked(path: Path) -> BinaryIO:
    """`path` created for writing, with this process's exclusive lock on it (see the module
    docstring)."""
    f = path.open("wb")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f
