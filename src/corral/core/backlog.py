"""Work an adapter holds and hands out by count, not request by request: the worker's tasks in
its store (`Scheduler.on_backlog`). The scheduler keeps its own pending requests for it, one per
slot of work, and decides from the adapter's reports when such a model is idle.

The adapter reports, per model, either how many slots of work wait at each level (an exact
count) or, while tasks of the model are moving between the store and the adapter and a count
may be off, an upper bound. From a move's start (`on_backlog_moved`) until its next exact count
the model is *unsettled*: its last slot that ends stays taken (parked) rather than let the model
look idle with work left (it was swapped out and loaded again for that work), and ends once an
exact count has given the work its requests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Protocol

from corral.core.types import Grant, Request, RequestState

# A backlog level: (interactive, priority); higher first.
Level = tuple[bool, int]
_PENDING = RequestState.PENDING
# Requests one report adds or cancels at most: each is a scheduler event on the adapter's event
# loop (40 us or so), and a 50,000-line batch would hold that loop for seconds at once. The rest
# follows in the next reports, which the adapter sends at once (`behind`).
MAX_CHANGES = 1_000


class Events(Protocol):
    """The scheduler's events a backlog's report drives."""

    def on_request(self, r: Request) -> None: ...

    def on_cancel(self, r: Request) -> bool: ...


class Backlog:
    """The requests standing for an adapter's slots of work, per (model, level); the models
    whose count may be off; their last slots, parked until it is not."""

    def __init__(self) -> None:
        self.grant: Grant | None = None  # the adapter (one per scheduler)
        self._pending: dict[tuple[str, Level], list[Request]] = defaultdict(list)
        self.unsettled: set[str] = set()
        self._parked: dict[str, list[Request]] = defaultdict(list)
        # Whether the last report was applied in part (`MAX_CHANGES`): report again soon.
        self.behind = False

    def report(
        self, events: Events, grant: Grant, slots: Mapping[str, Mapping[Level, int] | int]
    ) -> list[Request]:
        """Apply a report (see `Scheduler.on_backlog`), at most `MAX_CHANGES` requests added or
        cancelled (`behind` says whether some were left for the next); returns the parked
        requests whose model is settled now, to end."""
        self.grant = grant
        budget = [MAX_CHANGES]
        wanted: list[tuple[Level, str, int]] = []
        for model, count in slots.items():
            if isinstance(count, int):
                self.unsettled.add(model)
                self._trim(events, model, count, budget)
                continue
            self.unsettled.discard(model)
            levels = set(count) | {lv for (m, lv) in self._pending if m == model}
            for level in sorted(levels, reverse=True):
                have = self._live(model, level)
                target = count.get(level, 0)
                while len(have) > target and budget[0] > 0:
                    events.on_cancel(have.pop())
                    budget[0] -= 1
                wanted.append((level, model, target))
        # New requests in level order across models: the scheduler sees every model's
        # interactive work before any batch work (an arrival can start a load at once).
        for level, model, target in sorted(wanted, key=lambda x: x[0], reverse=True):
            have = self._pending[(model, level)]
            pending = sum(r.state is _PENDING for r in have)
            # One dispatched at once leaves its slot's work uncounted.
            while pending < target and budget[0] > 0:
                r = Request(None, model, level[1], not level[0], grant=grant)
                have.append(r)
                events.on_request(r)
                pending += r.state is _PENDING
                budget[0] -= 1
        self.behind = budget[0] <= 0
        return [r for model in slots if model not in self.unsettled for r in self._unpark(model)]

    def moved(self, model: str) -> None:
        """Tasks of `model` move between the store and the adapter: its count may be off until
        the next exact one."""
        self.unsettled.add(model)

    def parks(self, r: Request, last: bool) -> bool:
        """Whether `r`, a request that just ended, is parked instead (`last`: its model's last
        slot in use, with nothing queued)."""
        if not last or r.grant is None or r.grant is not self.grant:
            return False
        if r.model not in self.unsettled:
            return False
        self._parked[r.model].append(r)
        return True

    def _unpark(self, model: str) -> list[Request]:
        return [r for r in self._parked.pop(model, []) if r.state is RequestState.RUNNING]

    def _live(self, model: str, level: Level) -> list[Request]:
        """`model`'s pending requests at `level` (those dispatched or rejected since leave)."""
        have = self._pending[(model, level)]
        if any(r.state is not _PENDING for r in have):
            have[:] = [r for r in have if r.state is _PENDING]
        return have

    def _trim(self, events: Events, model: str, bound: int, budget: list[int]) -> None:
        """At most `bound` pending requests of `model`, the lowest levels' cancelled first: a
        model busy moving tasks still loses requests far beyond its work (as many as `budget`
        allows, which each cancel spends)."""
        mine = sorted((lv for (m, lv) in self._pending if m == model), reverse=True)
        extra = sum(len(self._live(model, lv)) for lv in mine) - bound
        for level in reversed(mine):
            have = self._pending[(model, level)]
            while extra > 0 and have and budget[0] > 0:
                events.on_cancel(have.pop())
                extra -= 1
                budget[0] -= 1
