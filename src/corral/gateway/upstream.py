"""The gateway's one client to model servers: a pooled aiohttp session, the headers that never
pass through (hop by hop, and Corral's own)."""

from __future__ import annotations

import aiohttp

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
}
DROP_BACK = {"content-length", "connection", "keep-alive", "transfer-encoding"}


class Upstream:
    """The pooled HTTP client that proxies to model servers (aiohttp: measured 0.8 ms less per
    request than httpx here, most of the gateway's added latency; docs/benchmarks.md). Bodies
    pass through as they are: no decompression, no headers of its own."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

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
