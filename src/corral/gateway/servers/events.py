"""The gateway's state changes as a stream (`Events`, a part the `Gateway` owns): loads, wakes,
aborts, unloads, crashes and batch progress, for GET /api/events, the dashboard and `corral
replay`."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class Events:
    """Listeners' queues. Every method runs on the gateway's loop."""

    def __init__(self) -> None:
        self._listeners: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.closed = False

    def listen(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue of state changes from now on; `unlisten` it when done. None in it means the
        server is stopping: end the stream. A listener that falls 1,000 events behind loses the
        oldest rather than slowing the gateway."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=1000)
        if self.closed:
            q.put_nowait(None)
        self._listeners.add(q)
        return q

    def close(self) -> None:
        """End every stream, now and from now on: an open dashboard must not hold a server
        that is shutting down (uvicorn waits for every response to finish, and these never
        do)."""
        self.closed = True
        self._put(None)

    def unlisten(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._listeners.discard(q)

    def publish(self, kind: str, **fields: Any) -> None:
        if self.closed:
            return
        self._put({"event": kind, "at": time.time(), **fields})

    def _put(self, item: dict[str, Any] | None) -> None:
        """To every listener, the oldest dropped from a full queue."""
        for q in self._listeners:
            if q.full():
                q.get_nowait()
            q.put_nowait(item)
