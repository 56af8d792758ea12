"""The gateway's one client to model servers and to the other nodes of a cluster: a pooled
aiohttp session, the headers that never pass through (hop by hop, and Corral's own), the one call
(`Upstream.request`, with one retry on a stale connection; `Upstream.send`, a server that does
not answer raised as `UpstreamFailed`) and the one relay of a streamed answer (`relay`). The
proxy, the coalescer, the cluster hop and the Batch API's lines all send through it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from corral.backends.base import Backend
from corral.gateway.errors import UpstreamFailed, stream_error
from corral.gateway.pipeline.streams import ClientGone, Progress
from corral.gateway.servers.activity import TAIL_BYTES, pieces

# Hop-by-hop headers and those the client library/uvicorn set themselves.
DROP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "authorization",
    "x-corral-priority",
    "x-corral-relay",  # from a relay process of this gateway (grants.py)
    "x-corral-client",
}
DROP_RAW = frozenset(h.encode() for h in DROP)  # the same, as ASGI's raw names
# Never passed back: framing, and the headers Corral's own server writes once (uvicorn's
# `date` and `server`: a model server's beside them made two of each).
DROP_BACK = {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}


class Upstream:
    """The pooled HTTP client that proxies to model servers (aiohttp: measured 0.8 ms less per
    request than httpx here, most of the gateway's added latency; docs/benchmarks.md). Bodies
    pass through as they are: no decompression, no headers of its own."""

    def __init__(self, retried: Callable[[str], None] = lambda _: None) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._retried = retried  # counts a retry on a fresh connection, per model

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the gateway is not started"
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        body: bytes,
        model: str,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request for `model` (to its server, or to the cluster node that holds it);
        the answer's headers, the body to read or relay. A pooled connection closed before any
        byte of an answer is tried once more on a fresh one; other failures are raised as
        aiohttp's (or TimeoutError)."""
        kw: dict[str, Any] = {"headers": headers, "data": body}
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            return await self.session.request(method, url, **kw)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # nothing listens: the server is down, not the connection stale
            # Closed before any byte of an answer: most likely a pooled keep-alive connection
            # the server had closed (some close after an error without saying so). One retry on
            # a fresh connection; a dead server fails it at once.
            self._retried(model)
            return await self.session.request(method, url, **kw)

    async def send(
        self,
        backend: Backend,
        model: str,
        method: str,
        url: str,
        headers: dict[str, str],
        body: bytes,
    ) -> aiohttp.ClientResponse:
        """Send a request to `model`'s server (`backend`), as `request` does. A server that
        does not answer raises `UpstreamFailed` (502) once the backend had a moment to notice
        the process exited."""
        try:
            return await self.request(method, url, headers, body, model)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise await down(backend, model, exc) from None

    @staticmethod
    async def read(resp: aiohttp.ClientResponse, backend: Backend, model: str) -> bytes:
        """The whole body of an answer; a server that dies while sending it is a 502."""
        try:
            return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise await down(backend, model, exc) from None


async def down(backend: Backend, model: str, exc: BaseException) -> UpstreamFailed:
    """The 502 for a model server that did not answer (raise it)."""
    await backend.exited(timeout_s=1.0)
    return UpstreamFailed(
        f"model {model}: its server did not answer ({type(exc).__name__})",
        code="backend_unreachable",
    )


# The last event of an answer, by API: OpenAI's chat and completions, Anthropic's Messages, the
# Responses API. A client may close as soon as it reads one, before the server's end arrives.
END_MARKS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")
_TRIM_AT = 64  # chunks kept before the list is cut back to its last TAIL_BYTES


def _keep_tail(recent: list[bytes]) -> None:
    """Drop the oldest chunks of `recent` that the last `TAIL_BYTES` do not reach."""
    size = 0
    for i in range(len(recent) - 1, -1, -1):
        size += len(recent[i])
        if size >= TAIL_BYTES:
            del recent[:i]
            return


async def relay(
    resp: aiohttp.ClientResponse,
    events: bool,
    cut_short: Callable[[BaseException], Awaitable[str]],
    progress: Progress | None = None,
    ended: Callable[[bool, bytes], None] | None = None,
) -> AsyncIterator[bytes]:
    """An answer's body, chunk by chunk as it comes. `events` (server-sent events): chunks are
    cut at line ends, so an error event added after a failure stays parsable, and a failure
    mid-answer becomes that error event (`cut_short` says why), since the 200 is already on its
    way; otherwise the failure is raised and the client sees a cut connection, the only signal
    left. `progress` is written as it goes (the first chunk's time, the pieces of text, each
    chunk handed to the client and taken: `ModelStream`'s watchdog reads it), and the relay
    stops with `ClientGone` where it resumes after the client left. `ended` runs however it
    ends (finished, failed, or the client left, which drops the connection so the server stops
    generating), told whether the server's answer was relayed whole (to its end, or to its
    last event: a client that closes once it has read `data: [DONE]` did not cut the answer
    short) and the last `TAIL_BYTES` (at least) of what was relayed of it, where its usage is.

    Per chunk it does no more than a bare proxy does, but for counting it and keeping it in a
    short list: the end marks and the usage are read once, from that tail, at the end."""
    p = progress if progress is not None else Progress()
    whole = False
    partial = b""  # events: a line not yet ended
    recent: list[bytes] = []  # the last chunks relayed, at least TAIL_BYTES of them
    try:
        async for chunk in resp.content.iter_any():
            if p.first_at is None:
                p.first_at = time.monotonic()
            p.pieces += pieces(chunk)
            if events and (partial or not chunk.endswith(b"\n")):
                chunk = partial + chunk
                cut = chunk.rfind(b"\n") + 1
                chunk, partial = chunk[:cut], chunk[cut:]
                if not chunk:
                    continue
            p.sending = True
            yield chunk
            p.sending = False
            p.sent += 1
            if p.gone:
                raise ClientGone
            recent.append(chunk)
            if len(recent) >= _TRIM_AT:
                _keep_tail(recent)
        if partial:
            yield partial
            recent.append(partial)
        whole = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        why = await cut_short(exc)
        if not events:
            raise
        # The blank line ends an event cut between its lines; the torn line is dropped.
        yield b"\n" + stream_error(why)
    finally:
        if whole:
            resp.release()
        else:
            resp.close()
        if ended is not None:
            _keep_tail(recent)
            tail = b"".join(recent)[-TAIL_BYTES:]
            answered = events and any(m in tail for m in END_MARKS)
            ended(whole or answered, tail)
