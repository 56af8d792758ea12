"""`corral serve`: the OpenAI-compatible HTTP front door.

The app is wired here: the API-key guard, the model routes' fast path (pure ASGI, to the proxy in
`proxy.py`), and the routers by resource: OpenAI's `/v1/models` and `/upstream` (`proxy.py`), the
Batch API (`batches.py`) and Corral's own routes (`admin.py`). Every error uses OpenAI's error
body: `{"error": {"message", "type", "param", "code"}}` (`errors.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import tempfile
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import __version__
from corral.access.audit import AuditTrail
from corral.access.keyfile import KeyFile
from corral.access.limits import Limits
from corral.access.live import Access
from corral.access.principals import (
    ANYONE,
    NO_KEY,
    SCOPE_KEY,
    Principal,
    caller,
    configured_keys,
)
from corral.access.usage import UsageSaver
from corral.batch.attached import BatchRuntime
from corral.batch.fields import BatchError
from corral.config import Config
from corral.gateway.doors import openapi
from corral.gateway.doors.admin import admin_routes
from corral.gateway.doors.batches import refused as batch_refused
from corral.gateway.doors.batches import routes as batch_routes
from corral.gateway.doors.llamaswap_routes import llamaswap_routes
from corral.gateway.doors.ollama_routes import OllamaDoor, ollama_routes
from corral.gateway.doors.openai_routes import openai_routes
from corral.gateway.errors import (
    GatewayError,
    as_anthropic,
    error,
    gateway_error,
    http_error,
    os_error,
    store_unavailable,
    validation_error,
)
from corral.gateway.pipeline.calls import FORM_ROUTES, GET_ROUTES, JSON_ROUTES, upstream_path
from corral.gateway.pipeline.cluster import Cluster
from corral.gateway.pipeline.grants import CLIENT_HEADER, END_PATH, EXITED_PATH, Grants
from corral.gateway.pipeline.guard import Guard
from corral.gateway.pipeline.proxy import Proxy
from corral.gateway.pipeline.upstream import Upstream
from corral.gateway.servers.metrics import Metrics
from corral.gateway.servers.reload import Reloader
from corral.gateway.servers.runtime import Gateway
from corral.store import StoreBusy, StoreUnavailable


class ApiKeys:
    """Pure ASGI middleware (no per-request task, unlike `@app.middleware`): the OpenAI, upstream
    and API routes need `Authorization: Bearer KEY` once any key is configured (`Access`);
    /health, /metrics and /ui stay open. The caller's `Principal` goes in the scope
    (`SCOPE_KEY`); a user's request to an admin route (`admin_route`) gets 403.

    The dashboard cannot put a header on an `EventSource` or a download link, so the key may
    also come in the `corral_key` cookie it sets (SameSite=Strict: other sites cannot send it,
    so a page elsewhere cannot use it)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        ring = self.access.ring
        if not ring:
            scope[SCOPE_KEY] = ANYONE
        elif path.startswith(("/v1/", "/upstream/", "/api/", "/v/", "/sdapi/")) or path in _GUARDED:
            headers = dict(scope["headers"])
            who = ring.find(_token(headers))
            if who is None:
                response = error(
                    401,
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
            if not who.admin and admin_route(path):
                response = error(
                    403,
                    f"{path} needs the admin role; {who.name} is a {who.role}",
                    "permission_error",
                    code="forbidden",
                )
                await response(scope, receive, send)
                return
            if b"corral_key" in headers.get(b"cookie", b""):
                # The key's cookie is ours: it never reaches a model server or an upstream.
                scope = dict(scope)
                scope["headers"] = _without_cookie(scope["headers"], b"corral_key")
            scope[SCOPE_KEY] = who
        elif path:  # an open route (/health, /metrics, /ui): a key, if one came, says who asks
            scope[SCOPE_KEY] = ring.find(_token(dict(scope["headers"]))) or NO_KEY
        trail = self.access.trail
        if trail is None or not admin_route(path):
            await self.app(scope, receive, send)
            return
        status = 500

        async def seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, seen)
        trail.action(caller(scope).name, scope["method"], path, status)


def _token(headers: dict[bytes, bytes]) -> bytes:
    """The key a request presents: `Authorization: Bearer KEY`, else the dashboard's cookie."""
    header = headers.get(b"authorization", b"")
    token = header[7:] if header[:7].lower() == b"bearer " else b""
    return token or _cookie(headers.get(b"cookie", b""), b"corral_key")


class RelayedFront:
    """Pure ASGI, in front of everything when relay processes pass the requests on: their
    reports of granted calls (`END_PATH`), and each request's client address as the relay
    accepted it (its `CLIENT_HEADER`), where the local socket has none."""

    def __init__(self, app: ASGIApp, grants: Grants) -> None:
        self.app = app
        self.grants = grants

    @classmethod
    def over(cls, app: CorralApp, px: Proxy) -> RelayedFront:
        """In front of `app`'s front, with the grants `px` gives (kept in `app.state.grants`)."""
        relay_lost = px.metrics.relay_lost
        px.grants = app.state.grants = Grants(lambda relay: relay_lost.labels(relay).inc())
        assert app.front is not None
        return cls(app.front, px.grants)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == END_PATH:
            await self.grants.answer_report(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == EXITED_PATH:
            await self.grants.answer_exited(scope, receive, send)
            return
        if scope["type"] in ("http", "websocket"):
            for k, v in scope["headers"]:
                if k == CLIENT_HEADER:
                    host, _, port = v.decode("latin-1").rpartition(":")
                    scope = {**scope, "client": (host, int(port) if port.isdigit() else 0)}
                    break
        await self.app(scope, receive, send)


def admin_route(path: str) -> bool:
    """Whether `path` is an admin route: loading and unloading models (Corral's and
    llama-swap's routes), reading their logs, and the audit log."""
    if path in ("/unload", "/logs", "/logs/stream", "/api/models/unload", "/api/audit"):
        return True
    if path.startswith("/api/models/unload/"):
        return True
    return path.startswith("/api/models/") and path.endswith(("/load", "/unload", "/logs"))


class RequestIds:
    """Pure ASGI middleware: every answer carries an `x-request-id` (OpenAI's clients read it
    as `request_id`): the model server's when it sent one, else the client's own when
    it sent a plain one, else a new `req_<hex>`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = dict(scope["headers"]).get(b"x-request-id", b"")
        given = asked if 0 < len(asked) <= 128 and _PLAIN_ID.fullmatch(asked) else None

        # A plain function handing back `send`'s awaitable: a streamed answer's every chunk
        # passes here, and a coroutine of its own would cost a frame per chunk.
        def with_id(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    rid = given or b"req_" + uuid.uuid4().hex.encode()
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            return send(message)

        await self.app(scope, receive, with_id)


log = logging.getLogger("corral.access")
_PLAIN_ID = re.compile(rb"[A-Za-z0-9._:-]+")
_MODEL_ROUTES = frozenset(JSON_ROUTES)
# Model and management routes outside /v1/ and /api/ that need the API key too.
_GUARDED = frozenset(
    {*JSON_ROUTES, *FORM_ROUTES, *GET_ROUTES, "/running", "/unload", "/logs", "/logs/stream"}
)
_ALSO_GET = frozenset(GET_ROUTES)
_ANTHROPIC = frozenset(
    f"/{v}/messages{end}" for v in ("v1", "v") for end in ("", "/count_tokens")
)  # a JSON route that is also a GET route (/v1/audio/voices)


Handler = Callable[[Request, str], Awaitable[Response]]


class ModelRoutes:
    """The hot path: POST to a model-routed JSON endpoint (/v1/chat/completions and the rest of
    `JSON_ROUTES`, Ollama's /api/chat and the rest of `OllamaDoor.PATHS`) goes straight to its
    handler as pure ASGI, skipping FastAPI's routing and request machinery (a quarter of the
    gateway's CPU per request); everything else goes on to FastAPI."""

    def __init__(self, app: ASGIApp, handle: Handler, ollama: Handler, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self.handlers = dict.fromkeys(_MODEL_ROUTES, handle)
        self.handlers.update(dict.fromkeys(OllamaDoor.PATHS, ollama))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self.handlers.get(scope["path"]) if scope["type"] == "http" else None
        if handle is not None:
            if scope["method"] == "GET" and scope["path"] in _ALSO_GET:
                await self.app(scope, receive, send)
                return
            if scope["method"] != "POST":
                response: Response = error(
                    405, f"{scope['path']} takes POST", "invalid_request_error"
                )
            else:
                path = upstream_path(scope["path"])
                try:
                    response = await handle(Request(scope, receive), path)
                except GatewayError as exc:  # refused: counted and answered here, once
                    self.metrics.refused(exc)
                    response = exc.response()
                if scope["path"] in _ANTHROPIC:  # Anthropic's clients read its error shape
                    response = as_anthropic(response)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class CorralApp(FastAPI):
    """FastAPI with a front: every request enters through `front` (the guard, the API keys and
    the model routes' fast path, set by `create_app`), which hands the rest to FastAPI
    (`asgi`). A model route's request then skips FastAPI's middleware stack altogether."""

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front is None:
            await self.asgi(scope, receive, send)
        else:
            await self.front(scope, receive, send)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's own entry: its middleware stack, routers and exception handlers."""
        await super().__call__(scope, receive, send)


def _books(
    access: Access, gateway: Gateway, batches: BatchRuntime | None
) -> tuple[AuditTrail, UsageSaver]:
    """What the store keeps of access: the audit trail (`access.trail`) and usage."""
    store = batches.store if batches is not None else None
    access.trail = trail = AuditTrail(store.audit if store is not None else None)
    return trail, UsageSaver(gateway.usage, store.usage if store is not None else None)


def create_app(
    config: Config,
    log_dir: Path,
    data_dir: Path | None = None,
    watch: tuple[list[Path], Callable[[], Config]] | None = None,
    relayed: bool = False,
) -> FastAPI:
    """The app. `data_dir` holds the batch store (unless `server.store` names one) and files;
    without it (and without `server.store`), batches live in memory only. `watch`: the paths
    to watch and how to read the configuration again (`corral serve --watch`, reload.py).
    `relayed`: it is reached only through relay processes (`gateway/relays/`), on a socket of
    its own, and grants them its model calls (`pipeline/grants.py`)."""
    gateway = Gateway(config, log_dir)
    pool = Upstream(lambda model: gateway.metrics.retries.labels(model).inc())
    access = _access(config, data_dir)
    batches = _batch_runtime(config, gateway, data_dir) if gateway.backends else None
    trail, saver = _books(access, gateway, batches)
    cluster = (
        Cluster(
            batches.store.members,
            gateway,
            config.server.advertised_url(),
            pool,
            window_s=batches.worker.settings.lease_s,
        )
        if batches is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Each part is stopped (last started, first stopped) also when a later one fails to
        # start: the gateway's servers, tasks and folder lock are never left behind.
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(pool.close)  # last: the gateway's own stops use it
            gateway.start()
            stack.push_async_callback(gateway.close)
            await pool.open()
            if batches is not None:
                batches.start(pool)
                stack.push_async_callback(batches.close)
            stack.push_async_callback(trail.close)
            preload = [m for name in config.server.preload if (m := config.resolve(name))]
            tasks = [
                asyncio.ensure_future(gateway.preload(preload)) if preload else None,
                asyncio.ensure_future(cluster.run()) if cluster is not None else None,
                asyncio.ensure_future(access.run()),
            ]
            saver.start()
            stack.push_async_callback(saver.close)
            if watch is not None:
                tasks.append(asyncio.ensure_future(Reloader(gateway, *watch).run()))
            stack.callback(lambda: [t.cancel() for t in tasks if t is not None])
            yield

    app = CorralApp(title="Corral", version=__version__, lifespan=lifespan, docs_url=None)
    app.state.gateway = gateway
    app.state.access = access
    px = Proxy(config, gateway, pool, cluster)
    if batches is not None and cluster is not None:
        batches.leads = cluster.leads

    if batches is not None:
        max_upload = int(config.batch.max_file_mb * 1024 * 1024)
        app.include_router(batch_routes(batches, max_upload))
    _answer_errors(app, gateway.metrics, batches is not None)
    door = OllamaDoor(px)
    # In front of FastAPI's own middleware (its error, telemetry and body-limit layers): the
    # guard, then the API keys, then the model routes' fast path (CorralApp).
    front: ASGIApp = ModelRoutes(app.asgi, px.handle, door.handle, gateway.metrics)
    front = ApiKeys(front, access)
    app.front = RequestIds(Guard(front, allowed_hosts=config.server.allowed_hosts))
    if relayed:
        app.front = RelayedFront.over(app, px)
    app.include_router(openai_routes(px))
    app.include_router(admin_routes(config, gateway, batches, cluster))
    app.include_router(llamaswap_routes(config, gateway))
    app.include_router(ollama_routes(door))
    openapi.install(app)
    return app


def _answer_errors(app: FastAPI, metrics: Metrics, batches: bool) -> None:
    """How FastAPI's routes answer what they raise: each in OpenAI's error body."""
    if batches:
        app.add_exception_handler(BatchError, batch_refused)
    app.add_exception_handler(GatewayError, functools.partial(_refused, metrics))
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(StoreUnavailable, store_unavailable)
    app.add_exception_handler(StoreBusy, store_unavailable)
    app.add_exception_handler(OSError, os_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _access(config: Config, data_dir: Path | None) -> Access:
    """Who may call: the config's keys and those `corral keys` keeps beside the batch store,
    in the data directory; said in the log (a warning when open beyond loopback)."""
    srv = config.server
    root = Path(srv.data_dir) if srv.data_dir else data_dir
    configured = configured_keys(
        srv.api_keys,
        [
            (
                Principal(
                    n,
                    p.role,
                    tuple(p.models),
                    Limits(**p.limits.model_dump()),
                    p.weight,
                    p.highest_class,
                ),
                p.keys,
            )
            for n, p in srv.principals.items()
        ],
    )
    access = Access(configured, KeyFile(root) if root is not None else None)
    loopback = srv.listen.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1", "[::1]")
    (log.warning if access.open and not loopback else log.info)("%s", access.describe())
    return access


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
    return BatchRuntime(config, gateway, open_store(url), FileStorage(root / "files"), url)


async def _refused(metrics: Metrics, request: Request, exc: Exception) -> Response:
    """A `GatewayError` raised in a FastAPI route; counted when the route is a model's (forms,
    queries, the raw route), as the fast path counts its own."""
    assert isinstance(exc, GatewayError)
    path = request.url.path
    if exc.model is not None or path in _SLOW_MODEL_ROUTES or path.startswith("/upstream/"):
        metrics.refused(exc)
    return await gateway_error(request, exc)


_SLOW_MODEL_ROUTES = frozenset((*FORM_ROUTES, *GET_ROUTES))


def _cookie(header: bytes, name: bytes) -> bytes:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name:
            return urllib.parse.unquote_to_bytes(value)
    return b""


def _without_cookie(headers: list[tuple[bytes, bytes]], name: bytes) -> list[tuple[bytes, bytes]]:
    """`headers` with cookie `name` taken out of every Cookie header (and a Cookie header left
    empty dropped)."""
    out = []
    for k, v in headers:
        if k == b"cookie":
            kept = [p for p in v.split(b";") if p.strip().partition(b"=")[0] != name]
            if not any(p.strip() for p in kept):
                continue
            v = b";".join(kept).strip()
        out.append((k, v))
    return out
