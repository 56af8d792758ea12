"""`ModelStream`: whatever a stream holds is freed however it ends, even when the client left
before its first byte (the body's own `finally` never runs then: it never started)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect
from starlette.types import Message

from corral.gateway.pipeline.streams import ModelStream

pytestmark = pytest.mark.unit


def test_a_client_gone_before_the_first_byte_still_frees_what_the_stream_holds() -> None:
    """Both ways a server says the client left: ASGI 2.4's failing send (uvicorn), and before
    it the disconnect message the response listens for."""
    for spec in ("2.4", "2.3"):
        assert _left_early(spec) == ([], ["closed"]), spec


def _left_early(spec: str) -> tuple[list[int], list[str]]:
    """(started, freed) of a stream whose client left before its first byte."""
    started: list[int] = []
    freed: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        started.append(1)
        try:
            yield b"data: one\n\n"
        finally:
            freed.append("body")

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if spec == "2.4":
            raise OSError("the client left")
        await asyncio.sleep(0.05)  # the disconnect is heard meanwhile

    stream = ModelStream(body(), 5.0, "model m", lambda: freed.append("closed"))
    scope = {"type": "http", "asgi": {"spec_version": spec}, "method": "POST"}
    with contextlib.suppress(ClientDisconnect):
        asyncio.run(stream(scope, receive, send))
    return started, freed  # never started: its own finally could not free anything


def test_a_stream_that_ends_does_not_call_closed() -> None:
    freed: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: one\n\n"
        finally:
            freed.append("body")

    async def never() -> Message:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    stream = ModelStream(body(), 5.0, "model m", lambda: freed.append("closed"))
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST"}
    asyncio.run(stream(scope, never, send))
    assert freed == ["body"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
