"""Streamed answers that cannot be held hostage: a client that stops reading is
dropped after `server.stream_send_timeout_s`, and its model's slot freed.

uvicorn's `send` waits while the connection's write buffer is full, that is while the client
reads nothing; without a bound, one such client held its model's slot until
`request_timeout_s` and every other request for that model waited behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Send

log = logging.getLogger("corral.gateway")
WATCH_TICKS = 4  # looks per `send_timeout_s`: a stall is dropped within 1.25x the bound


class _Gone(Exception):
    pass


class ModelStream(StreamingResponse):
    """A `StreamingResponse` whose every send must complete within `send_timeout_s`. A client
    that stops reading gets its connection closed (by the server, since the response stays
    unfinished); one that stops reading or leaves gets the body iterator closed at once, so its
    `finally` frees the slot."""

    def __init__(
        self,
        content: Any,
        send_timeout_s: float,
        what: str,
        closed: Callable[[], None] | None = None,
        **kw: Any,
    ) -> None:
        """`closed`: run when the stream did not end (stalled, left, cancelled), after the body
        is closed: the body's own `finally` never runs if it never started (a client that left
        before the first byte), and whatever it would free must be freed anyway."""
        super().__init__(content, **kw)
        self.send_timeout_s = send_timeout_s
        self.what = what
        self._closed = closed
        self._gone = False
        self.cut = False  # it ended early: the client left, stalled or the task was cancelled

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        # Starlette cancels the stream now, but a cancellation lands only where the stream
        # waits: uvicorn's send returns at once for a client that left, and a body with
        # buffered data to read never waits, so the stream ran on to its end (and held the
        # model's slot). The next send stops it instead.
        self._gone = True
        self.cut = True  # before the cancellation reaches the body, whose `finally` reads it

    async def stream_response(self, send: Send) -> None:
        # One watchdog per stream, not a timeout per send: a send only marks itself in progress
        # and counts itself done; the watchdog looks every quarter of the bound and cancels the
        # stream once one send has been in progress, with none done, for the whole bound.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        sending = False
        sent = 0
        stalled = False
        period_s = self.send_timeout_s / WATCH_TICKS
        # At the last look: sends done, whether one was in progress, and for how many looks in
        # a row that same send had been in progress already.
        looked = (-1, False, 0)
        handle: asyncio.TimerHandle | None = None

        def watch() -> None:
            nonlocal looked, stalled, handle
            same = sending and looked[1] and looked[0] == sent
            looked = (sent, sending, looked[2] + 1 if same else 0)
            if looked[2] >= WATCH_TICKS:  # in progress at WATCH_TICKS + 1 looks: a whole bound
                stalled = True
                task.cancel()
                return
            handle = loop.call_later(period_s, watch)

        async def timed(message: Message) -> None:
            nonlocal sending, sent
            if self._gone:
                raise _Gone
            sending = True
            await send(message)
            sending = False
            sent += 1

        handle = loop.call_later(period_s, watch)
        ended = False
        try:
            await super().stream_response(timed)
            ended = True
        except _Gone:
            pass  # the client left; the body is closed below
        except asyncio.CancelledError:
            if not stalled:
                raise
            task.uncancel()  # the watchdog's own cancellation: a stall, not a shutdown
            log.warning(
                "%s: the client read nothing for %g s (server.stream_send_timeout_s); "
                "dropped it and freed its slot",
                self.what,
                self.send_timeout_s,
            )
        finally:
            if handle is not None:
                handle.cancel()
            if not ended:
                # Stalled, left or cancelled: close the body now, so its `finally` frees the
                # slot, rather than whenever the garbage collector finalizes it.
                self.cut = True
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
                if self._closed is not None:
                    self._closed()
