"""The gateway's interactive requests waiting for their turn (`Intake`, a part the `Gateway`
owns): the one owner of their futures, and the grant of every request a client submits."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from corral.core import Request, RequestState, Scheduler


class Rejected(Exception):
    """The scheduler rejected a request (its model failed to load); the message says why."""


class Intake:
    """Submits clients' requests to the scheduler and completes each one's future when it is
    granted (or refused). Runs on the serving loop."""

    def __init__(
        self,
        scheduler: Callable[[], Scheduler],
        loop: Callable[[], asyncio.AbstractEventLoop],
    ) -> None:
        self._sched = scheduler
        self._loop = loop
        self._waiting: dict[object, asyncio.Future[None]] = {}
        self._ids = itertools.count(1)

    def submit(
        self,
        model: str,
        priority: int,
        principal: str | None = None,
        background: bool = False,
        weight: float = 1.0,
    ) -> tuple[Request, asyncio.Future[None]]:
        """Queue a client's request for `model` by `principal` (interactive, unless the
        principal may ask for batch work only; Batch API lines come through the attached
        worker); the future completes when it may use the backend. `weight`: the principal's
        weight in fair shares, as its keys say now."""
        r = Request(next(self._ids), model, priority, background, self, principal)
        fut: asyncio.Future[None] = self._loop().create_future()
        self._waiting[r.id] = fut
        sched = self._sched()
        if principal is not None:
            sched.shares.weigh(principal, weight)
        sched.on_request(r)
        return r, fut

    def finished(self, r: Request) -> None:
        """The request is done with its backend (or gave up while waiting). Idempotent."""
        self._waiting.pop(r.id, None)
        if r.state is RequestState.RUNNING:
            self._sched().on_request_finished(r)
        else:
            self._sched().on_cancel(r)  # still queued: it leaves without triggering a load

    def pending(self, model: str) -> int:
        """Interactive requests waiting for `model` (what `max_queue` limits; batch lines are
        limited by the `batch.*` limits instead)."""
        return self._sched().models[model].asked

    def granted(self, request: Request) -> None:
        fut = self._waiting.pop(request.id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def refused(self, request: Request, reason: str) -> None:
        fut = self._waiting.pop(request.id, None)
        if fut is not None and not fut.done():
            fut.set_exception(Rejected(reason))
