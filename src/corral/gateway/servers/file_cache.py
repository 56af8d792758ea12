"""Each model's file in the host's page cache: `Files`, the one owner in `corral
serve` of those measures and of the reads that prepare them.

Measured: every `EVERY_S`, and after each swap, the fraction of each model's files cached
(modelfiles/mincore.py: `mincore`, milliseconds per GiB, off the loop) is told to the
scheduler (`PageCache.measured`), which prices that model's next load by it. Only models whose
command names a file (`-m`) are measured; the others are priced as before.

Prepared (`scheduler.prepare`, on by default): after each measure, the scheduler's `wanted`
files (core/pagecache.py: waiting work first, then the predicted successors) are read in, the
most likely first whose uncached bytes fit in the memory the kernel calls available less
`MARGIN_BYTES` and less the cached bytes of the files that must stay: the held models' (a
server's) and the more likely wanted ones'. So a read pushes out no such file's pages, only
others' (the kernel drops its least recently used pages first); a wanted file that does not
fit stops the search, so a less likely file never starts ahead of it.
One read at a time, sequential, at most `READ_BYTES_S`, in a thread; stopped between chunks
when the scheduler wants another file first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from corral.backends.base import Backend
from corral.backends.process import ProcessBackend
from corral.cmdline import model_file
from corral.core.pagecache import PageCache
from corral.modelfiles.engine_memory import split_command
from corral.modelfiles.mincore import cached, parts

log = logging.getLogger("corral.gateway")

EVERY_S = 1.0  # a measure is at most this old when a load is priced (plus a swap's own)
MARGIN_BYTES = 1 << 30  # memory left available beside a preparation's read
READ_BYTES_S = 1 << 30  # a preparation reads at most this fast (loads share the disk)
_CHUNK = 16 << 20
_DONE = 0.98  # a file this much cached is prepared
# llama-server's load mode, set per start through its environment (its own flags win: they
# are read after the environment; so does a model's own `env`).
LOAD_MODE_ENV = "LLAMA_ARG_LOAD_MODE"
_OWN = "-lm --load-mode --mmap --no-mmap --mlock -dio --direct-io --no-direct-io"
OWN_MODE_FLAGS = frozenset(_OWN.split())


class Files:
    """The models' files (from each own server's command), their fractions cached as last
    measured, and the preparation under way. `cache()` is the scheduler's `PageCache`."""

    def __init__(
        self,
        backends: Mapping[str, Backend],
        cache: Callable[[], PageCache],
        clock: Callable[[], float],
        prepare: bool = True,
    ) -> None:
        self._backends = backends
        self._cache = cache
        self._clock = clock
        self.prepare_on = prepare
        self._paths: dict[str, tuple[str, list[Path]]] = {}  # model -> (its cmd, its files)
        self.fractions: dict[str, float] = {}
        self.reading: str | None = None  # the file being prepared
        self.prepared_bytes = 0  # read by preparations so far
        self.prepared: dict[str, int] = {}  # reads finished, per model
        # Read whole since their last load: not read again before it (where the page cache
        # cannot keep a file until its load, reading it again only thrashes).
        self._read_since_load: set[str] = set()
        self._stop = threading.Event()
        self._reader: asyncio.Future[None] | None = None
        self._wake: asyncio.Event | None = None

    def paths(self, model: str) -> list[Path]:
        """The files `model`'s server reads at a load (none known: empty)."""
        b = self._backends.get(model)
        if not isinstance(b, ProcessBackend):
            return []
        return self._paths_of(model, b.spec.cmd)

    def _paths_of(self, model: str, cmd: str) -> list[Path]:
        """`paths` for `model` run as `cmd`, kept while its command stays (`measure` asks
        from a thread: splitting every model's command is tens of milliseconds for 200)."""
        known = self._paths.get(model)
        if known is None or known[0] != cmd:
            try:
                path = model_file(split_command(cmd, 0))
            except ValueError:  # a command shlex cannot split: its server says why at start
                path = None
            known = self._paths[model] = (cmd, [] if path is None else parts(path))
        return known[1]

    def load_mode(self, model: str, available_bytes: int | None = None) -> str | None:
        """The load mode for `model`'s next start (`load_mode_for`, with the memory available
        now unless given), None to leave the server's own: no file known, not measured, or
        its command or `env` sets one."""
        size, fraction = self._size(model), self.fractions.get(model)
        b = self._backends.get(model)
        if size is None or fraction is None or not isinstance(b, ProcessBackend):
            return None
        if LOAD_MODE_ENV in b.spec.env or any(
            a.split("=", 1)[0] in OWN_MODE_FLAGS for a in split_command(b.spec.cmd, 0)
        ):
            return None
        if available_bytes is None:
            available_bytes = psutil.virtual_memory().available
        return load_mode_for(fraction, size, available_bytes)

    def loaded(self, model: str) -> None:
        """`model` loaded: its file may be prepared again before its next load; measure now
        (the load read its file in, and may have pushed others out)."""
        self._read_since_load.discard(model)
        self.soon()

    def soon(self) -> None:
        """Measure again now (a swap moved files in or out of the page cache)."""
        if self._wake is not None:
            self._wake.set()

    async def measure(self) -> None:
        """One pass over every model with a file: measured off the loop, told on it."""
        cmds = {
            m: b.spec.cmd for m, b in list(self._backends.items()) if isinstance(b, ProcessBackend)
        }
        if not cmds:
            return

        def fractions() -> dict[str, float | None]:
            files = {m: p for m, cmd in cmds.items() if (p := self._paths_of(m, cmd))}
            return {m: cached(p) for m, p in files.items()}

        got = await asyncio.to_thread(fractions)
        cache = self._cache()
        for model, fraction in got.items():
            if fraction is not None and model in self._backends:
                self.fractions[model] = fraction
                cache.measured(model, fraction)

    def target(self, available_bytes: int) -> str | None:
        """The file to read in now: the first wanted one not prepared yet whose missing bytes
        fit in `available_bytes` less the margin and less the cached bytes of the files that
        must stay (the held models' and the more likely wanted ones'); a wanted file that does
        not fit stops the search (a less likely file read ahead of it could push it out)."""
        cache = self._cache()
        room: float = available_bytes - MARGIN_BYTES
        room -= sum(self._cached_bytes(m) for m in cache.held())
        for model in cache.wanted(self._clock()):
            size = self._size(model)
            fraction = self.fractions.get(model)
            if size is None or fraction is None:
                continue
            if fraction >= _DONE or model in self._read_since_load:
                room -= self._cached_bytes(model)  # prepared (or as far as it stays): kept
                continue
            return model if (1.0 - fraction) * size <= room else None
        return None

    def _size(self, model: str) -> int | None:
        paths = self.paths(model)
        try:
            return sum(p.stat().st_size for p in paths) if paths else None
        except OSError:
            return None

    def _cached_bytes(self, model: str) -> float:
        size = self._size(model)
        return 0.0 if size is None else self.fractions.get(model, 0.0) * size

    def _prepare(self) -> None:
        """Start, keep or stop the preparation the scheduler wants now."""
        if not self.prepare_on:
            return
        want = self.target(psutil.virtual_memory().available)
        if want == self.reading:
            return
        if self._reader is not None:
            self._stop.set()  # the thread ends at its next chunk
            return  # the next pass starts the new one, once this one has ended
        if want is not None:
            self.reading = want
            self._stop = threading.Event()
            self._reader = asyncio.ensure_future(
                asyncio.to_thread(self._read, want, self.paths(want), self._stop)
            )
            self._reader.add_done_callback(self._read_ended)

    def _read(self, model: str, paths: list[Path], stop: threading.Event) -> None:
        """Read `paths` through the page cache, sequentially, at most `READ_BYTES_S`."""
        buf = bytearray(_CHUNK)
        started = time.monotonic()
        done = 0
        for path in paths:
            with path.open("rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while not stop.is_set():
                    n = f.readinto(buf)
                    if not n:
                        break
                    done += n
                    self.prepared_bytes += n
                    ahead_s = done / READ_BYTES_S - (time.monotonic() - started)
                    if ahead_s > 0:
                        stop.wait(ahead_s)
            if stop.is_set():
                return
        self.prepared[model] = self.prepared.get(model, 0) + 1
        self._read_since_load.add(model)

    def _read_ended(self, fut: asyncio.Future[None]) -> None:
        self._reader = None
        self.reading = None
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("preparing a model's file: %s", fut.exception())
        self.soon()

    async def run(self) -> None:
        """Measure and prepare every `EVERY_S`, or sooner when asked (`soon`), until
        cancelled (a read under way then ends at its next chunk)."""
        self._wake = asyncio.Event()
        try:
            while True:
                self._wake.clear()
                try:
                    await self.measure()
                    self._prepare()
                except Exception:  # a measure never stops serving; the next pass tries again
                    log.exception("measuring the models' files in the page cache")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EVERY_S):
                        await self._wake.wait()
        finally:
            self._stop.set()

    def view(self) -> dict[str, object]:
        """What /api/status shows of the preparations (`prepare`)."""
        cache = self._cache()
        p = cache.prediction
        return {
            "on": self.prepare_on,
            "reading": self.reading,
            "wanted": cache.wanted(self._clock())[:5],
            "predicted_next": p.next,
            "hits": p.hits,
            "misses": p.misses,
            "prepared_gb": round(self.prepared_bytes / 1e9, 3),
            "prepared": dict(self.prepared),
        }


def load_mode_for(cached: float, file_bytes: int, available_bytes: int) -> str | None:
    """The load mode for a file `cached` (0-1) in the page cache, of `file_bytes`, with
    `available_bytes` of memory the kernel calls available; None: the server's default, mmap.
    From docs/benchmarks.md, "Swaps and loads" (the 2-core machine, 1-8 GB zoo files): mmap loads a
    cached file fastest (a plain read 1.4-2.2x slower, direct I/O reads the disk again), and a
    cold one as fast as any mode while leaving it cached for the next load; direct I/O reads a
    cold file as fast (8 GB: 14.8 s against 15.4) with half the memory and pushes no other file
    out of the page cache, so it is chosen for a cold file that could not stay cached beside
    what runs now."""
    if cached < 0.5 and available_bytes < file_bytes + MARGIN_BYTES:
        return "dio"
    return None
