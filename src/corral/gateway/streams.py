"""Streamed answers that cannot be held hostage (issue 25): a client that stops reading is
dropped after `server.stream_send_timeout_s`, and its model's slot freed.

uvicorn's `send` waits while the connection's write buffer is full, that is while the client
reads nothing; without a bound, one such client held its model's slot until
`request_timeout_s` and every other request for that model waited behind it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger("corral.gateway")


class _Stalled(Exception):
    pass


class ModelStream(StreamingResponse):
    """A `StreamingResponse` whose every send must complete within `send_timeout_s`. A client
    that stops reading gets its connection closed (by the server, since the response stays
    unfinished), and the body iterator is closed at once, so its `finally` frees the slot."""

    def __init__(self, content: Any, send_timeout_s: float, what: str, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.send_timeout_s = send_timeout_s
        self.what = what

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(timed)
        except _Stalled:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            log.warning(
                "%s: the client read nothing for %g s (server.stream_send_timeout_s); "
                "dropped it and freed its slot",
                self.what,
                self.send_timeout_s,
            )
