"""`ModelStream`: whatever a stream holds is freed however it ends, even when the client left
before its first byte (the body's own `finally` never runs then: it never started)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect
from starlette.types import Message

from corral.gateway.pipeline.streams import ModelStream, Progress

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


def test_a_send_that_never_completes_is_dropped_by_the_watchdog_and_frees_the_stream() -> None:
    """One watchdog per stream: a send stuck for the whole bound cancels the stream (logged as
    a stall, not raised), closes the body and runs `closed`; sends that do complete, however
    many, never trip it."""
    freed: list[str] = []
    sent: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for i in range(50):
                yield b"data: %d\n\n" % i
        finally:
            freed.append("body")

    async def send(message: Message) -> None:
        sent.append(message.get("body", b""))
        if len(sent) > 20:  # the client stops reading after 20 messages
            await asyncio.Event().wait()
        await asyncio.sleep(0.001)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run() -> tuple[float, ModelStream]:
        stream = ModelStream(body(), 0.2, "model m", lambda: freed.append("closed"))
        t0 = asyncio.get_running_loop().time()
        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return asyncio.get_running_loop().time() - t0, stream

    took_s, stream = asyncio.run(run())
    assert len(sent) == 21  # the start and 20 chunks went; the 21st send hung
    assert freed == ["body", "closed"]
    assert stream.cut
    assert took_s >= 0.2  # never before the whole bound


def test_a_cancellation_from_outside_still_propagates_through_the_watchdog() -> None:
    """Only the watchdog's own cancellation is a stall: a shutdown's cancels the stream."""

    async def body() -> AsyncIterator[bytes]:
        while True:
            yield b"data: x\n\n"
            await asyncio.sleep(0.01)

    async def send(message: Message) -> None:
        await asyncio.sleep(0)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run() -> None:
        stream = ModelStream(body(), 30.0, "model m")
        task = asyncio.ensure_future(
            stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        )
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_relayed_stream_whose_last_send_never_completes_is_dropped_too() -> None:
    """A body that records its own sends (a relay, `Progress`) passes its chunks straight to
    `send`; the response's end, which it never sees, is still watched."""
    freed: list[str] = []
    sent: list[Message] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"data: %d\n\n" % i

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await asyncio.Event().wait()  # the client stopped reading at the very end

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run() -> ModelStream:
        stream = ModelStream(
            body(), 0.2, "model m", lambda: freed.append("closed"), progress=Progress()
        )
        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return stream

    stream = asyncio.run(run())
    bodies = [m.get("body") for m in sent[1:]]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert freed == ["closed"]
    assert stream.cut
