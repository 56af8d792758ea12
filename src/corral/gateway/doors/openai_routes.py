"""OpenAI's model routes beyond the fast path, as a router: the multipart and `?model=` routes,
the documented model routes (what /openapi.json shows), `/v1/models`, `/v1/models/{id}` and the
raw `/upstream/{model}/{path}`. The requests themselves go through `Proxy`."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response

from corral.access.principals import caller
from corral.config import Config
from corral.gateway.doors.openapi import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelList,
    ModelObject,
    content,
    json_body,
)
from corral.gateway.errors import Forbidden, NotStored
from corral.gateway.pipeline.calls import FORM_ROUTES, GET_ROUTES, unknown_model
from corral.gateway.pipeline.proxy import Proxy
from corral.gateway.servers.lifecycle import managed
from corral.gateway.servers.runtime import Gateway


async def _form(px: Proxy, path: str, request: Request) -> Response:
    return await px.handle_form(request, path)


async def _query(px: Proxy, path: str, request: Request) -> Response:
    return await px.handle_query(request, path)


def openai_routes(px: Proxy) -> APIRouter:
    """`/v1/models`, the model routes, the raw pass-through `/upstream/{model}/{path}` and the
    Responses API's routes Corral refuses with their reason."""
    router = APIRouter()
    _model_routes(router, px)
    _responses(router)
    _models(router, px.config, px.gateway)
    return router


def _model_routes(router: APIRouter, px: Proxy) -> None:
    answers = content("application/json", "text/event-stream")

    # The model routes: `ModelRoutes` serves them before FastAPI routes anything; these are
    # what /openapi.json shows of them, and they serve the same way if it is not installed.
    @router.post(
        "/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=answers
    )
    async def chat_completions(request: Request) -> Response:
        return await px.handle(request, "/v1/chat/completions")

    @router.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=answers)
    async def completions(request: Request) -> Response:
        return await px.handle(request, "/v1/completions")

    @router.post(
        "/v1/embeddings",
        openapi_extra=json_body(EmbeddingRequest),
        responses=content("application/json"),
    )
    async def embeddings(request: Request) -> Response:
        return await px.handle(request, "/v1/embeddings")

    @router.api_route(
        "/upstream/{model}/{path:path}",
        methods=["GET", "POST", "PUT", "DELETE"],
        responses=content("*/*"),
    )
    async def upstream(request: Request, model: str, path: str) -> Response:
        resolved = px.reader.model(model, caller(request.scope))
        refused = managed(request.method, path, model)
        if refused is not None:
            raise Forbidden(refused, code="managed_by_corral")
        # Another node that holds the model gets the raw route too.
        return await px.route(await px.reader.raw(request, resolved, f"/{path}"), px.serve)

    for route in FORM_ROUTES:
        router.add_api_route(
            route, functools.partial(_form, px, route), methods=["POST"], include_in_schema=False
        )
    for route in GET_ROUTES:
        router.add_api_route(
            route, functools.partial(_query, px, route), methods=["GET"], include_in_schema=False
        )


def _responses(router: APIRouter) -> None:
    # A stored response (read, cancel, delete, its input items) names no model, so the gateway
    # cannot tell which server holds it; Corral keeps none itself. The model's server is asked
    # directly through the raw route.
    @router.api_route(
        "/v1/responses/{response_id}/{rest:path}",
        methods=["GET", "POST", "DELETE"],
        include_in_schema=False,
    )
    @router.api_route(
        "/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False
    )
    async def stored_response(response_id: str, rest: str = "") -> Response:
        raise NotStored(
            f"Corral keeps no responses, and response {response_id[:80]!r} names no model: "
            "send the whole conversation in `input` (the model servers behind Corral are "
            "stateless), or ask the server that made it: /upstream/{model}/v1/responses/"
            f"{response_id[:80]}",
            code="response_not_stored",
        )

    router.add_api_websocket_route("/v1/responses", refuse_responses_socket)


async def refuse_responses_socket(socket: WebSocket) -> None:
    """The Responses API over a WebSocket (a session that keeps its responses) is not served:
    said in the API's own error event, then the socket closes (policy)."""
    await socket.accept()
    await socket.send_json(
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_not_supported",
                "message": "Corral serves the Responses API over HTTP only (POST "
                "/v1/responses, streamed with stream: true); its WebSocket mode keeps "
                "responses, which Corral and its model servers do not",
            },
        }
    )
    # The reason is what a client shows of a close (123 bytes at most).
    await socket.close(code=1008, reason="Corral serves the Responses API over HTTP only")


def _models(router: APIRouter, config: Config, gateway: Gateway) -> None:
    @router.get("/v1/models/{model_id:path}", response_model=ModelObject)
    async def model(request: Request, model_id: str) -> Response:
        """One model, as `client.models.retrieve(id)` reads it (aliases answer too)."""
        resolved = config.resolve(model_id)
        who = caller(request.scope)
        if resolved is None or resolved not in gateway.backends or not who.may_use(resolved):
            raise unknown_model(model_id, config, who)
        created = int(gateway.tally.started_at)
        return JSONResponse(
            {"id": model_id, "object": "model", "created": created, "owned_by": "corral"}
        )

    @router.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> Response:
        created = int(gateway.tally.started_at)
        who = caller(request.scope)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    listed_model(listed, name, config, created, gateway.state_of(name))
                    for name in gateway.backends
                    if not config.models[name].unlisted and who.may_use(name)
                    for listed in (
                        [name, *config.models[name].aliases]
                        if config.server.list_aliases
                        else [name]
                    )
                ],
            }
        )


def listed_model(
    listed: str, name: str, config: Config, created: int, status: str | None = None
) -> dict[str, Any]:
    """A /v1/models record: OpenAI's fields, and llama-swap's name, description, metadata and
    `status` (`{"value": "loaded" | "loading" | "unloaded"}`)."""
    m = config.models[name]
    record: dict[str, Any] = {"id": listed, "object": "model", "created": created}
    record["owned_by"] = "corral"
    if status is not None:
        record["status"] = {"value": status}
    if m.name:
        record["name"] = m.name
    if m.description:
        record["description"] = m.description
    listing = m.capabilities.listing() if m.capabilities is not None else {}
    record.update(listing)
    # As llama-swap: the capabilities' fields win over metadata keys of the same names.
    meta = {k: v for k, v in m.metadata.items() if k not in listing}
    if meta:
        record["meta"] = {"llamaswap": meta}
    if listing.get("context_length"):
        record.setdefault("meta", {})["n_ctx"] = listing["context_length"]
    return record
