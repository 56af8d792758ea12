"""A small tmpfs for tests of a full disk (mounting needs root: CI runs as root)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's notation: `64k`, `16m`) mounted at `where`, created."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
