"""The records of the gateway's swaps: `Swap`, one load as /api/status shows it, and `Load`, one
load or wake under way on a device (what `Gateway.abort` stops); `Holder`, who hears what this
node holds."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from corral.backends.base import Backend


@dataclass
class Swap:
    """One load, for /api/status."""

    model: str
    evicted: tuple[str, ...]
    started_at: float  # epoch seconds
    load_s: float | None = None
    unload_s: float | None = None
    error: str | None = None
    slept: tuple[str, ...] = ()  # put to sleep instead of stopped
    woke: bool = False  # it was woken, not started
    file_cached: float | None = None  # the fraction of its file cached as it began (measured)
    load_mode: str | None = None  # the load mode Corral chose for its server (None: its own)

    def figures(self) -> dict[str, float | bool | str | None]:
        """What the `loaded` event says of it."""
        return {
            "load_s": self.load_s,
            "unload_s": self.unload_s,
            "woke": self.woke,
            "file_cached": self.file_cached,
            "load_mode": self.load_mode,
        }


@dataclass
class Load:
    """One load or wake under way on a device: `stop` are the evicted models' servers, `naps`
    those put to sleep; `task` the start or wake, cancelled when the load is aborted."""

    model: str
    device: str
    backend: Backend | None
    evict: tuple[str, ...]
    stop: list[Backend | None]
    naps: list[tuple[str, Backend, int | None]]
    wake: bool
    level: int | None  # the level it wakes from (None: its configured one)
    aborted: bool = False
    task: asyncio.Task[tuple[float, bool]] | None = None


class Holder(Protocol):
    """Hears what this node holds as the gateway swaps (`Gateway.attach`): the batch worker
    gives its evicted models' lines claimed ahead back, and tells the cluster."""

    def loading(self, model: str, device: str, evict: Sequence[str], replica: bool = False) -> None:
        """A swap begins: `evict` leave this node (`replica`: a second copy of `model`)."""

    def gone(self, model: str, left: Sequence[str] = ()) -> None:
        """`model`'s copy is being unloaded; `left`: the devices where other copies run."""

    def held(self, model: str, device: str | None, state: str = "ready") -> None:
        """This node holds `model` on `device` now (None: no longer)."""
