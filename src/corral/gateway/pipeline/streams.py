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
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Send

log = logging.getLogger("corral.gateway")
WATCH_TICKS = 4  # looks per `send_timeout_s`: a stall is dropped within 1.25x the bound


class ClientGone(Exception):
    """The client left: raised where the stream next sends, or next resumes its body."""


@dataclass(slots=True)
class Progress:
    """What a stream has done, for its watchdog and its accounting. The body that relays it
    writes it as it goes (`pipeline/upstream.py` `relay`: no wrapper around every send);
    `ModelStream` writes it for a body that does not (`own`), and sets `gone`."""

    first_at: float | None = None  # monotonic time of the first chunk from the server
    pieces: int = 0  # pieces of text seen: tokens, for a server that sends no usage
    sent: int = 0  # chunks the client has taken
    sending: bool = False  # a chunk is handed to the client and not taken yet
    gone: bool = False  # the client left: the body stops where it next resumes


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
        progress: Progress | None = None,
        **kw: Any,
    ) -> None:
        """`closed`: run when the stream did not end (stalled, left, cancelled), after the body
        is closed: the body's own `finally` never runs if it never started (a client that left
        before the first byte), and whatever it would free must be freed anyway. `progress`:
        the body's own record of its sends (a relay's); without it every send is wrapped to
        keep one."""
        super().__init__(content, **kw)
        self.progress = progress if progress is not None else Progress()
        self._own = progress is None
        self.send_timeout_s = send_timeout_s
        self.what = what
        self._closed = closed
        self.cut = False  # it ended early: the client left, stalled or the task was cancelled

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        # Starlette cancels the stream now, but a cancellation lands only where the stream
        # waits: uvicorn's send returns at once for a client that left, and a body with
        # buffered data to read never waits, so the stream ran on to its end (and held the
        # model's slot). The next send stops it instead.
        self.progress.gone = True
        self.cut = True  # before the cancellation reaches the body, whose `finally` reads it

    async def stream_response(self, send: Send) -> None:
        # One watchdog per stream, not a timeout per send: the watchdog looks every quarter of
        # the bound and cancels the stream once one send has been in progress, with none done,
        # for the whole bound. A relay records its sends itself (`Progress`), so its chunks go
        # to uvicorn's `send` with nothing in between.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        progress = self.progress
        stalled = False
        period_s = self.send_timeout_s / WATCH_TICKS
        # At the last look: sends done, whether one was in progress, and for how many looks in
        # a row that same send had been in progress already.
        looked = (-1, False, 0)
        handle: asyncio.TimerHandle | None = None

        def watch() -> None:
            nonlocal looked, stalled, handle
            sending, sent = progress.sending, progress.sent
            same = sending and looked[1] and looked[0] == sent
            looked = (sent, sending, looked[2] + 1 if same else 0)
            if looked[2] >= WATCH_TICKS:  # in progress at WATCH_TICKS + 1 looks: a whole bound
                stalled = True
                task.cancel()
                return
            handle = loop.call_later(period_s, watch)

        async def timed(message: Message) -> None:
            if progress.gone:
                raise ClientGone
            progress.sending = True
            await send(message)
            progress.sending = False
            progress.sent += 1

        handle = loop.call_later(period_s, watch)
        ended = False
        try:
            if self._own:
                await super().stream_response(timed)
            else:
                await self._relayed(send)
            ended = True
        except ClientGone:
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

    async def _relayed(self, send: Send) -> None:
        """Starlette's stream loop for a body that records its own chunks' sends (a relay's):
        each chunk goes to `send` as it is; the start and the end, which the body never sees,
        are recorded here, so the watchdog covers them too."""
        progress = self.progress
        progress.sending = True
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        progress.sending = False
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        progress.sending = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        progress.sending = False
