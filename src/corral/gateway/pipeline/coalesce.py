"""Request coalescing (a model's `batch:` config): concurrent `/v1/embeddings` requests go to the
model's server as one request, their inputs concatenated, and the answer is split back.

A batch opens with its first request and asks the scheduler for a turn at once; requests that
arrive while it waits join it (so under load batches fill by themselves). Once it has its turn
it waits what is left of `max_wait_ms` after its first request, unless it is full
(`max_size` inputs), and goes. Requests join only a batch with the same options (encoding,
dimensions, any other field) and the same kind of input (text or token ids). A request with
more inputs than `max_size` goes alone. Inputs waiting beyond `max_queued` get 503 with
Retry-After. If the server refuses a batch (4xx), each request is sent again alone, so one bad
input fails only its own request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from corral.backends.base import Backend
from corral.config import CoalesceConfig
from corral.gateway.errors import (
    ClientLeft,
    GatewayError,
    ModelUnavailable,
    UpstreamFailed,
    upstream_body,
)
from corral.gateway.pipeline.admission import Turns, disconnected
from corral.gateway.pipeline.upstream import Upstream
from corral.gateway.servers.runtime import Gateway

_OURS = ("input", "priority")  # fields not part of a batch's key


def inputs_of(raw: Any) -> tuple[str, list[Any]] | None:
    """(kind, items) of an embeddings `input`, or None if it cannot be coalesced (the request
    then goes alone, and the server answers whatever it makes of it)."""
    if isinstance(raw, str):
        return "text", [raw]
    if not isinstance(raw, list) or not raw:
        return None
    if all(isinstance(x, str) for x in raw):
        return "text", list(raw)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return "tokens", [raw]
    if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in raw):
        return "tokens", list(raw)
    return None


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split `total` in proportion to `weights` (largest remainder: the parts sum to it)."""
    whole = sum(weights)
    if whole <= 0:
        weights, whole = [1] * len(weights), len(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def split_answer(
    answer: dict[str, Any], counts: Sequence[int], weights: Sequence[int]
) -> list[dict[str, Any]]:
    """One answer per request from the batch's: its embeddings re-indexed from 0, the usage
    apportioned by input size. ValueError if the answer does not hold one embedding per input."""
    data = answer.get("data")
    if not isinstance(data, list) or len(data) != sum(counts):
        got = len(data) if isinstance(data, list) else type(data).__name__
        raise ValueError(f"the server answered {got} embeddings for {sum(counts)} inputs")
    data = sorted(data, key=lambda d: d.get("index", 0) if isinstance(d, dict) else 0)
    raw_usage = answer.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    shares = {
        k: apportion(v, weights)
        for k, v in usage.items()
        if isinstance(v, int) and not isinstance(v, bool)
    }
    out, start = [], 0
    for i, n in enumerate(counts):
        part = [dict(d, index=j) for j, d in enumerate(data[start : start + n])]
        start += n
        one = {k: v for k, v in answer.items() if k not in ("data", "usage")}
        one["data"] = part
        if usage:
            one["usage"] = {k: shares[k][i] for k in shares}
        out.append(one)
    return out


@dataclass(eq=False)
class _Member:
    request: Request
    inputs: list[Any]
    weight: int
    answer: asyncio.Future[Response]
    arrived: float = field(default_factory=time.monotonic)
    gone: bool = False


@dataclass(eq=False)
class _Batch:
    key: str
    template: dict[str, Any]
    priority: int
    opened_at: float
    members: list[_Member] = field(default_factory=list)
    size: int = 0
    full: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)


class Coalescer:
    """One model's batches; `submit` answers one client's request."""

    def __init__(
        self,
        gateway: Gateway,
        turns: Turns,
        upstream: Upstream,
        model: str,
        settings: CoalesceConfig,
    ) -> None:
        self.gateway = gateway
        self.metrics = gateway.metrics
        self.turns = turns
        self.upstream = upstream
        self.model = model
        self.settings = settings
        self.open: dict[str, _Batch] = {}
        self.queued = 0  # inputs of requests not answered yet
        self._tasks: set[asyncio.Task[None]] = set()

    def takes(self, data: dict[str, Any]) -> bool:
        """Whether the request can be coalesced (else it goes alone, and the server answers
        whatever it makes of it): inputs of one kind, no more than a batch holds."""
        parsed = inputs_of(data.get("input"))
        return parsed is not None and len(parsed[1]) <= self.settings.max_size

    async def submit(
        self, request: Request, data: dict[str, Any], priority: int, path: str
    ) -> Response:
        """The request's answer, from its batch's (`takes(data)` must hold)."""
        parsed = inputs_of(data.get("input"))
        assert parsed is not None
        kind, inputs = parsed
        if self.queued + len(inputs) > self.settings.max_queued:
            raise ModelUnavailable(
                f"model {self.model} has {self.queued} inputs waiting to be batched "
                f"(batch.max_queued {self.settings.max_queued}); retry shortly",
                code="batch_queue_full",
                headers={"Retry-After": "1"},
            )
        rest = {k: v for k, v in data.items() if k not in _OURS}
        key = json.dumps([kind, path, rest], sort_keys=True)
        batch = self.open.get(key)
        if batch is not None and batch.size + len(inputs) > self.settings.max_size:
            self._close(batch)
            batch = None
        if batch is None:
            batch = _Batch(key, dict(rest), priority, time.monotonic())
            self.open[key] = batch
            task = asyncio.ensure_future(self._run(batch, path))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        member = _Member(
            request,
            inputs,
            sum(len(x) for x in inputs),
            asyncio.get_running_loop().create_future(),
        )
        batch.members.append(member)
        batch.size += len(inputs)
        batch.priority = max(batch.priority, priority)
        self.queued += len(inputs)
        if batch.size >= self.settings.max_size:
            self._close(batch)
        try:
            answer = await self._answer(batch, member)
        finally:
            self.queued -= len(inputs)
        self.metrics.latency_seconds.labels(self.model).observe(time.monotonic() - member.arrived)
        return answer

    async def _answer(self, batch: _Batch, member: _Member) -> Response:
        gone: asyncio.Future[Any] = asyncio.ensure_future(disconnected(member.request))
        answer: asyncio.Future[Any] = member.answer
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if member.answer.done():
            return member.answer.result()
        member.gone = True  # its answer, if it comes, is dropped
        if all(m.gone for m in batch.members):
            self._close(batch)
            batch.abandoned.set()  # nobody waits: leave the queue without a load
        return Response(status_code=499)

    def _close(self, batch: _Batch) -> None:
        """No more requests join `batch`."""
        if self.open.get(batch.key) is batch:
            del self.open[batch.key]
        batch.full.set()

    async def _run(self, batch: _Batch, path: str) -> None:
        """The batch's turn (nobody waiting for it any more: it leaves the queue), then its
        request once full or `max_wait_ms` after it opened."""
        try:
            async with self.turns.admit(
                self.model, batch.priority, gone=batch.abandoned.wait
            ) as slot:
                left_s = batch.opened_at + self.settings.max_wait_ms / 1000 - time.monotonic()
                if left_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(batch.full.wait(), left_s)
                self._close(batch)
                await self._send(
                    batch, path, self.gateway.servers.backend_on(self.model, slot.device)
                )
        except ClientLeft:
            pass  # every member left: nobody to answer
        except GatewayError as exc:  # a full queue, the wait bound, a model that cannot load
            self._answer_all(batch, exc.response())
        except Exception as exc:  # never leave a client hanging
            self._answer_all(
                batch, GatewayError(f"coalescing failed: {type(exc).__name__}: {exc}").response()
            )

    async def _send(self, batch: _Batch, path: str, backend: Backend) -> None:
        members = [mb for mb in batch.members if not mb.gone]
        if not members:
            return
        self.metrics.batch_inputs.labels(self.model).observe(sum(len(mb.inputs) for mb in members))
        status, content, ctype, wait_ms = await self._post(batch, members, path, backend)
        if status < 400:
            try:
                answers = split_answer(
                    json.loads(content),
                    [len(mb.inputs) for mb in members],
                    [mb.weight for mb in members],
                )
            except ValueError as exc:
                self._answer_all(
                    batch,
                    UpstreamFailed(f"model {self.model}: {exc}", code="bad_answer").response(),
                )
                return
            size = str(sum(len(mb.inputs) for mb in members))
            for mb, one in zip(members, answers, strict=True):
                headers = {"x-corral-wait-ms": wait_ms, "x-corral-batch-size": size}
                self._settle(mb, JSONResponse(one, headers=headers))
            return
        if 400 <= status < 500 and len(members) > 1:
            # Refused: find the culprit by sending each request alone, in the same turn.
            for mb in members:
                alone = await self._post(batch, [mb], path, backend)
                self._settle(mb, self._response(*alone, str(len(mb.inputs))))
            return
        for mb in members:
            self._settle(mb, self._response(status, content, ctype, wait_ms, "0"))

    async def _post(
        self, batch: _Batch, members: list[_Member], path: str, backend: Backend
    ) -> tuple[int, bytes, str, str]:
        """(status, body, content type, wait ms) of one upstream request for `members`, to
        `backend` (the copy of the model the scheduler gave the batch)."""
        wait_ms = f"{(time.monotonic() - batch.opened_at) * 1000:.1f}"
        body = dict(batch.template)
        body["input"] = [x for mb in members for x in mb.inputs]
        headers = {"content-type": "application/json", **backend.headers}
        url = f"{backend.proxy_url}{path}"
        try:
            resp = await self.upstream.send(
                backend, self.model, "POST", url, headers, json.dumps(body).encode()
            )
            try:
                content = await self.upstream.read(resp, backend, self.model)
            finally:
                resp.release()
        except UpstreamFailed as exc:
            return 502, bytes(exc.response().body), "application/json", wait_ms
        return resp.status, content, resp.headers.get("content-type", ""), wait_ms

    @staticmethod
    def _response(status: int, content: bytes, ctype: str, wait_ms: str, size: str) -> Response:
        wrapped = upstream_body(status, content, ctype)
        return Response(
            content if wrapped is None else wrapped,
            status_code=status,
            media_type="application/json",
            headers={"x-corral-wait-ms": wait_ms, "x-corral-batch-size": size},
        )

    def _settle(self, member: _Member, response: Response) -> None:
        if not member.answer.done():
            member.answer.set_result(response)
        if not member.gone:
            metrics = self.metrics
            metrics.requests.labels(self.model, str(response.status_code)).inc()

    def _answer_all(self, batch: _Batch, response: Response) -> None:
        self._close(batch)
        for mb in batch.members:
            self._settle(mb, response)
