"""Corral's own routes: /health, /metrics, the dashboard (/ui) and the /api/* status, events,
logs and load/unload controls."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from corral.access.principals import caller
from corral.access.usage import PERIODS
from corral.batch.attached import BatchRuntime
from corral.config import Config
from corral.gateway.errors import Conflict, InvalidRequest, ModelUnavailable
from corral.gateway.pipeline.calls import unknown_model
from corral.gateway.pipeline.cluster import Cluster
from corral.gateway.servers.metrics import usage_exposition
from corral.gateway.servers.runtime import Gateway
from corral.gateway.servers.status import own_view


class EventStream(StreamingResponse):
    media_type = "text/event-stream"


def admin_routes(
    config: Config, gateway: Gateway, batches: BatchRuntime | None, cluster: Cluster | None = None
) -> APIRouter:
    """Corral's own routes: health, a model's logs, load and unload, the status, its events,
    the dashboard and the metrics."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        """`ok`; `degraded` while the task store (batches) cannot be reached, saying why:
        interactive requests do not need it, so the gateway stays up. Answered from the last
        ping (`StoreHealth`), never waiting on the store."""
        if batches is None:
            return {"status": "ok"}
        problem = await batches.health.problem()
        if problem is not None:
            return {"status": "degraded", "store": problem}
        return {"status": "ok", "store": "ok"}

    _operations(router, config, gateway)
    _views(router, gateway, batches, cluster)
    _accounts(router, gateway, batches)
    return router


def _operations(router: APIRouter, config: Config, gateway: Gateway) -> None:
    """A model's logs, and the load and unload API."""

    @router.get("/api/models/{model}/logs", response_class=PlainTextResponse)
    async def logs(model: str, lines: int = 200) -> Response:
        resolved = config.resolve(model)
        if resolved is None or resolved not in gateway.backends:
            raise unknown_model(model, config)
        backend = gateway.backends[resolved]
        tail = await asyncio.to_thread(backend.log_tail, max(1, min(lines, 10_000)))
        tail = gateway.redact(tail)
        return Response(tail + "\n" if tail else "", media_type="text/plain; charset=utf-8")

    @router.post("/api/models/{model}/load")
    async def load(model: str, wait: bool = False) -> Response:
        """Load `model` now (evicting only models without work); with `wait`, answer once it is
        ready: 200, or 503 if it failed. Without: 202 while it loads, 200 if already loaded."""
        return await operate(model, wait, load=True)

    @router.post("/api/models/{model}/unload")
    async def unload(model: str, wait: bool = False) -> Response:
        """Unload idle `model` now; 409 if it has queued or running requests."""
        return await operate(model, wait, load=False)

    async def operate(name: str, wait: bool, load: bool) -> Response:
        model = config.resolve(name)
        if model is None or model not in gateway.backends:
            raise unknown_model(name, config)
        sched = gateway.scheduler
        assert sched is not None
        m = sched.models[model]
        before = m.state.value
        act = sched.on_load_requested if load else sched.on_unload_requested
        reason = act(model)
        if reason is not None:
            verb = "load" if load else "unload"
            raise Conflict(f"cannot {verb} {model} now: {reason}", code="busy")
        if wait:
            await gateway.settled(model)
        state = m.state.value
        if load and wait and state != "ready":
            failed = next(
                (s.error for s in reversed(gateway.tally.swaps) if s.model == model), None
            )
            raise ModelUnavailable(failed or f"{model} did not load")
        changed = state != before
        return JSONResponse(
            {"model": model, "state": state}, status_code=202 if changed and not wait else 200
        )


def _views(
    router: APIRouter, gateway: Gateway, batches: BatchRuntime | None, cluster: Cluster | None
) -> None:
    """The status, its events, the dashboard and the metrics."""
    metrics = gateway.metrics

    @router.get("/api/events", response_class=EventStream)
    async def events(request: Request) -> Response:
        """Server-sent events: the current status first (a user's own view), then every state
        change of the machine."""
        who = caller(request.scope)
        q = gateway.events.listen()

        async def stream() -> AsyncIterator[bytes]:
            try:
                first = gateway.status()
                yield _sse("status", first if who.admin else own_view(first, who.name))
                while True:
                    try:
                        event = await asyncio.wait_for(q.get(), 15)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    if event is None:  # the server is stopping
                        return
                    yield _sse(event["event"], event)
            finally:
                gateway.events.unlisten(q)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @router.get("/ui", response_class=HTMLResponse)
    async def ui() -> Response:
        return HTMLResponse(_UI)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(request: Request) -> Response:
        """The machine's figures, open to every scraper; the usage counters of the caller's
        principal (an admin's key: everyone's; none, while keys exist: nobody's)."""
        who = caller(request.scope)
        body = generate_latest(metrics.registry) + usage_exposition(
            gateway.usage, None if who.admin else who.name
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.get("/api/status")
    async def status(request: Request) -> dict[str, Any]:
        """The gateway's state: devices, models and their queues (per class), recent swaps and
        decisions, the batches not yet ended with their progress and ETA, and the cluster's
        nodes with the models each holds. A user sees the machine's state and, of requests and
        batches, its own (`own_view`)."""
        out = gateway.status()
        if cluster is not None:
            out["cluster"] = cluster.status()
        out["batches"] = await asyncio.to_thread(batches.status) if batches is not None else []
        relays = getattr(request.app.state, "relays", None)  # `corral serve --workers N`
        if relays is not None:
            out["relays"] = {**relays.status(), "grants_open": len(request.app.state.grants)}
        who = caller(request.scope)
        return out if who.admin else own_view(out, who.name)


def _accounts(router: APIRouter, gateway: Gateway, batches: BatchRuntime | None) -> None:
    """Who used what (`/api/usage`) and who did what (`/api/audit`)."""

    @router.get("/api/usage")
    async def usage(
        request: Request,
        by: str = "hour",
        since: float | None = None,
        until: float | None = None,
        principal: str | None = None,
    ) -> dict[str, Any]:
        """Who used what, per principal, model and period (`by`: hour, day or total) of the
        hours starting in [`since`, `until`) (epoch seconds): model calls, input and output
        tokens, seconds waited, and the device-seconds of service and of loads charged. A user
        sees its own; an admin everyone's, or `principal`'s."""
        if by not in PERIODS:
            raise InvalidRequest(f"by must be one of {', '.join(PERIODS)}; got {by!r}", param="by")
        who = caller(request.scope)
        seen = principal if who.admin else who.name
        rows = gateway.usage.rows(by, since, until, seen)
        return {"object": "list", "by": by, "data": rows}

    @router.get("/api/audit")
    async def audit(since: float = 0.0, limit: int = 100) -> dict[str, Any]:
        """The audit log (admins only): admin actions and key changes, newest first, at or
        after `since` (epoch seconds), at most `limit` (up to 10,000)."""
        if batches is None:  # no store: nothing is kept
            return {"object": "list", "data": []}
        entries = await asyncio.to_thread(batches.store.audit.list, since, limit)
        return {"object": "list", "data": [dataclasses.asdict(e) for e in entries]}


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


_UI = (Path(__file__).parent / "status.html").read_text(encoding="utf-8")
