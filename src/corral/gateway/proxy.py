"""The model routes' pipeline: read the call once (calls.py), forward it when another cluster
node holds the model (cluster.py), wait for the model's turn (admission.py), send it to the
model's server through the one upstream client and relay the answer (upstream.py). Request
coalescing and the loading stream are steps that use the same parts (coalesce.py, loading.py).
Refusals are raised as `GatewayError` and answered once, by the app (or the Ollama door, in its
shape). A client that leaves while waiting leaves the queue without triggering a load; one that
leaves mid-stream closes the upstream request and frees the slot."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.formparsers import MultiPartParser

from corral.config import Config
from corral.gateway.activity import TAIL_BYTES, completion_tokens, pieces
from corral.gateway.admission import Slot, Turns, disconnected
from corral.gateway.calls import json_object, model_of, priority_of, read_body, rewrite
from corral.gateway.cluster import Cluster
from corral.gateway.coalesce import Coalescer
from corral.gateway.errors import InvalidRequest, UpstreamFailed, upstream_body
from corral.gateway.loading import LoadingStream
from corral.gateway.runtime import Gateway
from corral.gateway.streams import ModelStream
from corral.gateway.upstream import DROP_BACK, DROP_RAW, Upstream, relay


class Dialect(Protocol):
    """A front door that speaks another API than the model servers' (OpenAI's): it turns
    their answers into its own (`ollama_answers.OllamaAnswer`). Its errors come to it as
    `GatewayError`s, or answers in OpenAI's shape, to map once at its door."""

    media_type: str

    def whole(self, content: bytes, wait_s: float) -> bytes:
        """A complete answer; raises ValueError if it cannot be read."""
        ...

    def stream(self, events: AsyncIterator[bytes], wait_s: float) -> AsyncIterator[bytes]:
        """Server-sent events, cut at line ends, as the dialect's stream."""
        ...


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
        self._coalescers: dict[str, Coalescer] = {}
        self._loading = LoadingStream(config, self.turns, self.answer)

    # --- entries ------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        """A JSON model route (`/v1/chat/completions` and the rest of `calls.JSON_ROUTES`)."""
        body = await read_body(request, self.max_body)
        data = json_object(body)
        name = data.get("model")
        model = model_of(name, self.config, self.gateway.backends)
        priority = priority_of(request, data)
        if (sent := await self.elsewhere(request, model, body)) is not None:
            return sent  # the body as it came: that node resolves the model itself
        served = self.gateway.backends[model].served_name
        m = self.config.models[model]
        if name != served or "priority" in data or m.filters is not None:
            data.pop("priority", None)  # the backend sees its own name, no extension
            if m.filters is not None:
                rewrite(data, m.filters, str(name))
            data["model"] = served
            body = json.dumps(data).encode()
        if m.coalesce is not None and path in ("/v1/embeddings", "/embeddings"):
            coalescer = self.coalescer(model)
            if coalescer.takes(data):
                return await coalescer.submit(request, data, priority, path)
        stream = bool(data.get("stream"))
        if stream and path == "/v1/chat/completions" and m.send_loading_state:
            return await self._loading.serve(request, model, path, body, priority)
        return await self.serve(request, model, path, body, priority, stream=stream, openai=True)

    async def handle_form(self, request: Request, path: str) -> Response:
        """A multipart endpoint (audio transcription, image edits): the model is the form's
        `model` field; the body goes on to the server as it came."""
        body = await read_body(request, self.max_body)

        async def chunks() -> AsyncGenerator[bytes, None]:
            yield body

        try:
            form = await MultiPartParser(request.headers, chunks()).parse()
        except Exception as exc:  # the parser's errors have no common base to catch
            raise InvalidRequest(f"bad multipart body: {exc}") from None
        try:
            model = model_of(form.get("model"), self.config, self.gateway.backends)
        finally:
            await form.close()
        priority = priority_of(request, {})
        if (sent := await self.elsewhere(request, model, body)) is not None:
            return sent
        return await self.serve(request, model, path, body, priority, stream=True, openai=True)

    async def handle_query(self, request: Request, path: str) -> Response:
        """A GET endpoint that names its model in the query (`/props?model=...`)."""
        model = model_of(request.query_params.get("model"), self.config, self.gateway.backends)
        priority = priority_of(request, {})
        if (sent := await self.elsewhere(request, model, b"")) is not None:
            return sent
        return await self.serve(request, model, path, b"", priority, stream=False, openai=True)

    # --- the steps ----------------------------------------------------------------------------
    async def elsewhere(self, request: Request, model: str, body: bytes) -> Response | None:
        """The answer of the cluster node that holds `model`, or None to serve it here."""
        return None if self.cluster is None else await self.cluster.forward(request, model, body)

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

    async def serve(
        self,
        request: Request,
        model: str,
        path: str,
        body: bytes,
        priority: int,
        stream: bool = True,
        openai: bool = False,
        dialect: Dialect | None = None,
    ) -> Response:
        """Wait for the model's turn, then `answer`."""
        async with self.turns.admit(
            model, priority, functools.partial(disconnected, request)
        ) as slot:
            return await self.answer(request, slot, path, body, stream, openai, dialect)

    async def answer(
        self,
        request: Request,
        slot: Slot,
        path: str,
        body: bytes,
        stream: bool,
        openai: bool = False,
        dialect: Dialect | None = None,
    ) -> Response:
        """In the slot's turn: send `body` to the model's server and relay its answer. `openai`:
        an OpenAI route, whose error answers reach the client in OpenAI's shape whatever the
        server sent; `dialect`: another API's route (the same, and the answer turned into its
        shape). A streamed answer keeps the slot until it ends."""
        model, arrived, wait_s = slot.model, slot.arrived, slot.wait_s
        openai = openai or dialect is not None
        backend = self.gateway.servers.backend_on(model, slot.device)
        # From the raw ASGI headers (names arrive lower-case): Starlette's views cost a few
        # percent of the gateway's CPU per request.
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in request.scope["headers"]
            if k not in DROP_RAW
        }
        route = request.scope["path"]
        if dialect is not None:
            headers["Content-Type"] = "application/json"  # the body was rewritten as OpenAI's
        headers.update(backend.headers)
        url = f"{backend.proxy_url}{path}"
        query = request.scope["query_string"]
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        try:
            resp = await self.upstream.send(backend, model, request.method, url, headers, body)
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            if not stream or resp.status >= 400 or (dialect is not None and not sse):
                stream = False  # error answers are small: read them whole
                content = await self.upstream.read(resp, backend, model)
        except UpstreamFailed:
            self.metrics.requests.labels(model, "502").inc()
            raise

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_BACK}
        # How long the request waited for its model (queue and swap): clients, benchmarks and
        # `corral replay` read it to tell waiting from serving.
        out_headers["x-corral-wait-ms"] = f"{wait_s * 1000:.1f}"
        # The swaps it waited for (loads begun while it waited): what tests assert on a busy
        # machine, where wall-clock waits stretch.
        out_headers["x-corral-swaps-waited"] = str(slot.swaps_waited)
        out_headers["x-corral-node"] = self.gateway.node_id  # who served it, in a cluster
        if slot.device is not None:  # which device's copy served it (`corral replay` reads it)
            out_headers["x-corral-device"] = slot.device
        activity = self.gateway.activity
        if not stream:  # read whole: one response message instead of a chunk loop
            resp.release()
            slot.release()
            self.metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
            self.metrics.requests.labels(model, str(resp.status)).inc()
            activity.record(
                model, route, resp.status, slot.device, wait_s, slot.swaps_waited,
                arrived, None, completion_tokens(content[-TAIL_BYTES:]),
            )  # fmt: skip
            wrapped = (
                upstream_body(resp.status, content, resp.headers.get("content-type", ""), path)
                if openai
                else None
            )
            if dialect is not None and resp.status < 400:
                try:
                    content = dialect.whole(content, wait_s)
                except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                    raise UpstreamFailed(
                        f"model {model}: its server's answer is not the JSON it should be",
                        code="bad_upstream_answer",
                    ) from None
                wrapped = content
            if wrapped is not None:
                content = wrapped
                out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
                out_headers["content-type"] = "application/json"
            return Response(content, status_code=resp.status, headers=out_headers)

        # Server-sent events on an OpenAI route: a server that dies mid-answer is reported with
        # an error event, as OpenAI does, since the 200 is already on its way.
        events = openai and sse
        first_byte: float | None = None
        texts = 0  # pieces of text: tokens, for a server that sends no usage
        tail = b""  # the stream's last bytes, where its usage is

        def seen(chunk: bytes) -> None:
            nonlocal first_byte, texts, tail
            if first_byte is None:
                first_byte = time.monotonic()
            texts += pieces(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]

        async def cut_short(exc: BaseException) -> str:
            died = await backend.exited(timeout_s=1.0)
            if events:
                self.metrics.stream_errors.labels(model).inc()
            cause = "its server exited" if died else type(exc).__name__
            return f"model {model}: the answer was cut short ({cause})"

        done = False

        def ended() -> None:  # finished, failed, or the client left: free the slot either way
            nonlocal done
            if done:
                return
            done = True
            slot.release()
            self.metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
            self.metrics.requests.labels(model, str(resp.status)).inc()
            tokens = completion_tokens(tail) or (texts or None)
            activity.record(
                model, route, resp.status, slot.device, wait_s, slot.swaps_waited,
                arrived, first_byte, tokens,
            )  # fmt: skip

        slot.keep()
        body_iterator = relay(resp, events, cut_short, seen, ended)
        if dialect is not None:
            body_iterator = dialect.stream(body_iterator, wait_s)
            out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
            out_headers["content-type"] = dialect.media_type

        def closed() -> None:  # the relay may never have started: its `finally` never ran
            resp.close()
            ended()

        return ModelStream(
            body_iterator,
            self.config.server.stream_send_timeout_s,
            f"model {model}",
            closed,
            status_code=resp.status,
            headers=out_headers,
        )
