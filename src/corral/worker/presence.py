"""This worker's presence in its store (`Presence`, a part the `Worker` owns): it says it is
alive and what it serves, and tells once of each model whose queued tasks no live worker
serves."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from corral.limits import PRESENCE_S
from corral.store import TaskStatus
from corral.store.roles import Liveness
from corral.worker.residency import Holdings
from corral.worker.settings import WorkerSettings

log = logging.getLogger("corral.worker")


class Presence:
    """`unserved`: models with queued tasks no live worker serves, with how many (updated each
    `lease_s / 2`)."""

    def __init__(
        self,
        store: Liveness,
        worker_id: str,
        models: Sequence[str],
        settings: WorkerSettings,
        residency: Holdings,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.models = models
        self.settings = settings
        self.residency = residency
        self.unserved: dict[str, int] = {}

    def look(self) -> dict[str, int]:
        """Say this worker is alive (blocking: run it in a thread); returns the models with
        queued tasks that no live worker serves, with how many."""
        self.store.members.worker_seen(self.worker_id, self.models, self.settings.url)
        window_s = max(PRESENCE_S, 2 * self.settings.lease_s)
        live = self.store.members.workers(time.time() - window_s)
        if self.settings.affinity:  # its rows stay fresh
            self.store.members.set_residency(self.worker_id, self.residency.rows())
        served = set(self.models).union(*live.values())
        counts = self.store.counts()
        return {
            m: c[TaskStatus.QUEUED]
            for m, c in sorted(counts.items())
            if c.get(TaskStatus.QUEUED) and m not in served
        }

    def report(self, unserved: dict[str, int]) -> None:
        """Log each model that nobody serves once (again if it was served meanwhile)."""
        for model, n in unserved.items():
            if model not in self.unserved:
                log.warning(
                    "%d task(s) queued for model %r, which no running worker serves (this one "
                    "serves %s): they wait until a worker with a handler for %r runs",
                    n,
                    model,
                    ", ".join(self.models) or "nothing",
                    model,
                )
        self.unserved = unserved
