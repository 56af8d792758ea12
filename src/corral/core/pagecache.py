"""The host's page cache as the scheduler sees it, and what it prepares there (`PageCache`, a
part the scheduler owns; issue 51).

Measured: per model, the fraction of its weights file the page cache holds, as the shell last
measured it (`corral serve`: `mincore` over the file, modelfiles/pagecache.py; the simulator:
its model of the host's page cache, sim/pagecache.py). Each model's load is priced at that
fraction, between its warm and cold load figures (`Estimates.load_s`), and each measured load is
read at the fraction its load began with (`Estimates.load_begins`). A model never measured
counts as cached: its loads are priced by its measured loads alone, as before issue 51.

Prepared: `wanted` says which files should be in the page cache next, most likely first: the
models whose work waits for a device, in the order the policy would bring them in, then the
models the learned transitions predict (agent loops alternate predictably: orchestrator,
explorer, coder). The shell reads them in while the disk and memory are free (gateway/files.py;
the simulator alike); the decision is this part's, the same in both. A transition is one model's
arrival after another's (the last arrival of a different model); each model's transitions decay
(`DECAY` per new one), so a changed pattern is learned in a few steps. The predictor's hits and
misses are counted where a request finds its model out of the device."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from corral.core.state import ModelRecord

DECAY = 0.8  # each new transition from a model weighs its earlier ones by this
MIN_PROBABILITY = 0.25  # a prediction less likely than this is not prepared
MIN_SEEN = 1.5  # ... nor one from a model seen to go elsewhere fewer than twice

Rank = Callable[[list[ModelRecord], float], list[ModelRecord]]


@dataclass
class Prediction:
    """What the predictor said, and how it fared (hits: the model a request found out of the
    device was the one predicted; misses: it was another)."""

    hits: int = 0
    misses: int = 0
    last: str | None = None  # the model of the last arrival
    next: dict[str, float] = field(default_factory=dict)  # its successors' probabilities


class PageCache:
    """Measured fractions in, onto each model's estimates (`Estimates.cached`); transitions
    learned from arrivals; the files to prepare out (`wanted`)."""

    def __init__(self, models: Mapping[str, ModelRecord], rank: Rank) -> None:
        self._models = models
        self._rank = rank
        self._after: dict[str, dict[str, float]] = {}  # model -> next model -> decayed count
        self.prediction = Prediction()

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

    def arrived(self, m: ModelRecord) -> None:
        """A request for `m` arrived (before it is queued): the predictor is scored if `m` is
        out of the device with nothing queued, and the transition learned."""
        p = self.prediction
        last = p.last
        if last == m.name:
            return
        if not m.resident and not m.asleep and m.count == 0 and p.next:
            if max(p.next, key=p.next.__getitem__) == m.name:
                p.hits += 1
            else:
                p.misses += 1
        if last is not None:
            after = self._after.setdefault(last, {})
            for k in after:
                after[k] *= DECAY
            after[m.name] = after.get(m.name, 0.0) + 1.0
        p.last = m.name
        p.next = self._successors(m.name)

    def _successors(self, model: str) -> dict[str, float]:
        after = self._after.get(model, {})
        seen = sum(after.values())
        if seen < MIN_SEEN:
            return {}
        return {k: round(v / seen, 3) for k, v in after.items() if k in self._models}

    def held(self) -> list[str]:
        """The models whose weights a server holds now (resident or asleep): their files'
        pages are never pushed out for a preparation."""
        return [m.name for m in self._models.values() if m.resident or m.asleep]

    def wanted(self, now: float) -> list[str]:
        """The models whose files should be in the page cache next, most likely first: those
        with work waiting off the device (interactive before batch, each in the policy's
        order), then the predicted successors of the last arrival (at least
        `MIN_PROBABILITY`). Resident and sleeping models are left out (their weights are held)."""
        off = [m for m in self._models.values() if not m.resident and not m.asleep]
        out = [m.name for m in self._rank([m for m in off if m.icount], now)]
        out += [m.name for m in self._rank([m for m in off if m.count and not m.icount], now)]
        free = {m.name for m in off}
        likely = sorted(self.prediction.next.items(), key=lambda kv: (-kv[1], kv[0]))
        out += [k for k, p in likely if p >= MIN_PROBABILITY and k in free and k not in out]
        return out
