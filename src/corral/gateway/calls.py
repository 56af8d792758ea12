"""What a request to a model route says, read once: the routes that name a model, the body
(bounded), the model it names, its priority, llama-swap's filters. Each check raises a
`GatewayError` that names the field and the fix (errors.py)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from corral.config import Config, FiltersConfig
from corral.gateway.errors import error

# The model-routed endpoints, as llama-swap routes them (internal/server/server.go): a JSON body
# naming the model; a multipart form with a `model` field; a GET with `?model=`. The versionless
# `/v/...` forms reach the server without their `/v`.
JSON_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/rerank",
    "/v1/reranking",
    "/reranking",
    "/infill",
    "/completion",
    "/v1/audio/speech",
    "/v1/audio/voices",
    "/v1/images/generations",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    "/v/chat/completions",
    "/v/responses",
    "/v/completions",
    "/v/messages",
    "/v/messages/count_tokens",
    "/v/embeddings",
    "/v/rerank",
    "/v/reranking",
)
FORM_ROUTES = ("/v1/audio/transcriptions", "/v1/images/edits")
GET_ROUTES = ("/v1/audio/voices", "/sdapi/v1/loras", "/props")


def upstream_path(path: str) -> str:
    """The path a model server gets: versionless `/v/...` routes lose their `/v`."""
    return path[2:] if path.startswith("/v/") else path


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (use a number or null)")


def rewrite(data: dict[str, Any], filters: FiltersConfig, name: str) -> None:
    """llama-swap's filters, in its order: strip, set, then set by the requested id."""
    for key in filters.strip_params:
        data.pop(key, None)
    data.update(filters.set_params)
    data.update(filters.set_params_by_id.get(name, {}))


def unknown_model(name: str, config: Config) -> JSONResponse:
    valid = sorted(n for n, m in config.models.items() if (m.cmd or m.upstream) and not m.unlisted)
    return error(
        404,
        f"model {name!r} not found; valid ids: {', '.join(valid)}",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )
