"""Streamed answers that cannot be held hostage (issue 25): a client that stops reading is
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


class _Stalled(Exception):
    pass


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
        async def timed(message: Message) -> None:
            if self._gone:
                raise _Gone
            # asyncio.timeout rather than wait_for: no task made per send.
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        ended = False
        try:
            await super().stream_response(timed)
            ended = True
        except _Gone:
            pass  # the client left; the body is closed below
        except _Stalled:
            log.warning(
                "%s: the client read nothing for %g s (server.stream_send_timeout_s); "
                "dropped it and freed its slot",
                self.what,
                self.send_timeout_s,
            )
        finally:
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
