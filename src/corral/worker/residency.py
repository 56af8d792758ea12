"""What this worker holds and what the others hold, for model affinity: the rows it writes to
the residency table, the cluster it reads back, and the models whose waiting tasks it shows
its scheduler (the rule itself is worker/affinity.py). One owner: `Residency`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from corral.store import Membership, Residency, StoreError
from corral.worker.affinity import ModelView, shown
from corral.worker.settings import WorkerSettings

log = logging.getLogger("corral.worker")

CLUSTER_READ_S = 0.2  # the cluster is read at most this often (two small reads beside a scan)

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Holdings:
    """This worker's residency: what it holds, (device, state) per model, and the cluster's
    (the live workers with the models each serves, the table's fresh rows) as last read."""

    def __init__(
        self, store: Membership, settings: WorkerSettings, worker_id: str, models: Sequence[str]
    ) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self.models = list(models)
        self.held: dict[str, tuple[str, str]] = {}
        self._live: dict[str, list[str]] = {}
        self._table: list[Residency] = []
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    def hold(self, model: str, device: str | None, state: str = "ready") -> None:
        """`model` is held on `device` (None: no longer); the cluster hears it (`publish`)."""
        if device is None:
            self.held.pop(model, None)
        else:
            self.held[model] = (device, state)

    def rows(self) -> list[tuple[str, str, str]]:
        return [(dev, m, st) for m, (dev, st) in self.held.items()]

    def publish(self, spawn: Spawn) -> None:
        """Tell other workers what this one holds, at once (a worker starting beside it must
        not load the same model meanwhile)."""
        if self.settings.affinity:
            spawn(self._send())

    async def _send(self) -> None:
        """One at a time, each with what it holds by then: the last write is the latest."""
        async with self._lock:
            try:
                await asyncio.to_thread(self.store.set_residency, self.worker_id, self.rows())
            except StoreError as exc:  # said again with the next presence
                log.warning("could not record this worker's models: %s", exc)

    def read(self, started: float) -> None:
        """Who else serves the database, and what they hold (in a thread; at most every
        `CLUSTER_READ_S`): fresh enough to place loads. Both are said again every lease_s / 2: a
        worker silent for a whole lease is dead (its tasks come back then too), and its models
        are nobody's."""
        if not self.settings.affinity or started < self._read_at:
            return
        since = time.time() - self.settings.lease_s
        self._live = self.store.workers(since)
        self._table = self.store.residency(since)
        self._read_at = started + CLUSTER_READ_S

    def clustered(self) -> bool:
        """Other workers serve this database (affinity applies)."""
        return self.settings.affinity and (
            len(self._live) > 1 or any(r.worker_id != self.worker_id for r in self._table)
        )

    def shown(self, views: Mapping[str, ModelView]) -> set[str]:
        """The models whose waiting tasks this worker's scheduler sees (worker/affinity.py)."""
        live = dict(self._live)
        live.setdefault(self.worker_id, list(self.models))
        return shown(self.worker_id, views, set(self.held), live, self._table)
