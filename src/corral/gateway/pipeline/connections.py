"""Connection hygiene for `corral serve`: uvicorn's HTTP protocol with a deadline for
a request's headers, so neither a client that trickles its headers a byte at a time nor one
that connects and sends nothing holds a connection for ever; with `limit_concurrency`, a cap on
open connections, and uvicorn's keep-alive timeout for idle ones between requests.

uvicorn has no header timeout of its own: its keep-alive timer is armed only after a response
and is cancelled by any byte received, and nothing is armed when a connection opens. Here a
deadline is armed when a connection opens and when a request begins, and cancelled when that
request's headers are complete; at the deadline the client gets 408 and the connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("corral.gateway")

HEADER_TIMEOUT_S = 10.0
_BODY = (
    b'{"error": {"message": "the request headers did not arrive in time", '
    b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}'
)
_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline (`header_timeout_s`)."""

    header_timeout_s = HEADER_TIMEOUT_S
    dropped = 0  # connections closed at the deadline, for the tests and the logs

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        GuardedHttp.dropped += 1
        if GuardedHttp.dropped == 1 or GuardedHttp.dropped % 100 == 0:
            log.warning(
                "closed %d connection(s) whose request headers took over %g s (slow or idle "
                "clients)",
                GuardedHttp.dropped,
                self.header_timeout_s,
            )
        self.transport.write(_TIMEOUT)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def with_header_timeout(seconds: float) -> type[GuardedHttp]:
    """The protocol class to give uvicorn (`http=`), with its deadline set."""
    return type("GuardedHttp", (GuardedHttp,), {"header_timeout_s": seconds})


class StoppingServer(uvicorn.Server):
    """uvicorn's server that calls `on_stop` as soon as it begins to shut down, before it waits
    for the responses still open: streams that never end by themselves (GET /api/events) end
    there, so a SIGTERM stops `corral serve` while a dashboard is open."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_stop: Callable[[], None],
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._on_stop = on_stop
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._on_started is not None and self.started:
            self._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_stop()
        await super().shutdown(sockets)


def run_server(
    app: Any,
    on_stop: Callable[[], None],
    on_started: Callable[[], None] | None = None,
    **config: Any,
) -> None:
    """`uvicorn.run(app, **config)` with `StoppingServer`; exits with uvicorn's status 3 when
    the server could not start (a port in use), as uvicorn.run does. `on_started` runs on the
    loop once it listens."""
    server = StoppingServer(uvicorn.Config(app, **config), on_stop, on_started)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
