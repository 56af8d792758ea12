"""The in-process models' loads and unloads (`Loads`, a part the `Worker` owns): their hooks
run in order per device, and each load is reported to the scheduler, unless it was aborted."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from corral.core import Scheduler
from corral.worker.execute import describe
from corral.worker.node import Node
from corral.worker.registry import Registry

log = logging.getLogger("corral.worker")


class Loads:
    """Runs the model hooks of the loads and unloads the scheduler asks for."""

    def __init__(self, registry: Registry, node: Node, sched: Callable[[], Scheduler]) -> None:
        self.registry = registry
        self.node = node
        self._sched = sched
        self._device_lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._aborted: dict[tuple[str, str], int] = defaultdict(int)  # loads to leave unreported

    def abort(self, model: str, device: str) -> None:
        """In-process handlers load in a thread that cannot be interrupted: the load under way
        ends unreported (the model then unloads: a later load on the device waits for both)."""
        self._aborted[model, device] += 1

    async def swap(self, model: str, device: str, evict: tuple[str, ...]) -> None:
        """Unload `evict`, then load `model`, on `device`; the scheduler hears how it went."""
        sched = self._sched()
        async with self._device_lock[device]:  # after an unload issued before it
            started = time.monotonic()
            try:
                for name in evict:
                    hooks = self.registry.models.get(name)
                    if hooks is not None and hooks.unload is not None:
                        await _maybe_await(hooks.unload)
                unloaded = time.monotonic()
                hooks = self.registry.models.get(model)
                if hooks is not None and hooks.load is not None:
                    await _maybe_await(hooks.load)
            except Exception as exc:
                if not self._unreported(model, device):
                    self.node.held(model, None)
                    sched.on_load_failed(model, describe(exc))
                return
        if self._unreported(model, device):
            return
        if model in self.node.residency.held:
            self.node.held(model, device)
        sched.on_load_finished(
            model,
            load_s=time.monotonic() - unloaded,
            unload_s=(unloaded - started) if evict else None,
        )

    async def unload(self, model: str, device: str) -> None:
        async with self._device_lock[device]:
            hooks = self.registry.models.get(model)
            if hooks is not None and hooks.unload is not None:
                try:
                    await _maybe_await(hooks.unload)
                except Exception as exc:  # the model is gone from the schedule either way
                    log.warning("model %s: unload hook failed: %s", model, describe(exc))

    def _unreported(self, model: str, device: str) -> bool:
        """The load of `model` on `device` that just ended was aborted: no report comes."""
        if not self._aborted[model, device]:
            return False
        self._aborted[model, device] -= 1
        return True


async def _maybe_await(hook: object) -> None:
    if inspect.iscoroutinefunction(hook):
        await hook()
    else:
        await asyncio.to_thread(hook)  # type: ignore[arg-type]
