"""llama-swap's `sendLoadingState`: a streamed chat request that has to wait for its model gets
its stream at once, with the wait told as reasoning text (`delta.reasoning_content`, which chat
UIs show as the model's thinking) until the model's answer follows in the same stream.

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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from corral.gateway.errors import error, stream_error
from corral.gateway.runtime import Rejected
from corral.gateway.streams import ModelStream

if TYPE_CHECKING:
    from corral.gateway.proxy import Proxy

TICK_S = 0.75  # llama-swap's pace of loading updates


def _thinking(text: str) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"reasoning_content": text}}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def serve_loading(
    px: Proxy, request: Request, model: str, path: str, body: bytes, priority: int
) -> Response:
    """Serve a streamed chat request, telling the wait while its model loads."""
    gateway, m = px.gateway, px.config.models[model]
    full = px.queue_full(model)
    if full is not None:
        return full
    arrived = time.monotonic()
    r, turn = gateway.submit(model, priority)
    if turn.done():  # ready with a free slot: nothing to tell
        try:
            turn.result()
        except Rejected as exc:
            return error(503, str(exc), "unavailable_error", code="model_unavailable")
        return await px.proxy(request, r, model, path, body, arrived, True, 0.0, openai=True)

    async def events() -> AsyncIterator[bytes]:
        handed_over = False
        try:
            yield _thinking(f"Waiting for model {model} to load (Corral)\n")
            while not turn.done():
                waited_s = time.monotonic() - arrived
                if waited_s > m.request_timeout_s:
                    yield stream_error(
                        f"waited {m.request_timeout_s:g} s for model {model} (request_timeout_s)"
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(turn), TICK_S)
                if not turn.done():
                    yield _thinking(f"... {time.monotonic() - arrived:.0f} s\n")
            try:
                turn.result()
            except Rejected as exc:
                yield stream_error(str(exc))
                return
            wait_s = time.monotonic() - arrived
            px.metrics.wait_seconds.labels(model).observe(wait_s)
            yield _thinking(f"Model {model} is ready after {wait_s:.1f} s\n\n")
            handed_over = True
            answer = await px.proxy(request, r, model, path, body, arrived, True, wait_s, True)
            if isinstance(answer, StreamingResponse):
                inner = answer.body_iterator
                try:
                    async for chunk in inner:
                        yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
                finally:
                    await inner.aclose()  # type: ignore[attr-defined]
            elif isinstance(answer, JSONResponse | Response):
                try:
                    message = json.loads(bytes(answer.body))["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = f"the model server answered {answer.status_code}"
                yield stream_error(str(message))
        finally:
            if not handed_over:
                gateway.finished(r)  # left while waiting: it never loads the model for nobody

    return ModelStream(
        events(),
        px.config.server.stream_send_timeout_s,
        f"model {model}",
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
