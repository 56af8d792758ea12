"""A relay process: one of `corral serve --workers N`'s front processes.

It accepts clients on the gateway's public socket (shared by every relay process; the kernel
hands each connection to one) and passes every request, as it came, to the scheduler's process
over a local socket, adding who it is (`RELAY_HEADER`) and the client's address. What comes back
is either the answer, piped to the client as it is (Corral's routes, refusals, the dashboard,
the Batch API, a dialect's answer), or a grant (`pipeline/grants.py`): then this process sends
the call to the model's server itself and streams the answer straight to its client with the
gateway's own relay (`pipeline/upstream.py` `relay`, `pipeline/streams.py` `ModelStream`),
reports how it ended, and closes the grant. The per-token work is all here, on as many cores as
there are relay processes; the scheduler's process does per-request work only.

A client that leaves while its call waits closes this process's request to the scheduler's,
which takes it out of the queue as it would its own client's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import uvicorn
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from corral.gateway.doors.app import RequestIds
from corral.gateway.doors.openai_routes import refuse_responses_socket
from corral.gateway.errors import (
    ClientLeft,
    ModelUnavailable,
    UpstreamFailed,
    error,
    upstream_body,
)
from corral.gateway.pipeline.connections import with_header_timeout
from corral.gateway.pipeline.grants import (
    CLIENT_HEADER,
    END_PATH,
    EXITED_PATH,
    GRANT_HEADER,
    RELAY_HEADER,
    Report,
    before_leaving,
)
from corral.gateway.pipeline.streams import ModelStream, Progress
from corral.gateway.pipeline.upstream import DROP_BACK, Upstream, relay
from corral.gateway.servers.activity import TAIL_BYTES

log = logging.getLogger("corral.relay")

# Hop by hop: never passed to the scheduler's process. The relay's own headers, should a
# client send them, are dropped too: only this process says who it is.
_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length",
     b"proxy-connection", b"expect", RELAY_HEADER, CLIENT_HEADER}
)  # fmt: skip
# Passed back from the scheduler's process: all but framing and what this process's own
# server writes (`date`, `server`); a known length stays.
_BACK = frozenset(h.encode() for h in DROP_BACK - {"content-length"})
_WHOLE_BODY = 1024 * 1024  # a request body up to this is read whole, larger ones streamed
_WHOLE_ANSWER = 64 * 1024  # an answer of a known length up to this is piped in one piece
# The retries of the exchange running in this task (each exchange is a task of its own).
_RETRIES: contextvars.ContextVar[list[int]] = contextvars.ContextVar("retries")


class RelayApp:
    """The relay's ASGI app (pure ASGI). `main_socket`: the scheduler's process's local
    socket; `relay_id`: this process's name there."""

    def __init__(self, relay_id: str, main_socket: str, send_timeout_s: float) -> None:
        self.relay_id = relay_id.encode()
        self.main_socket = main_socket
        self.send_timeout_s = send_timeout_s
        self.upstream = Upstream(lambda _: _RETRIES.get().append(1))
        self._main: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.pass_on(scope, receive, send)
        elif scope["type"] == "websocket":
            socket_ = WebSocket(scope, receive, send)
            if scope["path"] == "/v1/responses":
                await refuse_responses_socket(socket_)
            else:
                await socket_.close(code=1008, reason="no WebSocket is served here")
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.upstream.open()
                self._main = aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=self.main_socket, limit=0),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.upstream.close()
                if self._main is not None:
                    await self._main.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def main(self) -> aiohttp.ClientSession:
        assert self._main is not None, "the relay is not started"
        return self._main

    # --- passing a request on -----------------------------------------------------------------
    async def pass_on(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request to the scheduler's process; pipe its answer, or carry its grant."""
        if scope["path"].startswith("/internal/"):  # the relays' own routes: not for clients
            await error(404, "Not Found", "invalid_request_error")(scope, receive, send)
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _HOP
        ]
        client = scope.get("client") or ("", 0)
        headers += [
            (RELAY_HEADER.decode(), self.relay_id.decode()),
            (CLIENT_HEADER.decode(), f"{client[0]}:{client[1]}"),
        ]
        body, whole = await _body(scope, receive)
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope["query_string"]
        url = "http://corral" + path.decode("latin-1") + ("?" + query.decode() if query else "")
        asking = asyncio.ensure_future(
            self.main.request(
                scope["method"], url, headers=headers, data=body, allow_redirects=False
            )
        )
        # A body still streaming is the request's own to receive: the client is watched once
        # it is all in.
        if not whole:
            await asyncio.wait({asking})
        elif not await before_leaving(asking, receive):
            asking.cancel()  # the client left while its call waited: the queue drops it
            return
        try:
            resp = asking.result()
        except (aiohttp.ClientError, OSError):
            await ModelUnavailable(
                "Corral's scheduler process is not answering; try again in a moment",
                code="scheduler_unavailable",
            ).response()(scope, receive, send)
            return
        if resp.headers.get(GRANT_HEADER.decode()):
            await self.carry(resp, scope, receive, send)
        else:
            await self._pipe(resp, scope, receive, send)

    async def _pipe(
        self, resp: aiohttp.ClientResponse, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """The scheduler process's own answer, to the client as it comes."""
        raw = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _BACK]
        size = resp.content_length
        if size is not None and size <= _WHOLE_ANSWER:
            content = await resp.read()
            resp.release()
            await send({"type": "http.response.start", "status": resp.status, "headers": raw})
            await send({"type": "http.response.body", "body": content})
            return
        stream = ModelStream(
            resp.content.iter_any(), self.send_timeout_s, "corral", resp.close,
            status_code=resp.status,
        )  # fmt: skip
        stream.raw_headers = raw
        try:
            await stream(scope, receive, send)
        finally:
            resp.close()

    # --- carrying a grant ---------------------------------------------------------------------
    async def carry(
        self, grant_resp: aiohttp.ClientResponse, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Send the granted call to its model's server and relay the answer to the client;
        report its end to the scheduler's process, then close the grant."""
        reported: list[asyncio.Task[None]] = []

        def end(report: Report) -> None:
            if not reported:
                reported.append(asyncio.ensure_future(self._report(grant_resp, gid, report)))

        try:
            grant = json.loads(await grant_resp.content.readline())
            gid = str(grant["id"])
            body = await grant_resp.content.readexactly(int(grant["body_bytes"]))
        except (aiohttp.ClientError, ValueError, KeyError, asyncio.IncompleteReadError):
            grant_resp.close()  # the grant ends without a report: counted as lost there
            await UpstreamFailed(
                "Corral's scheduler process sent a grant this relay could not read",
                code="bad_grant",
            ).response()(scope, receive, send)
            return
        try:
            await self._answer(grant, body, end, scope, receive, send)
        finally:
            if not reported:  # never reached the server's answer
                end(Report(UpstreamFailed.status, None, 0, b"", False))
            await reported[0]

    async def _answer(
        self,
        grant: dict[str, Any],
        body: bytes,
        end: Callable[[Report], None],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        model = str(grant["model"])
        retries: list[int] = []
        exchange = asyncio.ensure_future(self._exchange(grant, body, retries))
        if not await before_leaving(exchange, receive):
            # The client left: closing the connection stops the server.
            exchange.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, TimeoutError):
                await exchange
            end(Report(ClientLeft.status, None, 0, b"", False, len(retries)))
            return
        try:
            up, content = exchange.result()
        except (aiohttp.ClientError, TimeoutError) as exc:
            await self._exited(grant)  # its crash is seen before the client hears of it
            failed = UpstreamFailed(
                f"model {model}: its server did not answer ({type(exc).__name__})",
                code="backend_unreachable",
            )
            end(Report(failed.status, None, 0, b"", False, len(retries)))
            await failed.response()(scope, receive, send)
            return
        ctype = up.headers.get("content-type", "")
        out = {k: v for k, v in up.headers.items() if k.lower() not in DROP_BACK}
        out.update(grant["own_headers"])
        if content is not None:
            up.release()
            end(Report(up.status, None, 0, content[-TAIL_BYTES:], False, len(retries)))
            wrapped = upstream_body(up.status, content, ctype, grant["path"])
            if grant["openai"] and wrapped is not None:
                content = wrapped
                out = {k: v for k, v in out.items() if k.lower() != "content-type"}
                out["content-type"] = "application/json"
            await Response(content, status_code=up.status, headers=out)(scope, receive, send)
            return
        await self._stream(grant, up, out, len(retries), end, scope, receive, send)

    async def _exited(self, grant: dict[str, Any]) -> bool:
        """Whether the grant's model server died, as the scheduler's process sees it (it waits
        up to 1 s for the exit to be reported); False if it cannot say."""
        try:
            async with self.main.get(f"http://corral{EXITED_PATH}?grant={grant['id']}") as r:
                return bool(r.status == 200 and (await r.json()).get("exited"))
        except (aiohttp.ClientError, OSError, ValueError):
            return False

    async def _exchange(
        self, grant: dict[str, Any], body: bytes, retries: list[int]
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """Send the granted call; the answer, and its whole body unless it is to be streamed
        (a streamed call's error answers are read whole too). Retries are added to `retries`."""
        _RETRIES.set(retries)
        up = await self.upstream.request(
            grant["method"], grant["url"], grant["headers"], body, str(grant["model"])
        )
        try:
            if not grant["stream"] or up.status >= 400:
                return up, await up.read()
        except BaseException:
            up.close()
            raise
        return up, None

    async def _stream(
        self,
        grant: dict[str, Any],
        up: aiohttp.ClientResponse,
        out: dict[str, str],
        retries: int,
        end: Callable[[Report], None],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        model = str(grant["model"])
        events = bool(grant["openai"]) and up.headers.get("content-type", "").startswith(
            "text/event-stream"
        )
        progress = Progress()
        cut = [False]

        async def cut_short(exc: BaseException) -> str:
            cut[0] = events
            cause = "its server exited" if await self._exited(grant) else type(exc).__name__
            return f"model {model}: the answer was cut short ({cause})"

        def ended(whole: bool, tail: bytes) -> None:
            left = stream.cut and not whole
            status = 499 if left else up.status
            end(Report(status, progress.first_at, progress.pieces, tail, cut[0], retries))

        def closed() -> None:  # the relay may never have started: its `finally` never ran
            up.close()
            ended(False, b"")

        stream = ModelStream(
            relay(up, events, cut_short, progress, ended),
            float(grant["send_timeout_s"]),
            f"model {model}",
            closed,
            progress,
            status_code=up.status,
            headers=out,
        )
        await stream(scope, receive, send)

    async def _report(self, grant_resp: aiohttp.ClientResponse, gid: str, report: Report) -> None:
        """Tell the scheduler's process how grant `gid` ended; the grant then ends."""
        try:
            async with self.main.post(
                f"http://corral{END_PATH}?grant={gid}", data=report.to_json()
            ) as r:
                await r.read()
            if r.status == 204:  # the grant ends once its report is in: its connection goes
                await grant_resp.read()  # back to the pool
                grant_resp.release()
            else:
                log.warning("relay: grant %s refused its report (%d)", gid, r.status)
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("relay: the end of grant %s was not reported (%s)", gid, exc)
        finally:
            grant_resp.close()  # where it did not end: the scheduler's process sees it closed


async def _body(scope: Scope, receive: Receive) -> tuple[bytes | AsyncIterator[bytes], bool]:
    """The request's body: whole (True) when it is small or its length unknown and it ends
    soon, else a stream of its parts as they come (False)."""
    length = None
    chunked = False
    for k, v in scope["headers"]:
        if k == b"content-length" and v.isdigit():
            length = int(v)
        elif k == b"transfer-encoding":
            chunked = True
    if (length is not None and length > _WHOLE_BODY) or chunked:

        async def parts() -> AsyncIterator[bytes]:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectionResetError("the client left while sending its body")
                yield message.get("body", b"")
                more = message.get("more_body", False)

        return parts(), False
    chunks: list[bytes] = []
    more = True
    while more:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks), True


async def _orphaned(parent: int) -> None:
    """Returns once the process that started this one is gone (killed beyond a signal)."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    """`python -m corral.gateway.relays.process`: serve the inherited listening socket."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    p.add_argument("--main", required=True, help="the scheduler process's local socket")
    p.add_argument("--id", required=True, help="this relay's name")
    p.add_argument("--send-timeout-s", type=float, default=10.0)
    p.add_argument("--header-timeout-s", type=float, default=10.0)
    p.add_argument("--keep-alive-s", type=float, default=5.0)
    p.add_argument("--max-connections", type=int, default=1000)
    p.add_argument("--shutdown-grace-s", type=int, default=30)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sock = socket.socket(fileno=args.fd)
    app = RequestIds(RelayApp(args.id, args.main, args.send_timeout_s))
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        http=with_header_timeout(args.header_timeout_s),
        timeout_keep_alive=int(max(1, round(args.keep_alive_s))),
        limit_concurrency=args.max_connections,
        timeout_graceful_shutdown=args.shutdown_grace_s,
    )
    server = uvicorn.Server(config)
    parent = os.getppid()

    async def run() -> None:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        orphan = asyncio.ensure_future(_orphaned(parent))
        await asyncio.wait({serving, orphan}, return_when="FIRST_COMPLETED")
        if orphan.done():
            server.should_exit = True
        await serving

    # uvicorn's own choice of loop (uvloop where installed), as `uvicorn.run` makes it.
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(run())


if __name__ == "__main__":
    main()
