"""Admission: a request's place in its model's queue, from its submission to the scheduler to
the end of its answer. One owner for the turn: `Turns.admit` refuses a full queue (429), waits
for the turn, answers a client that left (499), a wait past `request_timeout_s` (504) and a
model that cannot load (503) by raising, and ends the request in the scheduler exactly once,
on exit, unless a stream took the slot over (`Slot.keep`), which then ends it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request

from corral import core
from corral.access.limits import OverLimit, Quotas, Ticket
from corral.access.principals import ANYONE, Principal, owner_made
from corral.config import Config
from corral.gateway.errors import ClientLeft, ModelUnavailable, QueueFull, WaitTimeout
from corral.gateway.servers.intake import Intake, Rejected
from corral.gateway.servers.metrics import Metrics
from corral.gateway.servers.runtime import Gateway
from corral.ratelog import Throttle

log = logging.getLogger("corral.access")


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Slot:
    """One request's turn: the scheduler's request, its turn (a future), and when it came."""

    __slots__ = (
        "_intake", "_over", "arrived", "kept", "model", "queued", "ticket", "turn", "wait_s",
    )  # fmt: skip

    def __init__(
        self,
        intake: Intake,
        model: str,
        queued: core.Request,
        turn: asyncio.Future[None],
        ticket: Ticket | None = None,
    ) -> None:
        self._intake = intake
        self._over = False
        self.ticket = ticket  # its principal's hold on its limits, if it has any
        self.model = model
        self.queued = queued
        self.turn = turn
        self.arrived = time.monotonic()
        self.wait_s = 0.0
        self.kept = False

    @property
    def device(self) -> str | None:
        """The device whose copy of the model serves it (once its turn came)."""
        return self.queued.device

    @property
    def swaps_waited(self) -> int:
        return self.queued.swaps_waited

    def ready(self) -> None:
        """After the turn came: raise 503 if the model could not be loaded for it."""
        try:
            self.turn.result()
        except Rejected as exc:
            raise ModelUnavailable(str(exc), code="model_unavailable") from None

    def keep(self) -> Slot:
        """A stream takes the slot over: `admit` leaves it, the stream's end `release`s it."""
        self.kept = True
        return self

    def release(self) -> None:
        """End the request in the scheduler (its slot frees; a request that never got its turn
        leaves the queue without loading the model for nobody). Idempotent."""
        if not self._over:
            self._over = True
            self._intake.finished(self.queued)
            if self.ticket is not None:
                self.ticket.close()


class Turns:
    """The gateway's admission: every model route waits for its turn through this."""

    def __init__(self, config: Config, gateway: Gateway, metrics: Metrics) -> None:
        self.config = config
        self.gateway = gateway
        self.metrics = metrics
        self.quotas = Quotas()
        self._said = Throttle(log)

    def submit(self, model: str, priority: int, who: Principal = ANYONE) -> Slot:
        """Queue a request for `model` by `who`; 429 with Retry-After if `who` is over one of
        its limits, or if `max_queue` interactive requests already wait."""
        ticket = self.enter(who)
        try:
            return self._submit(model, priority, ticket, who)
        except BaseException:
            if ticket is not None:
                ticket.close()
            raise

    def enter(self, who: Principal) -> Ticket | None:
        """`who`'s hold on its limits for one more call (None without limits); 429 with
        Retry-After over one, said in the log once a minute per principal and limit."""
        try:
            return self.quotas.enter(who.name, who.limits)
        except OverLimit as exc:
            self._said.warning(f"{who.name} {exc.limit}", "refused with 429: %s", exc)
            raise QueueFull(
                f"{exc}; retry after {exc.retry_after_s} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None

    def _submit(self, model: str, priority: int, ticket: Ticket | None, who: Principal) -> Slot:
        m = self.config.models[model]
        if self.gateway.intake.pending(model) >= m.max_queue:
            raise QueueFull(
                f"model {model} has {m.max_queue} requests waiting (max_queue); retry later",
                code="queue_full",
                headers={"Retry-After": str(max(1, round(m.load_s)))},
            )
        queued, turn = self.gateway.intake.submit(
            model, priority, owner_made(who), who.highest_class == "batch", who.weight
        )
        return Slot(self.gateway.intake, model, queued, turn, ticket)

    async def wait(self, slot: Slot, gone: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Wait for the slot's turn. `gone` returns when nobody wants the answer any more. On
        a refusal (the client left, the wait bound, the model cannot load) the request leaves
        the queue and the refusal is raised."""
        m = self.config.models[slot.model]
        if not slot.turn.done():  # resident with a free slot: no need to watch the client
            left = asyncio.ensure_future(gone()) if gone is not None else None
            waits: set[asyncio.Future[Any]] = {slot.turn} if left is None else {slot.turn, left}
            try:
                await asyncio.wait(
                    waits, timeout=m.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if left is not None:
                    left.cancel()
            if not slot.turn.done():
                slot.release()  # left the queue: never loads the model for nobody
                if left is not None and left.done():
                    raise ClientLeft()
                raise WaitTimeout(
                    f"waited {m.request_timeout_s:g} s for model {slot.model} (request_timeout_s)",
                    code="queue_timeout",
                )
        if slot.ticket is not None:
            slot.ticket.started()
        slot.ready()
        slot.wait_s = time.monotonic() - slot.arrived
        self.metrics.wait_seconds.labels(slot.model).observe(slot.wait_s)

    @asynccontextmanager
    async def admit(
        self,
        model: str,
        priority: int,
        gone: Callable[[], Awaitable[Any]] | None = None,
        who: Principal = ANYONE,
    ) -> AsyncIterator[Slot]:
        """`async with turns.admit(model, priority, gone, who) as slot:` the body runs in the
        model's turn (`gone`: see `wait`); the request ends on exit (or when a stream that
        `keep`s it ends)."""
        async with self.turn(self.submit(model, priority, who), gone) as slot:
            yield slot

    @asynccontextmanager
    async def turn(
        self, slot: Slot, gone: Callable[[], Awaitable[Any]] | None = None
    ) -> AsyncIterator[Slot]:
        """`admit` for a slot already submitted (the loading stream looks at its turn first):
        the body runs in its turn; the request ends on exit unless a stream `keep`s it."""
        try:
            await self.wait(slot, gone)
            yield slot
        finally:
            if not slot.kept:
                slot.release()
