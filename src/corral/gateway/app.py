"""`corral serve`: the OpenAI-compatible HTTP front door.

Each request is routed by its body's `model` (aliases resolved), waits in the scheduler until its
model is loaded and has a free slot, then is proxied to the model's server with `aiohttp`; streamed
responses pass through chunk by chunk. A client that leaves while waiting is dropped from the
queue without triggering a load; one that leaves mid-stream closes the upstream request and frees
the slot. Errors use OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from corral import __version__
from corral.batch.service import BatchError
from corral.config import Config
from corral.core import Request as SchedRequest
from corral.gateway.batches import BatchRuntime
from corral.gateway.batches import refused as batch_refused
from corral.gateway.batches import routes as batch_routes
from corral.gateway.errors import (
    error,
    http_error,
    stream_error,
    upstream_body,
    validation_error,
)
from corral.gateway.runtime import Gateway, Rejected
from corral.limits import PRIORITY_MAX, PRIORITY_MIN

# Hop-by-hop headers and those the client library/uvicorn set themselves.
_DROP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "authorization",
    "x-corral-priority",
}
_DROP_BACK = {"content-length", "connection", "keep-alive", "transfer-encoding"}


class Upstream:
    """The pooled HTTP client that proxies to model servers (aiohttp: measured 0.8 ms less per
    request than httpx here, most of the gateway's added latency; docs/benchmarks.md). Bodies
    pass through as they are: no decompression, no headers of its own."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the gateway is not started"
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class ApiKeys:
    """Pure ASGI middleware (no per-request task, unlike `@app.middleware`): the OpenAI, upstream
    and API routes need `Authorization: Bearer KEY`; /health, /metrics and /ui stay open.

    The dashboard cannot put a header on an `EventSource` or a download link, so the key may
    also come in the `corral_key` cookie it sets (SameSite=Strict: other sites cannot send it,
    so a page elsewhere cannot use it)."""

    def __init__(self, app: ASGIApp, keys: list[bytes]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/upstream/", "/api/")):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not token:
                token = _cookie(headers.get(b"cookie", b""), b"corral_key")
            if not any(hmac.compare_digest(token, k) for k in self.keys):
                response = error(
                    401,
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


_MODEL_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class ModelRoutes:
    """The hot path: POST /v1/chat/completions, /v1/completions and /v1/embeddings go straight
    to `handle(request, path)` as pure ASGI, skipping FastAPI's routing and request machinery
    (a quarter of the gateway's CPU per request); everything else goes on to FastAPI."""

    def __init__(self, app: ASGIApp, handle: Callable[[Request, str], Awaitable[Response]]) -> None:
        self.app = app
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _MODEL_ROUTES:
            if scope["method"] != "POST":
                response: Response = error(
                    405, f"{scope['path']} takes POST", "invalid_request_error"
                )
            else:
                response = await self.handle(Request(scope, receive), scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(config: Config, log_dir: Path, data_dir: Path | None = None) -> FastAPI:
    """The app. `data_dir` holds the batch store (unless `server.store` names one) and files;
    without it (and without `server.store`), batches live in memory only."""
    gateway = Gateway(config, log_dir)
    pool = Upstream()
    max_body = int(config.server.max_body_mb * 1024 * 1024)
    keys = [k.encode() for k in config.server.api_keys]
    batches = _batch_runtime(config, gateway, data_dir) if gateway.backends else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gateway.start()
        await pool.open()
        if batches is not None:
            batches.start(pool.session)
        preload = [m for name in config.server.preload if (m := config.resolve(name))]
        warm = asyncio.ensure_future(gateway.preload(preload)) if preload else None
        try:
            yield
        finally:
            if warm is not None:
                warm.cancel()
            if batches is not None:
                await batches.close()
            await gateway.close()
            await pool.close()

    app = FastAPI(title="Corral", version=__version__, lifespan=lifespan, docs_url=None)
    app.state.gateway = gateway

    async def read_body(request: Request) -> bytes | Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            return _too_large(max_body)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                return _too_large(max_body)
            chunks.append(chunk)
        return b"".join(chunks)

    def priority_of(request: Request, body: dict[str, Any]) -> int | Response:
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

    async def wait_turn(request: Request, model: str, priority: int) -> SchedRequest | Response:
        m = config.models[model]
        if gateway.pending(model) >= m.max_queue:
            return error(
                429,
                f"model {model} has {m.max_queue} requests waiting (max_queue); retry later",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(max(1, round(m.load_s)))},
            )
        r, turn = gateway.submit(model, priority)
        if turn.done():  # the model is resident with a free slot: no need to watch the client
            done: set[asyncio.Future[Any]] = {turn}
            gone: asyncio.Future[None] | None = None
        else:
            gone = asyncio.ensure_future(_disconnected(request))
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
        gateway.finished(r)  # left the queue: never loads the model for nobody
        if gone is not None and gone in done:
            return Response(status_code=499)
        return error(
            504,
            f"waited {m.request_timeout_s:g} s for model {model} (request_timeout_s)",
            "timeout_error",
            code="queue_timeout",
        )

    metrics = gateway.metrics

    async def serve(
        request: Request,
        model: str,
        path: str,
        body: bytes,
        priority: int,
        stream: bool = True,
        openai: bool = False,
    ) -> Response:
        arrived = time.monotonic()
        r = await wait_turn(request, model, priority)
        if isinstance(r, Response):
            metrics.requests.labels(model, str(r.status_code)).inc()
            return r
        wait_s = time.monotonic() - arrived
        metrics.wait_seconds.labels(model).observe(wait_s)
        return await proxy(request, r, model, path, body, arrived, stream, wait_s, openai)

    async def proxy(
        request: Request,
        r: SchedRequest,
        model: str,
        path: str,
        body: bytes,
        arrived: float,
        stream: bool,
        wait_s: float = 0.0,
        openai: bool = False,
    ) -> Response:
        """Send `body` to the model's server and relay its answer; `openai`: an OpenAI route,
        whose error answers reach the client in OpenAI's shape whatever the server sent."""
        backend = gateway.backends[model]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        url = f"{backend.proxy_url}{path}"
        query = request.scope["query_string"]
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        try:
            try:
                resp = await pool.session.request(request.method, url, headers=headers, data=body)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise  # nothing listens: the server is down, not the connection stale
                # Closed before any byte of an answer: most likely a pooled keep-alive connection
                # the server had closed (some close after an error without saying so). One retry
                # on a fresh connection; a dead server fails it at once (connection refused).
                metrics.retries.labels(model).inc()
                resp = await pool.session.request(request.method, url, headers=headers, data=body)
            if not stream or resp.status >= 400:  # error answers are small: read them whole
                stream = False
                content = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            await backend.exited(timeout_s=1.0)
            gateway.finished(r)
            metrics.requests.labels(model, "502").inc()
            return error(
                502,
                f"model {model}: its server did not answer ({type(exc).__name__})",
                "upstream_error",
                code="backend_unreachable",
            )

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_BACK}
        # How long the request waited for its model (queue and swap): clients, benchmarks and
        # `corral replay` read it to tell waiting from serving.
        out_headers["x-corral-wait-ms"] = f"{wait_s * 1000:.1f}"
        if not stream:  # read whole: one response message instead of a chunk loop
            resp.release()
            gateway.finished(r)
            metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
            metrics.requests.labels(model, str(resp.status)).inc()
            wrapped = (
                upstream_body(resp.status, content, resp.headers.get("content-type", ""))
                if openai
                else None
            )
            if wrapped is not None:
                content = wrapped
                out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-type"}
                out_headers["content-type"] = "application/json"
            return Response(content, status_code=resp.status, headers=out_headers)

        # Server-sent events on an OpenAI route: a server that dies mid-answer is reported with
        # an error event, as OpenAI does, since the 200 is already on its way.
        events = openai and resp.headers.get("content-type", "").startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            ended = False
            partial = b""  # events: a line not yet ended, held so an error event stays parsable
            try:
                async for chunk in resp.content.iter_any():
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
                metrics.stream_errors.labels(model).inc()
                cause = "its server exited" if died else type(exc).__name__
                # The blank line ends an event cut between its lines; the torn line is dropped.
                yield b"\n" + stream_error(f"model {model}: the answer was cut short ({cause})")
            finally:  # finished, failed, or the client left: free the slot either way
                if ended:
                    resp.release()
                else:
                    resp.close()  # drop the connection: the server stops generating
                gateway.finished(r)
                metrics.latency_seconds.labels(model).observe(time.monotonic() - arrived)
                metrics.requests.labels(model, str(resp.status)).inc()

        return StreamingResponse(relay(), status_code=resp.status, headers=out_headers)

    async def routed(request: Request, path: str) -> Response:
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        try:
            data = json.loads(body, parse_constant=_no_constant)
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
        model = config.resolve(name)
        if model is None or model not in gateway.backends:
            return _unknown_model(name, config)
        priority = priority_of(request, data)
        if isinstance(priority, Response):
            return priority
        served = gateway.backends[model].served_name
        if name != served or "priority" in data:  # the backend sees its own name, no extension
            data.pop("priority", None)
            data["model"] = served
            body = json.dumps(data).encode()
        stream = bool(data.get("stream"))
        return await serve(request, model, path, body, priority, stream=stream, openai=True)

    if batches is not None:
        max_upload = int(config.batch.max_file_mb * 1024 * 1024)
        app.include_router(batch_routes(batches, max_upload))
        app.add_exception_handler(BatchError, batch_refused)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(ModelRoutes, handle=routed)
    if keys:  # added last: outermost, so it guards the model routes too
        app.add_middleware(ApiKeys, keys=keys)

    @app.api_route("/upstream/{model}/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def upstream(request: Request, model: str, path: str) -> Response:
        resolved = config.resolve(model)
        if resolved is None or resolved not in gateway.backends:
            return _unknown_model(model, config)
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        priority = priority_of(request, {})
        if isinstance(priority, Response):
            return priority
        return await serve(request, resolved, f"/{path}", body, priority)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(gateway.started_at)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "corral"}
                for name in gateway.backends
                if not config.models[name].unlisted
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/models/{model}/logs")
    async def logs(model: str, lines: int = 200) -> Response:
        resolved = config.resolve(model)
        if resolved is None or resolved not in gateway.backends:
            return _unknown_model(model, config)
        tail = gateway.backends[resolved].log_tail(max(1, min(lines, 10_000)))
        return Response(tail + "\n" if tail else "", media_type="text/plain; charset=utf-8")

    @app.post("/api/models/{model}/load")
    async def load(model: str, wait: bool = False) -> Response:
        """Load `model` now (evicting only models without work); with `wait`, answer once it is
        ready: 200, or 503 if it failed. Without: 202 while it loads, 200 if already loaded."""
        return await operate(model, wait, load=True)

    @app.post("/api/models/{model}/unload")
    async def unload(model: str, wait: bool = False) -> Response:
        """Unload idle `model` now; 409 if it has queued or running requests."""
        return await operate(model, wait, load=False)

    async def operate(name: str, wait: bool, load: bool) -> Response:
        model = config.resolve(name)
        if model is None or model not in gateway.backends:
            return _unknown_model(name, config)
        sched = gateway.scheduler
        assert sched is not None
        m = sched.models[model]
        before = m.state.value
        act = sched.on_load_requested if load else sched.on_unload_requested
        reason = act(model)
        if reason is not None:
            verb = "load" if load else "unload"
            return error(409, f"cannot {verb} {model} now: {reason}", "conflict", code="busy")
        if wait:
            await gateway.settled(model)
        state = m.state.value
        if load and wait and state != "ready":
            failed = next((s.error for s in reversed(gateway.swaps) if s.model == model), None)
            return error(503, failed or f"{model} did not load", "unavailable_error")
        changed = state != before
        return JSONResponse(
            {"model": model, "state": state}, status_code=202 if changed and not wait else 200
        )

    @app.get("/api/events")
    async def events(request: Request) -> Response:
        """Server-sent events: the current status first, then every state change."""
        q = gateway.listen()

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield _sse("status", gateway.status())
                while True:
                    try:
                        event = await asyncio.wait_for(q.get(), 15)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    yield _sse(event["event"], event)
            finally:
                gateway.unlisten(q)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/ui")
    async def ui() -> Response:
        return HTMLResponse(_UI)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/status")
    async def status() -> dict[str, Any]:
        """The gateway's state: devices, models and their queues (per class), recent swaps and
        decisions, and the batches not yet ended with their progress and ETA."""
        out = gateway.status()
        out["batches"] = await asyncio.to_thread(batches.status) if batches is not None else []
        return out

    return app


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (use a number or null)")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _batch_runtime(config: Config, gateway: Gateway, data_dir: Path | None) -> BatchRuntime:
    from corral.batch.files import FileStorage
    from corral.store import open_store

    root = Path(config.server.data_dir) if config.server.data_dir else data_dir
    if root is None:  # nowhere to keep them: batches live as long as the app
        url = config.server.store or "memory://"
        root = Path(tempfile.mkdtemp(prefix="corral-"))
    else:
        url = config.server.store or f"sqlite:///{root / 'corral.db'}"
    root.mkdir(parents=True, exist_ok=True)
    return BatchRuntime(config, gateway, open_store(url), FileStorage(root / "files"))


def _cookie(header: bytes, name: bytes) -> bytes:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name:
            return urllib.parse.unquote_to_bytes(value)
    return b""


def _unknown_model(name: str, config: Config) -> JSONResponse:
    valid = sorted(n for n, m in config.models.items() if (m.cmd or m.upstream) and not m.unlisted)
    return error(
        404,
        f"model {name!r} not found; valid ids: {', '.join(valid)}",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def _too_large(limit: int) -> JSONResponse:
    return error(
        413,
        f"request body over {limit // (1024 * 1024)} MB (server.max_body_mb)",
        "invalid_request_error",
        code="body_too_large",
    )


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


_UI = (Path(__file__).parent / "status.html").read_text(encoding="utf-8")
