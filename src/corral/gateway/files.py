"""Each model's file in the host's page cache, as measured (issue 51): `Files`, the one owner
of those measures in `corral serve`. Every `EVERY_S`, and after each swap, the fraction of each
model's files cached (modelfiles/pagecache.py: `mincore`, milliseconds per GiB, off the loop) is
told to the scheduler (`PageCache.measured`), which prices that model's next load by it. Only
models whose command names a file (`-m`) are measured; the others are priced as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from corral.backends.base import Backend
from corral.backends.process import ProcessBackend
from corral.modelfiles.engine import split_command
from corral.modelfiles.pagecache import cached, parts

log = logging.getLogger("corral.gateway")

EVERY_S = 2.0  # a measure is at most this old when a load is priced (plus a swap's own)


class Files:
    """The models' files (from each own server's command) and their fractions cached, as
    last measured; `told(model, fraction)` hears each measure."""

    def __init__(self, backends: Mapping[str, Backend], told: Callable[[str, float], None]):
        self._backends = backends
        self._told = told
        self._paths: dict[str, tuple[str, list[Path]]] = {}  # model -> (its cmd, its files)
        self.fractions: dict[str, float] = {}
        self._wake = asyncio.Event()

    def paths(self, model: str) -> list[Path]:
        """The files `model`'s server reads at a load (none known: empty)."""
        b = self._backends.get(model)
        if not isinstance(b, ProcessBackend):
            return []
        cmd = b.spec.cmd
        known = self._paths.get(model)
        if known is None or known[0] != cmd:
            from corral.prompt_cache.server import model_file

            try:
                path = model_file(split_command(cmd, 0))
            except ValueError:  # a command shlex cannot split: its server says why at start
                path = None
            known = self._paths[model] = (cmd, [] if path is None else parts(path))
        return known[1]

    def soon(self) -> None:
        """Measure again now (a swap moved files in or out of the page cache)."""
        self._wake.set()

    async def measure(self) -> None:
        """One pass over every model with a file: measured off the loop, told on it."""
        files = {m: p for m in list(self._backends) if (p := self.paths(m))}
        if not files:
            return
        got = await asyncio.to_thread(lambda: {m: cached(p) for m, p in files.items()})
        for model, fraction in got.items():
            if fraction is not None and model in self._backends:
                self.fractions[model] = fraction
                self._told(model, fraction)

    async def run(self) -> None:
        """Measure every `EVERY_S`, or sooner when asked (`soon`), until cancelled."""
        while True:
            self._wake.clear()
            try:
                await self.measure()
            except Exception:  # a measure never stops serving; the next pass tries again
                log.exception("measuring the models' files in the page cache")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), EVERY_S)
