"""The model routes' pipeline: read the request once into a `Call` (calls.py), forward it when
another cluster node holds the model (cluster.py), wait for the model's turn (admission.py), send
it to the model's server through the one upstream client and relay the answer (upstream.py). Request
coalescing and the loading stream are steps that use the same parts (coalesce.py, loading.py).
Refusals are raised as `GatewayError` and answered once, by the app (or the Ollama door, in its
shape). A client that leaves while waiting leaves the queue without triggering a load; one that
leaves mid-stream closes the upstream request and frees the slot."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import ClientResponse
from fastapi import Request
from fastapi.responses import Response

from corral.access.principals import caller
from corral.backends.base import Backend
from corral.config import Config, data_dir
from corral.gateway.errors import (
    ClientLeft,
    GatewayError,
    InvalidRequest,
    UpstreamFailed,
    upstream_body,
    upstream_message,
)
from corral.gateway.pipeline.admission import Slot, Turns, disconnected
from corral.gateway.pipeline.calls import Call, Reader, unknown_model
from corral.gateway.pipeline.cluster import Cluster, Unreachable
from corral.gateway.pipeline.coalesce import Coalescer
from corral.gateway.pipeline.grants import RELAY_HEADER, Grants, Report
from corral.gateway.pipeline.loading import LoadingStream
from corral.gateway.pipeline.props import KeptProps
from corral.gateway.pipeline.streams import ModelStream, Progress
from corral.gateway.pipeline.upstream import DROP_BACK, DROP_RAW, Upstream, relay
from corral.gateway.servers.activity import TAIL_BYTES, completion_tokens, prefill
from corral.gateway.servers.runtime import Gateway
from corral.prompt_cache.server import conversation_id

Here = Callable[[Call], Awaitable[Response]]


class Proxy:
    """Requests in, answers out, for one gateway; `handle` is the model routes' entry."""

    def __init__(
        self, config: Config, gateway: Gateway, upstream: Upstream, cluster: Cluster | None = None
    ) -> None:
        self.config = config
        self.gateway = gateway
        self.upstream = upstream
        self.metrics = gateway.metrics
        self.turns = Turns(config, gateway, gateway.metrics)
        self.cluster = cluster  # several nodes on one store: requests move
        self.max_body = int(config.server.max_body_mb * 1024 * 1024)
        self.reader = Reader(config, gateway.backends, self.max_body)
        self._coalescers: dict[str, Coalescer] = {}
        self._loading = LoadingStream(config, self.turns, self.answer)
        self.props = KeptProps(config, Path(config.server.data_dir or data_dir()) / "props.json")
        # Set when relay processes carry the answers (`corral serve --workers N`): a call they
        # pass on gets a grant instead of its answer (grants.py).
        self.grants: Grants | None = None

    # --- entries ------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        """A JSON model route (`/v1/chat/completions` and the rest of `calls.JSON_ROUTES`)."""
        return await self.route(await self.reader.json(request, path))

    async def handle_form(self, request: Request, path: str) -> Response:
        """A multipart endpoint (audio transcription, image edits)."""
        return await self.route(await self.reader.form(request, path))

    async def handle_query(self, request: Request, path: str) -> Response:
        """A GET endpoint that names its model in the query (`/props?model=...`)."""
        return await self.route(await self.reader.query(request, path))

    # --- the steps ----------------------------------------------------------------------------
    async def route(self, call: Call, here: Here | None = None) -> Response:
        """The call's answer: the cluster node's that holds its model (the body as it came:
        that node reads it itself), else this node's, from `here` (by default `serve_here`).
        A refusal raised on the way names the call's model (its door counts and answers it).
        A model the caller may not use answers 404, as one not served does."""
        try:
            who = caller(call.request.scope)
            if not who.may_use(call.model):
                raise unknown_model(call.model, self.config, who)
            if self.cluster is not None:
                node = self.cluster.destination(call)
                if node is not None:
                    try:
                        return await self.cluster.forward(call, node)
                    except Unreachable:
                        pass  # nothing reached a model: it is served here (the cluster said so)
            return await (here or self.serve_here)(call)
        except GatewayError as exc:
            exc.model = exc.model or call.model
            raise

    async def serve_here(self, call: Call) -> Response:
        """On this node: an OpenAI JSON call may be coalesced (embeddings with `batch:`) or get
        the loading stream (streamed chat with `send_loading_state`); else `serve`."""
        data = call.data
        if data is not None:
            m = self.config.models[call.model]
            if m.coalesce is not None and call.path in ("/v1/embeddings", "/embeddings"):
                coalescer = self.coalescer(call.model)
                if coalescer.takes(dict(data)):
                    # Coalesced calls share one turn; each holds its principal's limits
                    # until its own answer (whole, never streamed) is back.
                    ticket = self.turns.enter(caller(call.request.scope))
                    try:
                        return await coalescer.submit(
                            call.request, dict(data), call.priority, call.path
                        )
                    finally:
                        if ticket is not None:
                            ticket.close()
            if call.stream and call.path == "/v1/chat/completions" and m.send_loading_state:
                return await self._loading.serve(call)
        return await self.serve(call)

    def coalescer(self, model: str) -> Coalescer:
        """The model's request coalescer (its `batch:` config), made on first use."""
        c = self._coalescers.get(model)
        if c is None:
            batching = self.config.models[model].coalesce
            assert batching is not None
            c = self._coalescers[model] = Coalescer(
                self.gateway, self.turns, self.upstream, model, batching
            )
        return c

    async def serve(self, call: Call) -> Response:
        """Wait for the model's turn, then `answer`, unless the client leaves first: then the
        upstream request is closed (the server stops generating and frees its slot), the
        model's turn goes to the next request at once, and the activity log says 499."""
        if call.path == "/props" and call.request.method == "GET" and not self._ready(call):
            return self.props.answer(call.model)  # a probe never loads the model
        refused = self._takes_none(call)
        if refused is not None:
            raise InvalidRequest(refused, param="tools", code="tools_not_supported")
        gone = functools.partial(disconnected, call.request)
        who = caller(call.request.scope)
        relay = self._relay_of(call)
        async with self.turns.admit(call.model, call.priority, gone, who) as slot:
            answering = asyncio.ensure_future(self.answer(call, slot, relay))
            left = asyncio.ensure_future(gone())
            try:
                await asyncio.wait({answering, left}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                answering.cancel()
                raise
            finally:
                left.cancel()
            if answering.done():  # answered (or refused) before the client left
                return answering.result()
            answering.cancel()  # closes the upstream connection: llama-server cancels its task
            with contextlib.suppress(asyncio.CancelledError, GatewayError):
                await answering
            slot.release()  # counted where the refusal is answered (the door), logged here
            self.gateway.activity.record(
                call.model, call.request.scope["path"], ClientLeft.status, slot.device,
                slot.wait_s, slot.swaps_waited, slot.arrived, None, None, slot.queued.principal,
                slot.queued.background,
            )  # fmt: skip
            raise ClientLeft()

    def _relay_of(self, call: Call) -> str | None:
        """The relay process that passed `call` on and may carry its answer, or None: this
        process answers it (no relays; a dialect to translate; a kept `/props`)."""
        if self.grants is None or call.dialect is not None or call.path == "/props":
            return None
        for k, v in call.request.scope["headers"]:
            if k == RELAY_HEADER:
                return str(v.decode("latin-1"))
        return None

    def _ready(self, call: Call) -> bool:
        """Whether the call's model is loaded and ready now (in this node's scheduler)."""
        record = self.gateway.scheduler.models.get(call.model) if self.gateway.scheduler else None
        return record is not None and record.state.value == "ready"

    def _takes_none(self, call: Call) -> str | None:
        """Why the call's `tools` cannot be served, or None. A model whose capabilities say it
        takes no tools (a GGUF whose template renders none: llama-server answers `tools` with
        a 500, which clients retry) is refused at once, at every door alike, as Ollama refuses
        them: not retryable, nothing loaded."""
        data = call.data
        if data is None or not data.get("tools"):
            return None
        caps = self.config.models[call.model].capabilities
        if caps is None or caps.tools:
            return None
        return (
            f"model {call.model} does not support tools: its chat template renders none "
            "(capabilities.tools is false). Send the request without `tools`, or choose a model "
            "whose template takes them (/v1/models and /api/show list each model's capabilities)"
        )

    async def answer(self, call: Call, slot: Slot, relay: str | None = None) -> Response:
        """In the slot's turn: send the call to the model's server and relay its answer, whole
        or streamed (a streamed answer keeps the slot until it ends); or, for a call relay
        process `relay` passed on, grant it what to send where (the slot kept until it ends)."""
        model, request = call.model, call.request
        backend = self.gateway.servers.backend_on(model, slot.device)
        # From the raw ASGI headers (names arrive lower-case): Starlette's views cost a few
        # percent of the gateway's CPU per request.
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in request.scope["headers"]
            if k not in DROP_RAW
        }
        if call.dialect is not None:
            headers["Content-Type"] = "application/json"  # the body was rewritten as OpenAI's
        headers.update(backend.headers)
        url = f"{backend.proxy_url}{call.path}"
        query = request.scope["query_string"]
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        body, after = call.body, None
        if call.data is not None:  # the scheduler prices what a swap loses of it
            slot.queued.conversation = conversation_id(call.data)
        cache = self.gateway.servers.cache_of(backend)
        if cache is not None and call.data is not None:  # to the slot holding its conversation
            placed = await cache.place(call.data, call.path)
            if placed is not None:
                body, after = placed.body or body, functools.partial(cache.done, placed)
        if relay is not None:
            exited = functools.partial(backend.exited, timeout_s=1.0)
            return self._grant(call, slot, relay, (url, headers, body), after, exited)
        try:
            resp = await self.upstream.send(backend, model, request.method, url, headers, body)
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            content = None
            if not call.stream or resp.status >= 400 or (call.dialect is not None and not sse):
                content = await self.upstream.read(resp, backend, model)  # small: read whole
        except BaseException:
            if after is not None:
                after(b"")
            raise
        if content is not None:
            return self._whole(call, slot, resp, content, after)
        return self._stream(call, slot, resp, backend, sse, after)

    def _whole(
        self,
        call: Call,
        slot: Slot,
        resp: ClientResponse,
        content: bytes,
        after: Callable[[bytes], None] | None = None,
    ) -> Response:
        """The answer read whole: one response message instead of a chunk loop. `after` runs
        once the answer has ended, with its last bytes (its prompt cache's bookkeeping)."""
        resp.release()
        if call.path == "/props" and resp.status == 200:
            self.props.keep(call.model, content)
        tail = content[-TAIL_BYTES:]
        if after is not None:
            after(tail)
        self._observe(call, slot, resp.status, None, completion_tokens(tail), tail)
        out_headers = self._headers(call.model, resp, slot)
        dialect = call.dialect
        ctype = resp.headers.get("content-type", "")
        wrapped = None  # the body the client gets instead of the server's
        if dialect is None and call.openai:
            wrapped = upstream_body(resp.status, content, ctype, call.path)
        elif dialect is not None and resp.status >= 400:
            wrapped = dialect.error(upstream_message(resp.status, content, ctype, call.path))
        elif dialect is not None:
            try:
                content = dialect.whole(content, slot.wait_s)
            except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                raise UpstreamFailed(
                    f"model {call.model}: its server's answer is not the JSON it should be",
                    code="bad_upstream_answer",
                ) from None
            wrapped = content
        if wrapped is not None:
            content = wrapped
            out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
            out_headers["content-type"] = "application/json"
        return Response(content, status_code=resp.status, headers=out_headers)

    def _stream(
        self,
        call: Call,
        slot: Slot,
        resp: ClientResponse,
        backend: Backend,
        sse: bool,
        after: Callable[[bytes], None] | None = None,
    ) -> Response:
        """The answer relayed as it comes. Server-sent events on an OpenAI route: a server that
        dies mid-answer is reported with an error event, as OpenAI does, since the 200 is
        already on its way. `after` runs once it has ended, however."""
        model = call.model
        events = (call.openai or call.dialect is not None) and sse
        progress = Progress()  # the relay writes it; the stream's watchdog reads it

        async def cut_short(exc: BaseException) -> str:
            died = await backend.exited(timeout_s=1.0)
            if events:
                self.metrics.stream_errors.labels(model).inc()
            cause = "its server exited" if died else type(exc).__name__
            return f"model {model}: the answer was cut short ({cause})"

        done = False

        def ended(whole: bool, tail: bytes) -> None:  # finished, failed, or the client left
            nonlocal done
            if not done:
                done = True
                if after is not None:
                    after(tail)
                tokens = completion_tokens(tail) or (progress.pieces or None)
                # Left mid-answer. A client that closes as soon as it has read the last chunk
                # is seen leaving before the relay's `finally` runs: the answer was whole.
                left = stream.cut and not whole
                status = ClientLeft.status if left else resp.status
                self._observe(call, slot, status, progress.first_at, tokens, tail)

        slot.keep()
        out_headers = self._headers(call.model, resp, slot)
        body_iterator = relay(resp, events, cut_short, progress, ended)
        if call.dialect is not None:
            body_iterator = call.dialect.stream(body_iterator, slot.wait_s)
            out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
            out_headers["content-type"] = call.dialect.media_type

        def closed() -> None:  # the relay may never have started: its `finally` never ran
            resp.close()
            ended(False, b"")

        stream = ModelStream(
            body_iterator,
            self.config.server.stream_send_timeout_s,
            f"model {model}",
            closed,
            progress,
            status_code=resp.status,
            headers=out_headers,
        )
        return stream

    def _grant(
        self,
        call: Call,
        slot: Slot,
        relay: str,
        sent: tuple[str, dict[str, str], bytes],
        after: Callable[[bytes], None] | None,
        exited: Callable[[], Awaitable[bool]],
    ) -> Response:
        """The grant for relay process `relay`: what to send where (`sent`: the URL, headers
        and body), and Corral's headers for the answer; the slot is kept until the relay
        reports its end (or is lost). `exited`: whether the model's server died."""
        assert self.grants is not None
        url, headers, body = sent
        slot.keep()
        grant = {
            "method": call.request.method,
            "url": url,
            "headers": headers,
            "model": call.model,
            "stream": call.stream,
            "openai": call.openai,
            "path": call.path,
            "own_headers": self._own_headers(call.model, slot),
            "send_timeout_s": self.config.server.stream_send_timeout_s,
        }

        def ended(report: Report | None) -> None:
            if after is not None:
                after(report.tail if report is not None else b"")
            if report is None:  # its relay left: counted as the 502 it would have been
                self._observe(call, slot, UpstreamFailed.status, None, None)
                return
            if report.stream_error:
                self.metrics.stream_errors.labels(call.model).inc()
            if report.retries:
                self.metrics.retries.labels(call.model).inc(report.retries)
            tokens = completion_tokens(report.tail) or (report.pieces or None)
            self._observe(call, slot, report.status, report.first_at, tokens, report.tail)

        return self.grants.issue(relay, grant, body, ended, exited)

    def _headers(self, model: str, resp: ClientResponse, slot: Slot) -> dict[str, str]:
        """The server's answer headers, less the hop-by-hop ones, and Corral's own."""
        out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_BACK}
        out.update(self._own_headers(model, slot))
        return out

    def _own_headers(self, model: str, slot: Slot) -> dict[str, str]:
        """Corral's own headers on a model's answer."""
        out: dict[str, str] = {}
        # The window it was served in. `get`: a model removed by a reload (--watch)
        # finishes the answers it holds, and is no longer in the configuration.
        m = self.config.models.get(model)
        if m is not None and m.capabilities is not None and m.capabilities.context:
            out["x-corral-context"] = str(m.capabilities.context)
        # How long the request waited for its model (queue and swap): clients, benchmarks and
        # `corral replay` read it to tell waiting from serving.
        out["x-corral-wait-ms"] = f"{slot.wait_s * 1000:.1f}"
        # The swaps it waited for (loads begun while it waited): what tests assert on a busy
        # machine, where wall-clock waits stretch.
        out["x-corral-swaps-waited"] = str(slot.swaps_waited)
        out["x-corral-node"] = self.gateway.node_id  # who served it, in a cluster
        if slot.device is not None:  # which device's copy served it (`corral replay` reads it)
            out["x-corral-device"] = slot.device
        return out

    def _observe(
        self,
        call: Call,
        slot: Slot,
        status: int,
        first_byte: float | None,
        tokens: int | None,
        tail: bytes = b"",
    ) -> None:
        """The answer has ended (whole, or its stream): the slot frees, and its status, latency
        and activity are recorded, once. Its prompt's size and prefill (`tail`, the answer's
        last bytes) go to the scheduler with it."""
        r = slot.queued
        context = 0
        if status < 400:
            context, prefilled, prefill_s = prefill(tail)
            if r.conversation is not None:
                r.context_tokens, r.prefill_tokens, r.prefill_s = context, prefilled, prefill_s
        if slot.ticket is not None:
            slot.ticket.spent(context + (tokens or 0))
        slot.release()
        model = call.model
        who = caller(call.request.scope)
        self.gateway.usage.record(who.name, r.principal, model, context, tokens or 0, slot.wait_s)
        self.metrics.latency_seconds.labels(model).observe(time.monotonic() - slot.arrived)
        self.metrics.requests.labels(model, str(status)).inc()
        self.gateway.activity.record(
            model, call.request.scope["path"], status, slot.device, slot.wait_s,
            slot.swaps_waited, slot.arrived, first_byte, tokens, r.principal, r.background,
        )  # fmt: skip
