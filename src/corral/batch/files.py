"""The bytes of uploaded and result files, in one folder. Every file is written under a
temporary name, synced, then renamed: a crash never leaves half a file visible."""

from __future__ import annotations

import contextlib
import os
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

    @staticmethod
    def new_id() -> str:
        return f"file-{uuid.uuid4().hex}"

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    @contextlib.contextmanager
    def _atomic(self, file_id: str) -> Iterator[BinaryIO]:
        """An open file that becomes `file_id` (whole, synced) only if the block succeeds."""
        # A name of its own: two nodes of a cluster sharing the folder may write one file.
        tmp = self.root / f".{file_id}.{uuid.uuid4().hex[:8]}.part"
        try:
            with tmp.open("wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def save(self, file_id: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Write `chunks` as `file_id`; returns its size. `TooLarge` past `max_bytes`."""
        size = 0
        with self._atomic(file_id) as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(f"over {max_bytes} bytes")
                f.write(chunk)
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
