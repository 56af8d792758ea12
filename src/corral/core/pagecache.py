"""The host's page cache as the scheduler sees it, and what it prepares there (`PageCache`, a
part the scheduler owns).

Measured: per model, the fraction of its weights file the page cache holds, as the shell last
measured it (`corral serve`: `mincore` over the file, modelfiles/mincore.py; the simulator:
its model of the host's page cache, sim/pagecache.py). Each model's load is priced at that
fraction, between its warm and cold load figures (`Estimates.load_s`), and each measured load is
read at the fraction its load began with (`Estimates.load_begins`). A model never measured
counts as cached: its loads are priced by its measured loads alone.

Prepared: `wanted` says which files should be in the page cache next, most likely first: the
models whose work waits for a device, in the order the policy would bring them in, then the
models the learned transitions predict (agent loops alternate predictably: orchestrator,
explorer, coder). The shell reads them in while the disk and memory are free
(gateway/servers/file_cache.py; the simulator alike); the decision is this part's, the same in both.
A transition is one model's arrival after another's (the last arrival of a different model);
each model's transitions decay
(`DECAY` per new one), so a changed pattern is learned in a few steps. The predictor's hits and
misses are counted where a request finds its model out of the device.

Loaded ahead (`ahead`): where device memory is free, the scheduler loads the last arrival's
most likely successor before its request comes (at least `LOAD_PROBABILITY`, while no work
waits anywhere, evicting nothing; `load_ahead`, once the scheduler has settled each event)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from corral.core.placement import plan_placement
from corral.core.state import DeviceRecord, ModelRecord
from corral.core.swaps import Swaps
from corral.core.tiers import Tiers

DECAY = 0.8  # each new transition from a model weighs its earlier ones by this
MIN_PROBABILITY = 0.25  # a prediction less likely than this is not prepared
MIN_SEEN = 1.5  # ... nor one from a model seen to go elsewhere fewer than twice
LOAD_PROBABILITY = 0.5  # a successor this likely is loaded ahead into free device memory

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
        # Since the last arrival: the models held at any settle (on a device or asleep), and
        # whether a model was loaded ahead (`ahead`: once per arrival, never one that was held
        # since: it left for a reason, or it is the model just served and evicted).
        self._held_since: set[str] = set()
        self._ahead_tried = False

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
        self._held_since = set(self.held())
        self._ahead_tried = False

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

    def ahead(self) -> ModelRecord | None:
        """The model to load ahead of its request, into free device memory (the scheduler
        places it, evicting nothing): the last arrival's most likely successor, at least
        `LOAD_PROBABILITY`, off the device and not asleep, while no work waits anywhere; at
        most once per arrival, and never a model held since that arrival (it left for a
        reason: its idle timeout, an operator's unload, an eviction for other work)."""
        p = self.prediction
        if self._ahead_tried or not p.next or any(m.count for m in self._models.values()):
            return None
        name, probability = max(p.next.items(), key=lambda kv: (kv[1], kv[0]))
        m = self._models.get(name)
        if m is None or probability < LOAD_PROBABILITY or m.resident or m.asleep:
            return None
        self._ahead_tried = True
        return None if name in self._held_since else m

    def load_ahead(
        self, swaps: Swaps, devices: Sequence[DeviceRecord], tiers: Tiers, now: float
    ) -> bool:
        """Load `ahead()`'s model where placement puts it without evicting anything; whether
        a load began. Called once the scheduler has settled each event, so every model held
        since the last arrival is seen here."""
        if self._ahead_tried or not self.prediction.next:
            return False  # `ahead` is None until the next arrival, which starts the set again
        self._held_since.update(self.held())
        m = self.ahead()
        if m is None:
            return False
        plan = plan_placement(swaps.views(m, now))
        if plan is None or plan.evict:
            return False
        dev = next(d for d in devices if d.name == plan.device)
        tiers.start_load(m, dev, [], now, "predicted next")
        return True

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
