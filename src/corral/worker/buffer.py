"""The claim buffer: the tasks a worker claimed ahead of running them, per model, in claim
order. One owner (`ClaimBuffer`) and one lock, since commits run in threads and mark the next
run's tasks started in their own transaction. A task in it is reserved (its lease held, its
attempt not counted), starting (a commit is writing its start mark) or started."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable

from corral.store import Level, Task, TaskQueue


class Mark(enum.Enum):
    RESERVED = "reserved"
    STARTING = "starting"  # a commit is writing its start mark: not to be taken meanwhile
    STARTED = "started"


class Ahead:
    """A task claimed ahead: reserved -> starting -> started; only reserved and started ones
    may be taken to run."""

    __slots__ = ("claimed_at", "drop", "mark", "task")

    def __init__(self, task: Task, claimed_at: float) -> None:
        self.task = task
        self.claimed_at = claimed_at
        self.mark = Mark.RESERVED
        self.drop = False  # evicted while starting: the commit releases it once started


class ClaimBuffer:
    """The claimed-ahead tasks of every model this worker runs."""

    def __init__(self) -> None:
        self._by_model: dict[str, deque[Ahead]] = defaultdict(deque)
        self._lock = threading.Lock()

    def add(self, model: str, tasks: Iterable[Task], claimed_at: float) -> None:
        with self._lock:
            self._by_model[model].extend(Ahead(t, claimed_at) for t in tasks)

    def take(self, model: str, n: int, fresh_after: float) -> tuple[list[Ahead], list[Ahead]]:
        """(taken, stale): up to `n` tasks to run, oldest first, never one starting. Once one is
        claimed before `fresh_after` (its lease too old to run it, since a buffered task gets
        no heartbeats), the whole buffer is stale and goes back to the store, to be claimed
        again in order: giving back only the old ones let a fresher task run before them, and
        a claim racing their release found nothing, so the model looked idle with work left."""
        taken: list[Ahead] = []
        stale: list[Ahead] = []
        with self._lock:
            ahead = self._by_model[model]
            keep: deque[Ahead] = deque()
            if any(a.mark is not Mark.STARTING and a.claimed_at < fresh_after for a in ahead):
                keep = deque(a for a in ahead if a.mark is Mark.STARTING)
                stale = [a for a in ahead if a.mark is not Mark.STARTING]
            else:
                for a in ahead:
                    if a.mark is Mark.STARTING or len(taken) >= n:
                        keep.append(a)
                    else:
                        taken.append(a)
            self._by_model[model] = keep
        return taken, stale

    def holding(self, model: str) -> bool:
        with self._lock:
            return bool(self._by_model[model])

    def empty(self) -> bool:
        with self._lock:
            return not any(self._by_model.values())

    def models(self) -> list[str]:
        with self._lock:
            return list(self._by_model)

    def levels(self, model: str) -> dict[Level, int]:
        """How many of `model`'s buffered tasks wait at each level."""
        out: dict[Level, int] = {}
        with self._lock:
            for a in self._by_model[model]:
                out[a.task.level] = out.get(a.task.level, 0) + 1
        return out

    def next_to_start(self, model: str, n: int) -> list[Ahead]:
        """Mark up to `n` reserved tasks of `model` starting, for a commit to start (called in
        its thread). Never one that must run alone: it starts just before its handler runs."""
        out: list[Ahead] = []
        with self._lock:
            for a in self._by_model[model]:
                if len(out) >= n:
                    break
                if a.mark is Mark.RESERVED and not a.task.run_alone:
                    a.mark = Mark.STARTING
                    out.append(a)
        return out

    def started(self, nxt: list[Ahead]) -> None:
        """The commit that marked `nxt` starting landed: they are started (a group if several)."""
        with self._lock:
            for a in nxt:
                a.task = counted(a.task, len(nxt) > 1)
                a.mark = Mark.STARTED

    def unstart(self, nxt: Iterable[Ahead]) -> None:
        """The commit that marked `nxt` starting failed: they are reserved again."""
        with self._lock:
            for a in nxt:
                a.mark = Mark.RESERVED

    def drop(self, model: str) -> list[Ahead]:
        """Empty `model`'s buffer (evicted, or shutting down); returns the tasks to give back.
        Those starting are left to their commit, which gives them back once their mark lands."""
        with self._lock:
            ahead = self._by_model[model]
            for a in ahead:
                a.drop = a.mark is Mark.STARTING
            self._by_model[model] = deque()
        return [a for a in ahead if not a.drop]


def counted(task: Task, group: bool) -> Task:
    """A task claimed ahead, as its start mark left it: the start counted its attempt, which the
    copy read at the claim does not show (the handler's `attempt`, backoff, `last_attempt`);
    `group`: it started with others."""
    return dataclasses.replace(
        task, attempts=task.attempts + 1, started_at=time.time(), started_in_group=group
    )


def give_back(store: TaskQueue, tasks: Iterable[Task]) -> None:
    """Release tasks this worker holds but will not run (blocking: run it in a thread)."""
    for t in tasks:
        store.release(t.id, t.lease_token or "")
