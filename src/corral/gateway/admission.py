"""Admission: a request's wait for its model's turn in the scheduler."""

from __future__ import annotations

from fastapi import Request


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
