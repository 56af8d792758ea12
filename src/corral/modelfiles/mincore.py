"""How much of a model's files the host's page cache holds, and making a file cold.

`cached` maps each file read-only and asks `mincore(2)` which of its pages are in memory, a
window of `WINDOW_BYTES` at a time (a vector of one byte per page: 256 KiB per GiB of file),
so that its cost is bounded whatever the file's size: milliseconds per GiB, no page read.
`drop` asks the kernel to drop a file's clean pages (`posix_fadvise(POSIX_FADV_DONTNEED)`: no
privileges; pages a running server maps stay). A split GGUF (`-00001-of-00003`) is its parts
together (`parts`). Off Linux, or for a file that cannot be opened, `cached` says None: unknown,
which the scheduler treats as cached (its loads priced as measured)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from corral.modelfiles.folder import SPLIT

WINDOW_BYTES = 1 << 30
_PAGE = mmap.PAGESIZE
_RESIDENT = bytes(b & 1 for b in range(256))  # mincore's low bit: the page is resident


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def parts(path: Path) -> list[Path]:
    """The files llama.cpp reads for `path`: all parts of a split GGUF named by any of its
    parts (those present), else `path` itself."""
    split = SPLIT.match(path.stem)
    if split is None:
        return [path]
    n = int(split["parts"])
    stem = split["stem"]
    found = [path.with_name(f"{stem}-{i:05d}-of-{n:05d}{path.suffix}") for i in range(1, n + 1)]
    return [p for p in found if p.is_file()] or [path]


def resident_bytes(path: Path) -> tuple[int, int] | None:
    """(bytes cached, bytes in all) of one file; None if it cannot be measured."""
    if _LIBC is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        cached = 0
        for start in range(0, size, WINDOW_BYTES):
            length = min(WINDOW_BYTES, size - start)
            got = _window(fd, start, length)
            if got is None:
                return None
            cached += got
        return min(cached, size), size
    finally:
        os.close(fd)


def _window(fd: int, start: int, length: int) -> int | None:
    assert _LIBC is not None
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        pages = (length + _PAGE - 1) // _PAGE
        vec = ctypes.create_string_buffer(pages)
        if _LIBC.mincore(addr, length, vec) != 0:
            return None
        return vec.raw[:pages].translate(_RESIDENT).count(1) * _PAGE
    finally:
        _LIBC.munmap(addr, length)


def cached(paths: Sequence[Path]) -> float | None:
    """The fraction (0-1) of `paths` together that the page cache holds; None if any cannot
    be measured, or they are empty."""
    held = total = 0
    for p in paths:
        got = resident_bytes(p)
        if got is None:
            return None
        held += got[0]
        total += got[1]
    return held / total if total else None


def drop(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop `paths`' clean cached pages (those mapped by a process stay)."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
