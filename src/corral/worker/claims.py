"""Claiming for the worker (its `Claims` part): taking a slot's tasks (from the claim buffer,
worker/buffer.py, else from the store), filling a batch, the run length of a model run in
groups, how much to claim ahead, and giving a model's buffered tasks back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from corral.core import Scheduler
from corral.store import Lease, Task, TaskQueue
from corral.worker.buffer import ClaimBuffer, Mark, counted, give_back
from corral.worker.execute import TRANSIENT
from corral.worker.heartbeats import beat_every_s
from corral.worker.settings import WorkerSettings

log = logging.getLogger("corral.worker")


@dataclasses.dataclass(frozen=True)
class ClaimHooks:
    """What the claims ask of their worker."""

    sched: Callable[[], Scheduler]
    move: Callable[[str], AbstractAsyncContextManager[None]]  # tasks of a model in motion


class Claims:
    """Taking a slot's tasks for a worker, and how many: the claim buffer's tasks first, then
    the store's. It shares the worker's buffer, events and per-model settings; it owns the
    measured task times that set a run's length."""

    def __init__(
        self,
        store: TaskQueue,
        settings: WorkerSettings,
        worker_id: str,
        buffer: ClaimBuffer,
        stop: asyncio.Event,
        arrived: asyncio.Event,
        slot: dict[str, tuple[int, float]],
        groupable: dict[str, bool],
        waiting: dict[str, int],
        hooks: ClaimHooks,
    ) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self._buffer = buffer
        self._stop = stop
        self._arrived = arrived  # the store says tasks may have arrived
        self._slot = slot  # per model: (batch size, fill seconds) of its batched kinds
        self._groupable = groupable  # per model: its tasks run in groups
        self._waiting = waiting  # tasks waiting per model, at the worker's last reconcile
        self._sched = hooks.sched
        self._move = hooks.move
        self._task_s: dict[str, float] = {}  # a task's measured seconds in a run, per model
        self._runs_measured: dict[str, int] = {}  # runs measured per model (slow start)

    async def fill(self, model: str, held: list[Task], n: int, fill_s: float) -> list[Task]:
        """A batch waits up to `fill_s` after its first task for `n` more: claimed as the store
        announces arrivals (and every 5 ms, for arrivals it does not announce). Returns the
        batch, `held` first. Its tasks are started, so their leases are renewed meanwhile as a
        running task's are: a window longer than the lease let them lapse, be claimed again and
        sit twice in one batch, and their results be dropped as "lease lost". A task whose
        lease was lost all the same (the store was out that long) leaves the batch."""
        tasks, wanted = list(held), n
        deadline = time.monotonic() + fill_s
        every_s = beat_every_s(self.settings.lease_s)
        renew_at = time.monotonic() + every_s
        while wanted > 0 and not self._stop.is_set():
            now = time.monotonic()
            left_s = deadline - now
            if left_s <= 0:
                break
            if now >= renew_at:
                tasks = await asyncio.to_thread(self._renew, tasks)
                renew_at = time.monotonic() + every_s
                continue
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(left_s, 0.005))
            try:
                got = await self.take(model, wanted, joins=True)
            except TRANSIENT:  # run those it has: they are started, and would expire unrun
                break
            tasks += got
            wanted -= len(got)
        return tasks

    def _renew(self, tasks: list[Task]) -> list[Task]:
        """Extend the leases of a filling batch's tasks (blocking: run it in a thread); the
        ones still this worker's. A store that cannot answer now keeps them all: the next
        round tries again, as `Heartbeats` does."""
        kept: list[Task] = []
        for i, t in enumerate(tasks):
            try:
                state = self.store.heartbeat(t.id, t.lease_token or "", self.settings.lease_s)
            except Exception as exc:  # an outage or a blip: the next round tries again
                log.warning("task %s: lease renewal failed while its batch filled: %s", t.id, exc)
                return kept + tasks[i:]
            if state is Lease.LOST:
                log.warning("task %s: lease lost while its batch filled", t.id)
                continue
            kept.append(t)  # a cancel is seen by the run's own heartbeats, within a second
        return kept

    async def take(self, model: str, n: int, claim: bool = True, joins: bool = False) -> list[Task]:
        """Up to `n` started tasks of `model`: claimed ahead first, then (if `claim`) claimed
        now, with the next few reserved. `joins`: they join tasks the slot already has.

        Tasks that will run behind others start as a group, even one alone: a run puts tasks
        started alone first (`Executor.run_slot`), so one started alone after others jumped the
        queue (FIFO within a model broken whenever the buffer was short of a run)."""
        if self._stop.is_set():
            return []  # shutting down: start nothing new
        # Run a task claimed ahead only while its lease has plenty left (see `ClaimBuffer.take`).
        taken, stale = self._buffer.take(model, n, time.monotonic() - self.settings.lease_s / 4)
        if stale:  # before the claim below, which takes them again in order
            await asyncio.to_thread(give_back, self.store, [a.task for a in stale])
        tasks = [a.task for a in taken if a.mark is Mark.STARTED]
        # Reserved ones start here, together; one that must run alone is started by itself
        # when its turn comes (`Executor.run_slot`), so it stays reserved.
        alone = [a.task for a in taken if a.mark is Mark.RESERVED and a.task.run_alone]
        reserved = [
            (a.task.id, a.task.lease_token or "")
            for a in taken
            if a.mark is Mark.RESERVED and not a.task.run_alone
        ]
        if reserved:
            group = joins or bool(tasks) or len(reserved) > 1
            started = set(await asyncio.to_thread(self.store.start, reserved, group))
            tasks += [
                counted(a.task, group)
                for a in taken
                if a.mark is Mark.RESERVED and a.task.id in started
            ]
        tasks += alone
        need = n - len(tasks)
        if need and claim:
            try:
                got = await asyncio.to_thread(
                    self.store.claim,
                    model,
                    self.worker_id,
                    need + self._ahead_wanted(model),
                    self.settings.lease_s,
                    need,
                    joins or bool(tasks),
                )
            except TRANSIENT:
                if not tasks:
                    raise
                got = []  # run those it has: they are started, and would expire unrun
            tasks += got[:need]  # a task that must run alone comes back reserved (see above)
            self._buffer.add(model, got[need:], time.monotonic())
        return tasks

    def per(self, model: str) -> int:
        """Tasks per scheduling slot: a batched kind's batch size, else the run length."""
        per = self._slot[model][0]
        if per > 1:
            return per
        if not self._groupable.get(model, False):
            return 1
        return self._run_length(model, self._waiting.get(model, 0))

    def measured(self, model: str, task_s: float) -> None:
        """A run measured its tasks (in its thread): the next runs' length follows at once
        (`_per` derives it from this and the last count of waiting tasks)."""
        prev = self._task_s.get(model)
        self._task_s[model] = task_s if prev is None else 0.7 * prev + 0.3 * task_s
        self._runs_measured[model] = self._runs_measured.get(model, 0) + 1

    def _run_length(self, model: str, waiting: int) -> int:
        """About `prefetch_s` of work at the measured task time (at most `prefetch` tasks), but
        never so long that fewer slots than the model's concurrency get the waiting tasks.
        Slow start: a worker's runs of a model grow 1, 2, 4, ... up to that, so a worker that
        dies young (a crash loop, kill -9) has committed most of what it finished; with its
        first run at full length it committed nothing, every next worker began again at the same
        tasks, and the one running at each death was blamed again and again."""
        task_s = self._task_s.get(model)
        if task_s is None:
            return 1  # not measured yet: a task at a time, as a long task would want
        by_time = int(self.settings.prefetch_s / max(task_s, 1e-6))
        concurrency = self._sched().models[model].concurrency
        spread = -(-waiting // max(1, concurrency))
        ramp = 1 << min(self._runs_measured.get(model, 0), 20)
        return max(1, min(self.settings.prefetch, by_time, spread, ramp))

    def _ahead_wanted(self, model: str) -> int:
        """How many tasks to claim ahead: about `prefetch_s` of work, at most `prefetch`."""
        record = self._sched().models[model]
        task_s = self._task_s.get(model)
        if task_s is not None:  # measured in runs (the scheduler's estimate is per run)
            per_s = record.concurrency / max(task_s, 1e-6)
        else:
            per_s = record.concurrency * self.per(model) / max(record.est.service_s, 1e-6)
        return max(0, min(self.settings.prefetch, int(self.settings.prefetch_s * per_s)))

    async def release_ahead(self, model: str) -> None:
        async with self._move(model):
            gone = self._buffer.drop(model)
            if gone:
                await asyncio.to_thread(give_back, self.store, [a.task for a in gone])
