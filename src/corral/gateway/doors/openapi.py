"""What `/openapi.json` says: request and answer bodies of every route, the model routes (served
by a pure ASGI fast path, so FastAPI would not list them), and one error shape, OpenAI's, for
every error status. These models document; the handlers check bodies themselves, with errors
that name the field (a schemathesis run in the test suite holds the two together)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from corral.limits import PRIORITY_MAX, PRIORITY_MIN

_Priority = Field(
    None,
    ge=PRIORITY_MIN,
    le=PRIORITY_MAX,
    description="Corral's extension (or the X-Corral-Priority header): higher runs first.",
)


class _Open(BaseModel):
    """A model server's request: Corral reads `model` (and `priority`), the rest passes on."""

    model_config = ConfigDict(extra="allow")


class ChatCompletionRequest(_Open):
    model: str
    messages: list[dict[str, Any]]
    stream: bool | None = None
    priority: int | None = _Priority


class CompletionRequest(_Open):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool | None = None
    priority: int | None = _Priority


class EmbeddingRequest(_Open):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    priority: int | None = _Priority


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: str = Field(description="`24h`, as OpenAI's; see the README for more.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 pairs.")
    output_expires_after: ExpiresAfter | None = None


class FileUpload(BaseModel):
    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    model_config = ConfigDict(extra="allow")  # `corral`: progress, ETA, webhook

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts | None
    usage: dict[str, Any] | None = None
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ModelObject(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, description, meta (llama-swap's)

    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error Corral answers, whatever the route or status."""

    error: ErrorDetail


_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    CreateBatchRequest,
    FileUpload,
    ErrorBody,
)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its JSON body itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads a multipart body itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": ref}}}}


def content(*media_types: str) -> dict[int | str, dict[str, Any]]:
    """`responses` for a 200 that is not JSON (or not only)."""
    return {200: {"description": "OK", "content": {t: {"schema": {}} for t in media_types}}}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` the finished document: the body schemas above under
    `components.schemas`, and for every operation an error answer in OpenAI's shape (`default`)
    in place of FastAPI's 422 validation body, which Corral never sends."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in _MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        error_ref = {"$ref": "#/components/schemas/ErrorBody"}
        for item in doc.get("paths", {}).values():
            for op in item.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                responses["default"] = {
                    "description": "An error, in OpenAI's shape",
                    "content": {"application/json": {"schema": error_ref}},
                }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
