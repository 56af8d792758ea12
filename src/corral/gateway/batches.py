"""`corral serve`'s Batch API: `/v1/files` and `/v1/batches` over `BatchService`, and the batch
lines run through the gateway's own scheduler.

A batch line is a task in the store. A `Worker` attached to the gateway's scheduler mirrors the
queued lines into it as requests of the batch class (priority `batch.priority` inside it), so
one scheduler decides for both: interactive requests of any model first, batch lines fill every
idle slot and idle device, and batches for other models are grouped like any other work. A
dispatched line is sent to its model's server by `run_line`; the answer is the task's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

import aiohttp
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile as StarletteUploadFile
from starlette.formparsers import MultiPartParser

import corral
from corral.batch.files import FileStorage, TooLarge
from corral.batch.jsonl import KIND
from corral.batch.service import BatchError, BatchService, expires_after_s
from corral.batch.webhooks import Deliverer
from corral.config import Config
from corral.gateway.errors import InvalidRequest, error, no_space_error
from corral.gateway.openapi import (
    BatchList,
    BatchObject,
    CreateBatchRequest,
    FileDeleted,
    FileList,
    FileObject,
    FileUpload,
    content,
    form_body,
    json_body,
)
from corral.gateway.runtime import Gateway
from corral.ratelog import Throttle, no_space
from corral.store import Store, StoreBusy, StoreUnavailable
from corral.worker.registry import ModelHooks, Registry, current_device, current_task
from corral.worker.runtime import Worker, WorkerSettings

log = logging.getLogger("corral.batch")
throttle = Throttle(log)

# 408 and 429 are the server asking for time; 5xx, a server in trouble: worth another try.
_RETRY = {408, 429}


def line_runner(
    config: Config, gateway: Gateway, session: Callable[[], aiohttp.ClientSession]
) -> Callable[[Any], Awaitable[dict[str, Any]]]:
    """The handler of batch-line tasks: POST the line's body to its model's server."""

    async def run_line(line: dict[str, Any]) -> dict[str, Any]:
        body = dict(line["body"])
        ctx = current_task()
        model = ctx.model if ctx is not None else config.resolve(body.get("model", ""))
        if model is None or model not in gateway.backends:
            raise corral.Fail(json.dumps({"status_code": 404, "body": _err("model not served")}))
        backend = gateway.backend_on(model, current_device())
        body["model"] = backend.served_name
        body.pop("priority", None)
        url = f"{backend.proxy_url}{line['url']}"
        async with session().post(url, json=body, headers=backend.headers) as resp:
            raw = await resp.read()
            request_id = resp.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):  # a line's `response.body` is always an object
            text = raw.decode("utf-8", "replace").strip()[:1000]
            parsed = {
                "error": {
                    "message": f"the model server answered {resp.status} with no JSON object: "
                    f"{text or '(empty)'}",
                    "type": "upstream_error",
                    "param": None,
                    "code": f"upstream_{resp.status}",
                }
            }
        answer = {"status_code": resp.status, "request_id": request_id, "body": parsed}
        if resp.status < 400:
            return answer
        retry = resp.status >= 500 or resp.status in _RETRY
        if retry and ctx is not None and not ctx.last_attempt:
            raise RuntimeError(f"the server answered {resp.status}")  # tried again later
        raise corral.Fail(json.dumps(answer))  # the error file keeps the server's answer

    return run_line


def _err(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


class BatchRuntime:
    """The store, the files, the service and the worker that runs lines; `start` and `close`
    inside the serving loop."""

    def __init__(self, config: Config, gateway: Gateway, store: Store, files: FileStorage) -> None:
        self.config = config
        self.gateway = gateway
        self.store = store
        line_mb = config.batch.max_line_mb or config.server.max_body_mb
        self.service = BatchService(
            store, files, config.batch, config.resolve, max_line_bytes=int(line_mb * (1 << 20))
        )
        self._session: aiohttp.ClientSession | None = None
        registry = Registry()
        for name in gateway.backends:
            registry.add_model(ModelHooks(name))  # loads are the gateway's; no hooks here
        registry.add_handler(
            KIND, next(iter(gateway.backends)), line_runner(config, gateway, self.session)
        )
        # A short lease: after a crash, the restarted server takes the lines its last run held
        # within seconds (heartbeats renew it every second while a line runs).
        # On shutdown, running lines get 5 s to finish, then go back to the queue.
        # Its URL makes it a node of a cluster, with the gateway's name.
        settings = WorkerSettings(
            lease_s=10.0, shutdown_timeout_s=5.0, url=config.server.advertised_url()
        )
        self.worker = Worker(store, registry, config, settings, worker_id=gateway.node_id)
        self._tasks: list[asyncio.Task[Any]] = []
        self._live = 0
        # Whether this node ends batches (validation, finalizing, expiry, webhooks): in a
        # cluster one node does (gateway/cluster.py), so a webhook is sent once.
        self.leads: Callable[[], bool] = lambda: True

    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the batch runtime is not started"
        return self._session

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        sched = self.gateway.scheduler
        assert sched is not None, "start the gateway first"
        self.worker.attach(sched)
        self.gateway.attach(self.worker)
        self._tasks = [
            asyncio.ensure_future(self.worker.run()),
            asyncio.ensure_future(self._ticks()),
        ]

    async def close(self) -> None:
        """Stop taking lines; running ones finish or go back (the worker's graceful stop)."""
        self.worker.stop()
        if self._tasks:  # the worker's run first: it releases what it held
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tasks[0], 10)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.to_thread(self.store.close)

    def status(self) -> list[dict[str, Any]]:
        """The batches not yet ended, oldest first (blocking: store reads): counts, progress,
        place in line and ETA. A running batch's ETA comes from its measured rate; one with no
        line done yet gets an estimate from the scheduler's measured service times: the lines of
        the batches ahead of it on its models, then its own, plus a load per model."""
        sched = self.gateway.scheduler
        assert sched is not None
        ahead_s: dict[str, float] = {}  # per model: seconds of batch work queued so far
        out = []
        for b in self.service.live():
            obj = self.service.object(b)
            counts, ext = obj["request_counts"], obj["corral"]
            left = counts["total"] - counts["completed"] - counts["failed"]
            models: dict[str, int] = b.data.get("models") or {}
            lines = sum(models.values()) or 1
            eta_s = 0.0
            for name, n in models.items():
                m = sched.models.get(name)
                if m is None:
                    continue
                work = left * n / lines * m.service_est / m.concurrency
                ahead_s[name] = ahead_s.get(name, 0.0) + work
                eta_s += ahead_s[name] + (0.0 if m.resident else m.load_est)
            out.append(
                {
                    "id": b.id,
                    "status": b.status,
                    "models": models,
                    "request_counts": counts,
                    "progress": ext["progress"],
                    "queue_position": ext.get("queue_position", 0),
                    "eta_s": ext["eta_s"] if ext["eta_s"] is not None else round(eta_s, 1),
                    "eta_from": "rate" if ext["eta_s"] is not None else "estimate",
                }
            )
        return out

    async def _ticks(self, every_s: float = 0.25) -> None:
        async def report(batch_id: str, problem: str | None) -> None:
            if problem is not None:
                log.warning("webhook of batch %s not delivered: %s", batch_id, problem)
            await asyncio.to_thread(self.service.webhook_sent, batch_id, problem)

        limits = self.config.batch
        hooks = Deliverer(
            limits.webhook_hosts, report, limits.webhook_secret, limits.webhook_timeout_s
        )
        try:
            while True:
                if not self.leads():  # another node of the cluster ends batches
                    await asyncio.sleep(every_s)
                    continue
                try:
                    live, due = await asyncio.to_thread(self.service.tick)
                    if live or self._live:  # the dashboard refreshes its batch list on these
                        self.gateway.publish("batches", running=live)
                    self._live = live
                    for hook in due:  # in the background: a slow target delays no batch
                        hooks.submit(hook.batch_id, hook.url, hook.body)
                except (StoreUnavailable, StoreBusy) as exc:  # the store logged the outage
                    throttle.warning("store", "batch tick skipped: %s", exc)
                except Exception as exc:  # keep ending batches whatever one tick hit
                    # Once per cause per minute: a fault that repeats every tick wrote
                    # thousands of lines (issue 25).
                    throttle.warning(type(exc).__name__, "batch tick failed", exc_info=True)
                await asyncio.sleep(every_s)
        finally:
            await hooks.close()


def routes(runtime: BatchRuntime, max_upload_bytes: int) -> APIRouter:
    router = APIRouter()
    svc = runtime.service

    async def call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kw)

    @router.post("/v1/files", openapi_extra=form_body(FileUpload), response_model=FileObject)
    async def upload(request: Request) -> Response:
        """Multipart `file` and `purpose`. The parser spools the file part to disk past 1 MB,
        and it is copied from there in 1 MB chunks: never in memory whole."""
        limit = max_upload_bytes + 64 * 1024  # the file, and room for the other fields
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return _too_large(max_upload_bytes)

        async def counted() -> AsyncGenerator[bytes, None]:
            # Counted as the bytes arrive: a chunked upload without Content-Length is refused
            # the moment it passes the limit, not after it was read and spooled whole.
            seen = 0
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > limit:
                    raise TooLarge(f"over {limit} bytes")
                yield chunk

        parser = MultiPartParser(request.headers, counted(), max_files=1, max_fields=8)
        try:
            form = await parser.parse()
        except TooLarge:
            return _too_large(max_upload_bytes)
        except OSError as exc:  # the parser spools file parts to the temporary folder
            if not no_space(exc):
                raise
            return no_space_error(f"the temporary folder ({tempfile.gettempdir()})")
        except Exception as exc:  # the parser's errors have no common base to catch
            raise InvalidRequest(f"bad multipart body: {exc}") from None
        try:
            part, purpose = form.get("file"), form.get("purpose")
            if not isinstance(part, StarletteUploadFile):
                raise InvalidRequest("missing the `file` part", param="file")
            if purpose != "batch":
                raise InvalidRequest(f"purpose must be 'batch'; got {purpose!r}", param="purpose")
            keep_s = None
            if "expires_after[anchor]" in form or "expires_after[seconds]" in form:
                fields = {
                    "anchor": form.get("expires_after[anchor]"),
                    "seconds": form.get("expires_after[seconds]"),
                }
                keep_s = expires_after_s(fields, "expires_after")
            file_id = FileStorage.new_id()
            try:
                size = await svc.files.save(file_id, _chunks(part), max_upload_bytes)
            except TooLarge:
                return _too_large(max_upload_bytes)
            except OSError as exc:
                if not no_space(exc):
                    raise
                return no_space_error(f"the files folder ({svc.files.root})")
            name = part.filename or "upload.jsonl"
            f = await call(svc.add_file, file_id, name, purpose, size, keep_s)
        finally:
            await form.close()
        return JSONResponse(svc.file_object(f))

    @router.get("/v1/files", response_model=FileList)
    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        page, more = await call(svc.list_files, purpose, after, limit, order)
        return JSONResponse(_page([svc.file_object(f) for f in page], more))

    @router.get("/v1/files/{file_id}", response_model=FileObject)
    async def get_file(file_id: str) -> Response:
        return JSONResponse(svc.file_object(await call(svc.file, file_id)))

    @router.delete("/v1/files/{file_id}", response_model=FileDeleted)
    async def delete_file(file_id: str) -> Response:
        f = await call(svc.delete_file, file_id)
        return JSONResponse({"id": f.id, "object": "file", "deleted": True})

    @router.get("/v1/files/{file_id}/content", responses=content("application/jsonl"))
    async def file_content(file_id: str) -> Response:
        f = await call(svc.file, file_id, read=True)
        return FileResponse(f.path, media_type="application/jsonl", filename=f.filename)

    @router.post(
        "/v1/batches", openapi_extra=json_body(CreateBatchRequest), response_model=BatchObject
    )
    async def create_batch(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        for key in ("input_file_id", "endpoint"):
            if not isinstance(body.get(key), str):
                raise InvalidRequest(
                    f"missing `{key}`", param=key, code="missing_required_parameter"
                )
        b = await call(
            svc.create,
            body["input_file_id"],
            body["endpoint"],
            body.get("completion_window"),
            body.get("metadata"),
            request.headers.get("idempotency-key"),
            body.get("webhook_url"),
            body.get("model"),
            body.get("output_expires_after"),
        )
        return JSONResponse(await call(svc.object, b))

    @router.get("/v1/batches", response_model=BatchList)
    async def list_batches(
        after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
    ) -> Response:
        page, more = await call(svc.list_batches, after, limit)
        objects = [await call(svc.object, b) for b in page]
        return JSONResponse(_page(objects, more))

    @router.get("/v1/batches/{batch_id}", response_model=BatchObject)
    async def get_batch(batch_id: str) -> Response:
        return JSONResponse(await call(svc.object, await call(svc.batch, batch_id)))

    @router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
    async def cancel_batch(batch_id: str) -> Response:
        return JSONResponse(await call(svc.object, await call(svc.cancel, batch_id)))

    return router


async def refused(_: Request, exc: Exception) -> Response:
    """A `BatchError` from any route, in OpenAI's error shape (install with
    `app.add_exception_handler(BatchError, refused)`)."""
    assert isinstance(exc, BatchError)
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return error(exc.status, str(exc), kind, param=exc.param, code=exc.code)


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


async def _chunks(part: StarletteUploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(1 << 20):
        yield chunk


def _too_large(limit: int) -> JSONResponse:
    return error(
        413,
        f"file over {limit // (1024 * 1024)} MB (batch.max_file_mb)",
        "invalid_request_error",
        param="file",
        code="file_too_large",
    )
