"""llama-swap's `sendLoadingState`: a streamed chat request that has to wait for its model gets
its stream at once, with the wait told as reasoning text (`delta.reasoning_content`, which chat
UIs show as the model's thinking), a line per whole second, until the model's answer follows in
the same stream. Each line is marked (`progress.MARK`): clients send an answer's reasoning back
with their next request, and the gateway takes Corral's lines out before a model sees them.

Only for streamed `/v1/chat/completions`, as llama-swap does it. The 200 is sent before the
model is ready, so anything that goes wrong afterwards (a failed load, the wait bound, a server
error) arrives as an OpenAI error event. A client that leaves while waiting leaves the queue,
as any other waiting request does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

from fastapi.responses import Response, StreamingResponse

from corral.access.principals import caller
from corral.config import Config
from corral.gateway.errors import GatewayError, stream_error
from corral.gateway.pipeline.admission import Slot, Turns
from corral.gateway.pipeline.calls import Call
from corral.gateway.pipeline.streams import ModelStream
from corral.gateway.servers import progress

TICK_S = 0.25  # how often the wait is looked at; a line is told per whole second


class Answer(Protocol):
    """In a slot's turn, the model server's answer (`Proxy.answer`)."""

    def __call__(self, call: Call, slot: Slot) -> Awaitable[Response]: ...


def _thinking(rid: str, model: str, text: str, first: bool = False) -> bytes:
    """One chunk of progress, whole as OpenAI's (id, created, model), its text marked
    (`progress.line`) so that it is taken out of the conversation when a client sends it back."""
    delta: dict[str, str] = {"reasoning_content": progress.line(text)}
    if first:
        delta = {"role": "assistant", **delta}
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class LoadingStream:
    """The step that serves a streamed chat request, telling the wait while its model loads."""

    def __init__(self, config: Config, turns: Turns, answer: Answer) -> None:
        self.config = config
        self.turns = turns
        self.answer = answer

    async def serve(self, call: Call) -> Response:
        slot = self.turns.submit(call.model, call.priority, caller(call.request.scope))
        if slot.turn.done():  # ready with a free slot: nothing to tell
            async with self.turns.turn(slot) as held:
                return await self.answer(call, held)
        return ModelStream(
            self._events(call, slot),
            self.config.server.stream_send_timeout_s,
            f"model {call.model}",
            slot.release,  # it never started: nobody waits for the turn
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    def _refused(self, call: Call, exc: GatewayError) -> bytes:
        """A refusal after the 200 went out: counted, and told as an error event."""
        exc.model = exc.model or call.model
        self.turns.metrics.refused(exc)
        return stream_error(exc.message)

    async def _events(self, call: Call, slot: Slot) -> AsyncIterator[bytes]:
        model, timeout_s = slot.model, self.config.models[slot.model].request_timeout_s
        rid, told_s = f"chatcmpl-corral-{uuid.uuid4().hex[:20]}", 0
        name = str((call.data or {}).get("model") or model)  # as the client named it
        try:
            yield _thinking(rid, name, f"waiting for model {model} to load", first=True)
            while not slot.turn.done():
                if time.monotonic() - slot.arrived > timeout_s:
                    yield stream_error(
                        f"waited {timeout_s:g} s for model {model} (request_timeout_s)"
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(slot.turn), TICK_S)
                waited_s = int(time.monotonic() - slot.arrived)
                if not slot.turn.done() and waited_s > told_s:  # a line per whole second
                    told_s = waited_s
                    yield _thinking(rid, name, f"{waited_s} s")
            try:
                async with self.turns.turn(slot) as held:
                    yield _thinking(rid, name, f"model {model} is ready after {held.wait_s:.1f} s")
                    answer = await self.answer(call, held)
            except GatewayError as exc:
                yield self._refused(call, exc)
                return
            if isinstance(answer, StreamingResponse):
                inner = answer.body_iterator
                try:
                    async for chunk in inner:
                        yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
                finally:
                    await inner.aclose()  # type: ignore[attr-defined]
            else:  # the server's error, read whole, in OpenAI's shape
                try:
                    message = json.loads(bytes(answer.body))["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = f"the model server answered {answer.status_code}"
                yield stream_error(str(message))
        finally:
            if not slot.kept:
                slot.release()  # left while waiting: it never loads the model for nobody
