"""`corral serve`'s Batch API: `/v1/files` and `/v1/batches` over `BatchService`, and the batch
lines' runtime (`batch/attached.py`: a worker attached to the gateway's scheduler)."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile as StarletteUploadFile
from starlette.formparsers import MultiPartParser

from corral.access.principals import caller, owner_made, owner_seen
from corral.batch.attached import BatchRuntime
from corral.batch.fields import BatchError, expires_after_s
from corral.batch.files import FileStorage, TooLarge
from corral.batch.service import BatchService
from corral.gateway.doors.openapi import (
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
from corral.gateway.errors import InvalidRequest, error, no_space_error
from corral.ratelog import Throttle, no_space

log = logging.getLogger("corral.batch")
throttle = Throttle(log)


def routes(runtime: BatchRuntime, max_upload_bytes: int) -> APIRouter:
    """The Batch API's routes: `/v1/files` and `/v1/batches`."""
    router = APIRouter()
    _file_routes(router, runtime.service, max_upload_bytes)
    _batch_routes(router, runtime.service)
    return router


async def _call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn` (a store's, blocking) in a thread."""
    return await asyncio.to_thread(fn, *args, **kw)


async def _upload(svc: BatchService, max_upload_bytes: int, request: Request) -> Response:
    """An upload to `/v1/files` (its route's docstring says how)."""
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
        made = owner_made(caller(request.scope))
        f = await _call(svc.add_file, file_id, name, purpose, size, keep_s, made)
    finally:
        await form.close()
    return JSONResponse(svc.file_object(f))


def _file_routes(router: APIRouter, svc: BatchService, max_upload_bytes: int) -> None:
    @router.post("/v1/files", openapi_extra=form_body(FileUpload), response_model=FileObject)
    async def upload(request: Request) -> Response:
        """Multipart `file` and `purpose`. The parser spools the file part to disk past 1 MB,
        and it is copied from there in 1 MB chunks: never in memory whole."""
        return await _upload(svc, max_upload_bytes, request)

    @router.get("/v1/files", response_model=FileList)
    async def list_files(
        request: Request,
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        seen = owner_seen(caller(request.scope))
        page, more = await _call(svc.list_files, purpose, after, limit, order, seen)
        return JSONResponse(_page([svc.file_object(f) for f in page], more))

    @router.get("/v1/files/{file_id}", response_model=FileObject)
    async def get_file(request: Request, file_id: str) -> Response:
        seen = owner_seen(caller(request.scope))
        return JSONResponse(svc.file_object(await _call(svc.file, file_id, False, seen)))

    @router.delete("/v1/files/{file_id}", response_model=FileDeleted)
    async def delete_file(request: Request, file_id: str) -> Response:
        f = await _call(svc.delete_file, file_id, owner_seen(caller(request.scope)))
        return JSONResponse({"id": f.id, "object": "file", "deleted": True})

    @router.get("/v1/files/{file_id}/content", responses=content("application/jsonl"))
    async def file_content(request: Request, file_id: str) -> Response:
        f = await _call(svc.file, file_id, True, owner_seen(caller(request.scope)))
        return FileResponse(f.path, media_type="application/jsonl", filename=f.filename)


def _batch_routes(router: APIRouter, svc: BatchService) -> None:
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
        b = await _call(
            svc.create,
            body["input_file_id"],
            body["endpoint"],
            body.get("completion_window"),
            body.get("metadata"),
            request.headers.get("idempotency-key"),
            body.get("webhook_url"),
            body.get("model"),
            body.get("output_expires_after"),
            owner_made(caller(request.scope)),
            caller(request.scope).models,
            caller(request.scope).weight,
        )
        return JSONResponse(await _call(svc.object, b))

    @router.get("/v1/batches", response_model=BatchList)
    async def list_batches(
        request: Request, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
    ) -> Response:
        page, more = await _call(svc.list_batches, after, limit, owner_seen(caller(request.scope)))
        objects = [await _call(svc.object, b) for b in page]
        return JSONResponse(_page(objects, more))

    @router.get("/v1/batches/{batch_id}", response_model=BatchObject)
    async def get_batch(request: Request, batch_id: str) -> Response:
        b = await _call(svc.batch, batch_id, owner_seen(caller(request.scope)))
        return JSONResponse(await _call(svc.object, b))

    @router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        b = await _call(svc.cancel, batch_id, owner_seen(caller(request.scope)))
        return JSONResponse(await _call(svc.object, b))


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
