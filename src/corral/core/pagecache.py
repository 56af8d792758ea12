"""The host's page cache as the scheduler sees it (`PageCache`, a part the scheduler owns): per
model, the fraction of its weights file the page cache holds, as the shell last measured it
(`corral serve`: `mincore` over the file, modelfiles/pagecache.py; the simulator: its model of
the host's page cache, sim/pagecache.py). Each model's load is priced at that fraction, between
its warm and cold load figures (`Estimates.load_s`), and each measured load is read at the
fraction its load began with (`Estimates.load_begins`). A model never measured counts as cached:
its loads are priced by its measured loads alone, as before issue 51."""

from __future__ import annotations

import math
from collections.abc import Mapping

from corral.core.state import ModelRecord


class PageCache:
    """Measured fractions in, onto each model's estimates (`Estimates.cached`)."""

    def __init__(self, models: Mapping[str, ModelRecord]) -> None:
        self._models = models

    def measured(self, model: str, fraction: float) -> None:
        """`fraction` (0-1) of `model`'s file is cached now; an unknown model or a fraction
        that is not a number is ignored (a measure never stops the scheduler)."""
        m = self._models.get(model)
        if m is not None and not math.isnan(fraction):
            m.est.cached = min(1.0, max(0.0, fraction))

    def cached(self, model: str) -> float | None:
        """The fraction of `model`'s file cached as last measured (None: never, or unknown)."""
        m = self._models.get(model)
        return None if m is None else m.est.cached
