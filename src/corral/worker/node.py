"""What this node holds, told as it swaps (`Node`, a part the `Worker` owns): the evicted
models' tasks claimed ahead go back to the queue, and the cluster hears what is held now. The
worker's own swaps tell it; so does the gateway's, for the batch worker attached to it (the
gateway's `Holder`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from corral.worker.residency import Holdings

Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]


class Node:
    """This node's holdings as swaps begin and end (runs on the worker's loop)."""

    def __init__(
        self,
        residency: Holdings,
        release_ahead: Callable[[str], Coroutine[Any, Any, None]],
        spawn: Spawn,
    ) -> None:
        self.residency = residency
        self._release_ahead = release_ahead
        self._spawn = spawn

    def evicted(self, model: str) -> None:
        """`model` left the device: tasks claimed ahead for it go back to the queue."""
        self._spawn(self._release_ahead(model))

    def loading(self, model: str, device: str, evict: Sequence[str], replica: bool = False) -> None:
        """A swap begins: the evicted models' tasks claimed ahead go back, and the cluster hears
        what is held now, once. `replica`: a second copy of a model this node already holds
        (what it holds stays as it is)."""
        for name in evict:
            self.evicted(name)
            self.residency.hold(name, None)
        if not replica:
            self.residency.hold(model, device, "loading")
        self.residency.publish(self._spawn)

    def gone(self, model: str, left: Sequence[str] = ()) -> None:
        """`model`'s copy is being unloaded (see `loading`); `left`: the devices where its
        other copies run (the node still holds it there)."""
        if left:
            self.held(model, left[0])
            return
        self.evicted(model)
        self.held(model, None)

    def held(self, model: str, device: str | None, state: str = "ready") -> None:
        """This node holds `model` on `device` now (None: no longer), for the other workers and
        nodes of the cluster (worker/affinity.py)."""
        self.residency.hold(model, device, state)
        self.residency.publish(self._spawn)
