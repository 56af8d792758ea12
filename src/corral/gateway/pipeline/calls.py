"""What a request to a model route says, read once into a `Call`: the routes that name a
model, the body (bounded), the model it names, its priority, llama-swap's filters. `Reader` is
the one prelude of every door; each check raises a `GatewayError` that names the field and the
fix (errors.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from starlette.formparsers import MultiPartParser

from corral.access.principals import ANYONE, Principal, caller
from corral.backends.base import Backend
from corral.config import Config, FiltersConfig
from corral.gateway.errors import BodyTooLarge, InvalidRequest, ModelNotFound
from corral.gateway.servers import progress
from corral.limits import PRIORITY_MAX, PRIORITY_MIN

# The model-routed endpoints, as llama-swap routes them (internal/server/server.go): a JSON body
# naming the model; a multipart form with a `model` field; a GET with `?model=`. The versionless
# `/v/...` forms reach the server without their `/v`.
JSON_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/input_tokens",
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
FORM_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/images/edits")
GET_ROUTES = ("/v1/audio/voices", "/sdapi/v1/loras", "/props")


class Dialect(Protocol):
    """A front door that speaks another API than the model servers' (OpenAI's): it turns
    their answers into its own (`ollama_answers.OllamaAnswer`), their errors included
    (`error`); the gateway's own refusals reach its door as `GatewayError`s, which it writes
    the same way."""

    media_type: str

    def error(self, message: str) -> bytes:
        """An error answer's body, saying `message` (its status is the server's)."""
        ...

    def whole(self, content: bytes, wait_s: float) -> bytes:
        """A complete answer; raises ValueError if it cannot be read."""
        ...

    def stream(self, events: AsyncIterator[bytes], wait_s: float) -> AsyncIterator[bytes]:
        """Server-sent events, cut at line ends, as the dialect's stream."""
        ...


@dataclass(frozen=True, slots=True)
class Call:
    """One request to a model, read once at its door: admission, a cluster hop, the upstream
    exchange and the rendering of its answer all take it.

    `body` is what the model's server gets (llama-swap's filters applied, the server's own name
    for the model, no `priority`); `sent`, the body as the client sent it (another node of a
    cluster reads it itself). `data` is the JSON object of an OpenAI JSON route (coalescing and
    the loading stream read it), None for the other routes. `openai`: error answers reach the
    client in OpenAI's shape whatever the server sent; `dialect`: another API's door, whose
    answers are turned into its shape (errors too)."""

    request: Request
    model: str
    path: str
    body: bytes
    sent: bytes
    priority: int
    stream: bool = True
    openai: bool = False
    dialect: Dialect | None = None
    data: Mapping[str, Any] | None = None


class Reader:
    """The prelude of every model route: the body (bounded), the model, the priority, the
    filters, read into a `Call` once."""

    def __init__(self, config: Config, served: Mapping[str, Backend], max_body: int) -> None:
        self.config = config
        self.served = served  # the models with a server (the gateway's, updated in place)
        self.max_body = max_body

    async def json(self, request: Request, path: str) -> Call:
        """A JSON model route (`/v1/chat/completions` and the rest of `JSON_ROUTES`)."""
        sent = await read_body(request, self.max_body)
        data = json_object(sent)
        name = data.get("model")
        model = self.model(name, caller(request.scope))
        priority = priority_of(request, data)
        data, body = self.outgoing(model, str(name), data, sent)
        stream = bool(data.get("stream"))
        return Call(request, model, path, body, sent, priority, stream, openai=True, data=data)

    async def form(self, request: Request, path: str) -> Call:
        """A multipart route (audio transcription, image edits): the model is the form's `model`
        field; the body goes on to the server as it came."""
        sent = await read_body(request, self.max_body)

        async def chunks() -> AsyncGenerator[bytes, None]:
            yield sent

        try:
            form = await MultiPartParser(request.headers, chunks()).parse()
        except Exception as exc:  # the parser's errors have no common base to catch
            raise InvalidRequest(f"bad multipart body: {exc}") from None
        try:
            model = self.model(form.get("model"), caller(request.scope))
        finally:
            await form.close()
        return Call(request, model, path, sent, sent, priority_of(request, {}), openai=True)

    async def query(self, request: Request, path: str) -> Call:
        """A GET route that names its model in the query (`/props?model=...`)."""
        model = self.model(request.query_params.get("model"), caller(request.scope))
        priority = priority_of(request, {})
        return Call(request, model, path, b"", b"", priority, stream=False, openai=True)

    async def raw(self, request: Request, model: str, path: str) -> Call:
        """The raw route `/upstream/{model}/{path}` (`model` as `model()` resolved it): the body
        goes on as it came."""
        sent = await read_body(request, self.max_body)
        return Call(request, model, path, sent, sent, priority_of(request, {}))

    def model(self, name: Any, who: Principal = ANYONE) -> str:
        """The served model `name` names (an alias resolved), or 400/404 saying why not (404
        too for one `who` may not use)."""
        model = model_of(name, self.config, self.served)
        if not who.may_use(model):
            raise unknown_model(str(name), self.config, who)
        return model

    def outgoing(
        self, model: str, name: str, data: dict[str, Any], sent: bytes | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """What `model`'s server gets of `data` (see `outgoing`)."""
        served = self.served[model].served_name
        return outgoing(self.config, served, model, name, data, sent)


def outgoing(
    config: Config,
    served: str,
    model: str,
    name: str,
    data: dict[str, Any],
    sent: bytes | None = None,
) -> tuple[dict[str, Any], bytes]:
    """What `model`'s server (which knows it as `served`) gets of the JSON object `data`, as an
    object and as bytes: the request named the model `name`; `sent`, its body as it came, goes
    on as it is when nothing changes. The server's own name for the model, no `priority`, the
    model's llama-swap filters, no loading progress of Corral's in its assistant turns (every
    door, and the Batch API's lines, send through this)."""
    m = config.models[model]
    # Corral's own loading progress, sent back by the client as the model's reasoning: out.
    stripped = (sent is None or progress.MARK_BYTES in sent) and progress.strip(data)
    if (
        sent is not None
        and not stripped
        and name == served
        and "priority" not in data
        and m.filters is None
    ):
        return data, sent
    out = {k: v for k, v in data.items() if k != "priority"}
    if m.filters is not None:
        rewrite(out, m.filters, name)
    out["model"] = served
    return out, json.dumps(out).encode()


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


def unknown_model(name: str, config: Config, who: Principal = ANYONE) -> ModelNotFound:
    """The error for a model name nothing serves (or `who` may not use), listing the valid ids
    `who` may use (raise it); for a model a folder offered but Corral skipped, why it is not
    served."""
    why = skipped_why(name, config)
    if why is not None:
        return ModelNotFound(
            f"model {name!r} is not served: {why}", param="model", code="model_not_served"
        )
    valid = sorted(
        n
        for n, m in config.models.items()
        if (m.cmd or m.upstream) and not m.unlisted and who.may_use(n)
    )
    return ModelNotFound(
        f"model {name!r} not found; valid ids: {', '.join(valid)}",
        param="model",
        code="model_not_found",
    )


def skipped_why(name: str, config: Config) -> str | None:
    """Why the models folder skipped `name`, if it did; as `Config.resolve` names models, with
    or without Ollama's `:latest`."""
    skipped = config.skipped
    bare = name.removesuffix(":latest")
    return skipped.get(name) or skipped.get(bare) or skipped.get(f"{bare}:latest")


async def read_body(request: Request, max_body: int) -> bytes:
    """The whole body, refused (413) past `max_body` bytes, declared or sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise _too_large(max_body)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise _too_large(max_body)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(
        f"request body over {limit // (1024 * 1024)} MB (server.max_body_mb)",
        code="body_too_large",
    )


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 naming what is wrong with it."""
    try:
        data = json.loads(body, parse_constant=no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN or Infinity: JSON has neither
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to read") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return data


def priority_of(request: Request, body: dict[str, Any]) -> int:
    """The request's priority: the `x-corral-priority` header, else the body's `priority`."""
    raw = request.headers.get("x-corral-priority", body.get("priority", 0))
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and raw.strip().lstrip("+-").isdigit() and len(raw) < 20:
        value = int(raw)
    if value is None or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidRequest(
            f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}; "
            f"got {str(raw)[:40]!r}",
            param="priority",
        )
    return value


def model_of(name: Any, config: Config, served: Collection[str]) -> str:
    """The served model a request names (an alias resolved), or 400/404 saying why not."""
    if name is None or name == "":
        raise InvalidRequest("missing `model`: say which model should answer", param="model")
    if not isinstance(name, str):
        raise InvalidRequest(
            f"`model` must be a string naming a model; got {json.dumps(name)[:40]} "
            f"({type(name).__name__})",
            param="model",
        )
    model = config.resolve(name)
    if model is None or model not in served:
        raise unknown_model(name, config)
    return model
