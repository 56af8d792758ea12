"""What this worker holds and what the others hold, for model affinity (`Worker` mixes this
in): the rows it writes to the residency table, the cluster it reads back, and the models whose
waiting tasks it shows its scheduler (the rule itself is worker/affinity.py)."""

from __future__ import annotations

import asyncio
import logging
import time

from corral.core import Scheduler
from corral.store import Level, Residency, Store, StoreError
from corral.worker.affinity import ModelView, shown
from corral.worker.settings import WorkerSettings

log = logging.getLogger("corral.worker")

CLUSTER_READ_S = 0.2  # the cluster is read at most this often (two small reads beside a scan)


class Residing:
    """The residency half of `Worker`; the attributes below are the worker's."""

    store: Store
    settings: WorkerSettings
    worker_id: str
    models: list[str]
    # What this worker holds, (device, state) per model; the live workers and the models each
    # serves, and the table's fresh rows, as last read.
    _held: dict[str, tuple[str, str]]
    _live: dict[str, list[str]]
    _residency: list[Residency]
    _cluster_read_at: float
    _residency_lock: asyncio.Lock

    def _sched(self) -> Scheduler:
        raise NotImplementedError

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        raise NotImplementedError

    def _per(self, model: str) -> int:
        raise NotImplementedError

    def held(self, model: str, device: str | None, state: str = "ready") -> None:
        """Attached: the adapter that does the loads says what this node holds (`device` None:
        no longer), for the other workers and nodes of the cluster (worker/affinity.py)."""
        if device is None:
            self._held.pop(model, None)
        else:
            self._held[model] = (device, state)
        self._publish()

    def _rows(self) -> list[tuple[str, str, str]]:
        return [(dev, m, st) for m, (dev, st) in self._held.items()]

    def _publish(self) -> None:
        """Tell other workers what this one holds, at once (a worker starting beside it must
        not load the same model meanwhile)."""
        if self.settings.affinity:
            self._spawn(self._send_residency())

    async def _send_residency(self) -> None:
        """One at a time, each with what it holds by then: the last write is the latest."""
        async with self._residency_lock:
            try:
                await asyncio.to_thread(self.store.set_residency, self.worker_id, self._rows())
            except StoreError as exc:  # said again with the next presence
                log.warning("could not record this worker's models: %s", exc)

    def _read_cluster(self, started: float) -> None:
        """Who else serves the database, and what they hold (in a thread; at most every
        `CLUSTER_READ_S`): fresh enough to place loads. Both are said again every lease_s / 2: a
        worker silent for a whole lease is dead (its tasks come back then too), and its models
        are nobody's."""
        if not self.settings.affinity or started < self._cluster_read_at:
            return
        since = time.time() - self.settings.lease_s
        self._live = self.store.workers(since)
        self._residency = self.store.residency(since)
        self._cluster_read_at = started + CLUSTER_READ_S

    def _clustered(self) -> bool:
        """Other workers serve this database (affinity applies)."""
        return self.settings.affinity and (
            len(self._live) > 1 or any(r.worker_id != self.worker_id for r in self._residency)
        )

    def _shown(self, ready: dict[str, dict[Level, int]]) -> set[str]:
        """The models whose waiting tasks this worker's scheduler sees (worker/affinity.py)."""
        sched = self._sched()
        views = {}
        for m in self.models:
            rec = sched.models[m]
            views[m] = ModelView(
                waiting=sum(ready.get(m, {}).values()),
                load_s=rec.load_est,
                task_s=rec.service_est / max(1, self._per(m)) / max(1, rec.concurrency),
            )
        live = dict(self._live)
        live.setdefault(self.worker_id, list(self.models))
        return shown(self.worker_id, views, set(self._held), live, self._residency)
