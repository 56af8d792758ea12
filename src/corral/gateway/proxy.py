"""The proxy behind the OpenAI routes: read and check a request's body, wait for its model's
turn in the scheduler, send it to the model's server and relay the answer (streamed chunk by
chunk). A client that leaves while waiting is dropped from the queue without triggering a load;
one that leaves mid-stream closes the upstream request and frees the slot."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.formparsers import MultiPartParser

from corral.config import Config
from corral.core import Request as SchedRequest
from corral.gateway.activity import TAIL_BYTES, completion_tokens, pieces
from corral.gateway.admission import disconnected
from corral.gateway.calls import no_constant, rewrite, unknown_model
from corral.gateway.errors import error, stream_error, upstream_body
from corral.gateway.loading import serve_loading
from corral.gateway.runtime import Gateway, Rejected
from corral.gateway.streams import ModelStream
from corral.gateway.upstream import DROP, DROP_BACK, Upstream
from corral.limits import PRIORITY_MAX, PRIORITY_MIN

if TYPE_CHECKING:
    from corral.gateway.cluster import Cluster
    from corral.gateway.coalesce import Coalescer


class Dialect(Protocol):
    """A front door that speaks another API than the model servers' (OpenAI's): it turns
    their answers into its own (`ollama_answers.OllamaAnswer`). Its errors come to it in
    OpenAI's shape, to map once at its door."""

    media_type: str

    def whole(self, content: bytes, wait_s: float) -> bytes:
        """A complete answer; raises ValueError if it cannot be read."""
        ...

    def stream(self, events: AsyncIterator[bytes], wait_s: float) -> AsyncIterator[bytes]:
        """Server-sent events, cut at line ends, as the dialect's stream."""
        ...


class Proxy:
    """Requests in, answers out, for one gateway; `handle` is the model routes' entry."""

    def __init__(self, config: Config, gateway: Gateway, pool: Upstream) -> None:
        self.config = config
        self.gateway = gateway
        self.pool = pool
        self.metrics = gateway.metrics
        self.max_body = int(config.server.max_body_mb * 1024 * 1024)
        self._coalescers: dict[str, Coalescer] = {}
        self.cluster: Cluster | None = None  # several nodes on one store: requests move

    async def elsewhere(self, request: Request, model: str, body: bytes) -> Response | None:
        """The answer of the cluster node that holds `model`, or None to serve it here."""
        return None if self.cluster is None else await self.cluster.forward(request, model, body)

    async def read_body(self, request: Request) -> bytes | Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return _too_large(self.max_body)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                return _too_large(self.max_body)
            chunks.append(chunk)
        return b"".join(chunks)

    def priority_of(self, request: Request, body: dict[str, Any]) -> int | Response:
        raw = request.headers.get("x-corral-priority", body.get("priority", 0))
        value: int | None = None
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().lstrip("+-").isdigit() and len(raw) < 20:
            value = int(raw)
        if value is None or not PRIORITY_MIN <= value <= PRIORITY_MAX:
            return error(
                400,
                f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}; "
                f"got {str(raw)[:40]!r}",
                "invalid_request_error",
                param="priority",
            )
        return value

    def queue_full(self, model: str) -> Response | None:
        """The 429 to answer if `model` already has `max_queue` interactive requests waiting."""
        m = self.config.models[model]
        if self.gateway.pending(model) < m.max_queue:
            return None
        return error(
            429,
            f"model {model} has {m.max_queue} requests waiting (max_queue); retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(max(1, round(m.load_s)))},
        )

    async def wait_turn(
        self, request: Request, model: str, priority: int
    ) -> SchedRequest | Response:
        m = self.config.models[model]
        full = self.queue_full(model)
        if full is not None:
            return full
        r, turn = self.gateway.submit(model, priority)
        if turn.done():  # the model is resident with a free slot: no need to watch the client
            done: set[asyncio.Future[Any]] = {turn}
            gone: asyncio.Future[None] | None = None
        else:
            gone = asyncio.ensure_future(disconnected(request))
            try:
                done, _ = await asyncio.wait(
                    {turn, gone}, timeout=m.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                gone.cancel()
        if turn in done:
            try:
                turn.result()
            except Rejected as exc:
                return error(503, str(exc), "unavailable_error", code="model_unavailable")
            return r
        self.gateway.finished(r)  # left the queue: never loads the model for nobody
        if gone is not None and gone in done:
            return Response(status_code=499)
        return error(
            504,
            f"waited {m.request_timeout_s:g} s for model {model} (request_timeout_s)",
            "timeout_error",
            code="queue_timeout",
        )

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
        arrived = time.monotonic()
        r = await self.wait_turn(request, model, priority)
        if isinstance(r, Response):
            self.metrics.requests.labels(model, str(r.status_code)).inc()
            return r
        wait_s = time.monotonic() - arrived
        self.metrics.wait_seconds.labels(model).observe(wait_s)
        return await self.proxy(
            request, r, model, path, body, arrived, stream, wait_s, openai, dialect
        )

    async def proxy(
        self,
        request: Request,
        r: SchedRequest,
        model: str,
        path: str,
        body: bytes,
        arrived: float,
        stream: bool,
        wait_s: float = 0.0,
        openai: bool = False,
        dialect: Dialect | None = None,
    ) -> Response:
        """Send `body` to the model's server and relay its answer; `openai`: an OpenAI route,
        whose error answers reach the client in OpenAI's shape whatever the server sent;
        `dialect`: another API's route (the same, and the answer turned into its shape)."""
        openai = openai or dialect is not None
        backend = self.gateway.backend_on(model, r.device)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP}
        if dialect is not None:
            headers["Content-Type"] = "application/json"  # the body was rewritten as OpenAI's
        headers.update(backend.headers)
        url = f"{backend.proxy_url}{path}"
        query = request.scope["query_string"]
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        try:
            try:
                resp = await self.pool.session.request(
                    request.method, url, headers=headers, data=body
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise  # nothing listens: the server is down, not the connection stale
                # Closed before any byte of an answer: most likely a pooled keep-alive connection
                # the server had closed (some close after an error without saying so). One retry
                # on a fresh connection; a dead server fails it at once (connection refused).
                self.metrics.retries.labels(model).inc()
                resp = await self.pool.session.request(
                    request.method, url, headers=headers, data=body
                )
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            if not stream or resp.status >= 400 or (dialect is not None and not sse):
                stream = False  # error answers are small: read them whole
                content = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            await backend.exited(timeout_s=1.0)
            self.gateway.finished(r)
            self.metrics.requests.labels(model, "502").inc()
            return error(
                502,
                f"model {model}: its server did not answer ({type(exc).__name__})",
                "upstream_error",
                code="backend_unreachable",
            )

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_BACK}
        # How long the request waited for its model (queue and swap): clients, benchmarks and
        # `corral replay` read it to tell waiting from serving.
        out_headers["x-corral-wait-ms"] = f"{wait_s * 1000:.1f}"
        # The swaps it waited for (loads begun while it waited): what tests assert on a busy
        # machine, where wall-clock waits stretch.
        out_headers["x-corral-swaps-waited"] = str(r.swaps_waited)
        out_headers["x-corral-node"] = self.gateway.node_id  # who served it, in a cluster
        if r.device is not None:  # which device's copy served it (`corral replay` reads it)
            out_headers["x-corral-device"] = r.device
        activity = self.gateway.activity
        if not stream:  # read whole: one response message instead of a chunk loop
            resp.release()
            self.gateway.finished(r)
            self.metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
            self.metrics.requests.labels(model, str(resp.status)).inc()
            activity.record(
                model, request.url.path, resp.status, r.device, wait_s, r.swaps_waited,
                arrived, None, completion_tokens(content[-TAIL_BYTES:]),
            )  # fmt: skip
            wrapped = (
                upstream_body(resp.status, content, resp.headers.get("content-type", ""))
                if openai
                else None
            )
            if dialect is not None and resp.status < 400:
                try:
                    content = dialect.whole(content, wait_s)
                except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                    return error(
                        502,
                        f"model {model}: its server's answer is not the JSON it should be",
                        "upstream_error",
                        code="bad_upstream_answer",
                    )
                wrapped = content
            if wrapped is not None:
                content = wrapped
                out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
                out_headers["content-type"] = "application/json"
            return Response(content, status_code=resp.status, headers=out_headers)

        # Server-sent events on an OpenAI route: a server that dies mid-answer is reported with
        # an error event, as OpenAI does, since the 200 is already on its way.
        events = openai and sse

        async def relay() -> AsyncIterator[bytes]:
            ended = False
            partial = b""  # events: a line not yet ended, held so an error event stays parsable
            first_byte: float | None = None
            texts = 0  # pieces of text: tokens, for a server that sends no usage
            tail = b""  # the stream's last bytes, where its usage is
            try:
                async for chunk in resp.content.iter_any():
                    if first_byte is None:
                        first_byte = time.monotonic()
                    texts += pieces(chunk)
                    tail = (tail + chunk)[-TAIL_BYTES:]
                    if events:
                        chunk = partial + chunk
                        cut = chunk.rfind(b"\n") + 1
                        chunk, partial = chunk[:cut], chunk[cut:]
                        if not chunk:
                            continue
                    yield chunk
                if partial:
                    yield partial
                ended = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                died = await backend.exited(timeout_s=1.0)
                if not events:
                    raise  # the client sees a cut connection, the only signal left
                self.metrics.stream_errors.labels(model).inc()
                cause = "its server exited" if died else type(exc).__name__
                # The blank line ends an event cut between its lines; the torn line is dropped.
                yield b"\n" + stream_error(f"model {model}: the answer was cut short ({cause})")
            finally:  # finished, failed, or the client left: free the slot either way
                if ended:
                    resp.release()
                else:
                    resp.close()  # drop the connection: the server stops generating
                self.gateway.finished(r)
                self.metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
                self.metrics.requests.labels(model, str(resp.status)).inc()
                tokens = completion_tokens(tail) or (texts or None)
                activity.record(
                    model, request.url.path, resp.status, r.device, wait_s, r.swaps_waited,
                    arrived, first_byte, tokens,
                )  # fmt: skip

        body_iterator = relay()
        if dialect is not None:
            body_iterator = dialect.stream(body_iterator, wait_s)
            out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
            out_headers["content-type"] = dialect.media_type
        return ModelStream(
            body_iterator,
            self.config.server.stream_send_timeout_s,
            f"model {model}",
            status_code=resp.status,
            headers=out_headers,
        )

    def coalescer(self, model: str) -> Coalescer:
        """The model's request coalescer (its `batch:` config), made on first use."""
        from corral.gateway.coalesce import Coalescer  # it needs this module's helpers

        c = self._coalescers.get(model)
        if c is None:
            batching = self.config.models[model].batch
            assert batching is not None
            c = self._coalescers[model] = Coalescer(self, model, batching)
        return c

    def _model_of(self, name: Any) -> str | Response:
        """The served model a request names, or the error to answer."""
        if name is None or name == "":
            return error(
                400,
                "missing `model`: say which model should answer",
                "invalid_request_error",
                param="model",
            )
        if not isinstance(name, str):
            return error(
                400,
                f"`model` must be a string naming a model; got {json.dumps(name)[:40]} "
                f"({type(name).__name__})",
                "invalid_request_error",
                param="model",
            )
        model = self.config.resolve(name)
        if model is None or model not in self.gateway.backends:
            return unknown_model(name, self.config)
        return model

    async def handle_form(self, request: Request, path: str) -> Response:
        """A multipart endpoint (audio transcription, image edits): the model is the form's
        `model` field; the body goes on to the server as it came."""
        body = await self.read_body(request)
        if isinstance(body, Response):
            return body

        async def chunks() -> AsyncGenerator[bytes, None]:
            yield body

        try:
            form = await MultiPartParser(request.headers, chunks()).parse()
        except Exception as exc:  # the parser's errors have no common base to catch
            return error(400, f"bad multipart body: {exc}", "invalid_request_error")
        try:
            model = self._model_of(form.get("model"))
        finally:
            await form.close()
        if isinstance(model, Response):
            return model
        priority = self.priority_of(request, {})
        if isinstance(priority, Response):
            return priority
        if (sent := await self.elsewhere(request, model, body)) is not None:
            return sent
        return await self.serve(request, model, path, body, priority, stream=True, openai=True)

    async def handle_query(self, request: Request, path: str) -> Response:
        """A GET endpoint that names its model in the query (`/props?model=...`)."""
        model = self._model_of(request.query_params.get("model"))
        if isinstance(model, Response):
            return model
        priority = self.priority_of(request, {})
        if isinstance(priority, Response):
            return priority
        if (sent := await self.elsewhere(request, model, b"")) is not None:
            return sent
        return await self.serve(request, model, path, b"", priority, stream=False, openai=True)

    async def handle(self, request: Request, path: str) -> Response:
        body = await self.read_body(request)
        if isinstance(body, Response):
            return body
        try:
            data = json.loads(body, parse_constant=no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the request body is not valid JSON: {exc}", "invalid_request_error")
        except ValueError as exc:  # NaN or Infinity: JSON has neither
            return error(400, f"the request body is not valid JSON: {exc}", "invalid_request_error")
        except RecursionError:
            return error(
                400, "the request body is nested too deeply to read", "invalid_request_error"
            )
        if not isinstance(data, dict):
            return error(400, "the request body must be a JSON object", "invalid_request_error")
        name = data.get("model")
        model = self._model_of(name)
        if isinstance(model, Response):
            return model
        priority = self.priority_of(request, data)
        if isinstance(priority, Response):
            return priority
        if (sent := await self.elsewhere(request, model, body)) is not None:
            return sent  # the body as it came: that node resolves the model itself
        served = self.gateway.backends[model].served_name
        filters = self.config.models[model].filters
        if name != served or "priority" in data or filters is not None:
            data.pop("priority", None)  # the backend sees its own name, no extension
            if filters is not None:
                rewrite(data, filters, str(name))
            data["model"] = served
            body = json.dumps(data).encode()
        batching = self.config.models[model].batch
        if batching is not None and path in ("/v1/embeddings", "/embeddings"):
            answer = await self.coalescer(model).submit(request, data, priority, path)
            if answer is not None:
                return answer
        stream = bool(data.get("stream"))
        if (
            stream
            and path == "/v1/chat/completions"
            and self.config.models[model].send_loading_state
        ):
            return await serve_loading(self, request, model, path, body, priority)
        return await self.serve(request, model, path, body, priority, stream=stream, openai=True)


def _too_large(limit: int) -> JSONResponse:
    return error(
        413,
        f"request body over {limit // (1024 * 1024)} MB (server.max_body_mb)",
        "invalid_request_error",
        code="body_too_large",
    )
