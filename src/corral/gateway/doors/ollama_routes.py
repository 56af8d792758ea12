"""Ollama's API as a front door, on the same scheduler and request pipeline as the
OpenAI routes: `/`, `/api/tags`, `/api/ps`, `/api/show`, `/api/chat`, `/api/generate`,
`/api/embed`, `/api/embeddings`, and clear refusals for the model-store commands (`pull` of a
model Corral serves succeeds, as Ollama's does for one already pulled).

A request is read and checked here, rewritten as the OpenAI request its model's server takes
(`ollama_shapes.py`), and goes through `Proxy.serve` (admission, the model's turn, the call,
the relay) with an `OllamaAnswer` turning the answer into Ollama's shape. Every error reaches
the client once, as Ollama writes it: `{"error": "..."}` with the status, or a last
`{"error": ...}` line in a stream already under way. `keep_alive` sets how long the model stays
once idle (`Scheduler.on_keep_alive`); an empty prompt loads the model through the queue.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute

from corral.access.principals import ANYONE, Principal, caller
from corral.config import Config, ModelConfig
from corral.gateway.doors.ollama_answers import OllamaAnswer, error_body
from corral.gateway.doors.ollama_shapes import (
    FILL_PATH,
    BadRequest,
    Kind,
    asked_context,
    chat_request,
    embed_request,
    generate_request,
    keep_alive_s,
    text_of,
    top_logprobs,
)
from corral.gateway.errors import GatewayError, InvalidRequest, ModelNotFound
from corral.gateway.pipeline.admission import disconnected
from corral.gateway.pipeline.calls import Call, json_object, priority_of, read_body, skipped_why
from corral.gateway.pipeline.proxy import Proxy
from corral.gateway.servers.runtime import Gateway

log = logging.getLogger("corral.gateway")
_STORE_COMMANDS = ("/api/push", "/api/create", "/api/copy", "/api/blobs/{digest}")
_FOREVER = "2318-11-23T00:00:00Z"
_LAST_EPOCH_S = datetime(
    9999, 1, 1, tzinfo=UTC
).timestamp()  # what Ollama shows for a model kept loaded (keep_alive -1)


def ollama_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """An error as Ollama writes one (`ollama_answers.error_body`, as its answers' errors)."""
    return Response(
        error_body(message), status_code=status, headers=headers, media_type="application/json"
    )


def ollama_failure(exc: GatewayError) -> Response:
    """A refusal of the pipeline in Ollama's shape: the same status (and Retry-After)."""
    if exc.status == 499:
        return exc.response()
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "retry-after"}
    return ollama_error(exc.status, exc.message, headers)


class OllamaRoute(APIRoute):
    """The Ollama router's routes: a `GatewayError` raised in one is answered in Ollama's shape
    (the app answers the others in OpenAI's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def mapped(request: Request) -> Response:
            try:
                return await handler(request)
            except GatewayError as exc:
                return ollama_failure(exc)

        return mapped


def tag_of(name: str) -> str:
    """The name as Ollama lists it: `name:tag`, `latest` when it has none."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class OllamaDoor:
    """Ollama's model routes (chat, generate, embed, embeddings), served as pure ASGI by the
    gateway's fast path like OpenAI's (`app.ModelRoutes`), and the helpers the other routes
    share."""

    PATHS: ClassVar[dict[str, Kind]] = {
        "/api/chat": "chat",
        "/api/generate": "generate",
        "/api/embed": "embed",
        "/api/embeddings": "embeddings",
    }

    def __init__(self, px: Proxy) -> None:
        self.px = px
        self.config = px.config
        self.gateway = px.gateway
        self._told: set[str] = set()  # models whose window was too small for a num_ctx

    async def handle(self, request: Request, path: str) -> Response:
        try:
            return await self.answer(request, self.PATHS[path])
        except GatewayError as exc:  # refused: counted and answered here, once
            self.px.metrics.refused(exc)
            return ollama_failure(exc)

    def lookup(self, name: Any, who: Principal = ANYONE) -> str | None:
        """The served model `name` (or `name` without `:latest`) refers to, if `who` may use
        it, or None."""
        if not isinstance(name, str) or not name:
            return None
        model = self.config.resolve(name)
        if model is None and name.endswith(":latest"):
            model = self.config.resolve(name[: -len(":latest")])
        served = model is not None and model in self.gateway.backends and who.may_use(model)
        return model if served else None

    def unknown(self, name: Any, who: Principal = ANYONE) -> str:
        """Why `lookup(name, who)` found nothing."""
        if not isinstance(name, str) or not name:
            return "missing `model`: say which model should answer"
        why = skipped_why(name, self.config)
        if why is not None:
            return f"model '{name}' is not served: {why}"
        listed = ", ".join(sorted(tag_of(n) for n in _listed(self.config, self.gateway, who)))
        return f"model '{name}' not found; Corral serves: {listed}"

    def resolve(self, name: Any, who: Principal = ANYONE) -> str:
        model = self.lookup(name, who)
        if model is not None:
            return model
        if not isinstance(name, str) or not name:
            raise InvalidRequest(self.unknown(name, who), param="model")
        raise ModelNotFound(self.unknown(name, who), param="model")

    async def read(self, request: Request) -> dict[str, Any]:
        return json_object(await read_body(request, self.px.max_body) or b"{}")

    async def answer(self, request: Request, kind: Kind) -> Response:
        sent = await read_body(request, self.px.max_body) or b"{}"
        data = json_object(sent)
        name = data.get("model")
        model = self.resolve(name, caller(request.scope))
        assert isinstance(name, str)
        call = Call(request, model, "", sent, sent, priority_of(request, data))
        # Another node that holds the model answers in Ollama's shape itself.
        return await self.px.route(call, functools.partial(self._here, kind, data, name))

    async def _here(self, kind: Kind, data: dict[str, Any], name: str, call: Call) -> Response:
        """On this node: the request in OpenAI's terms to the model's server (`name`, as the
        client named the model), its answer in Ollama's."""
        model = call.model
        reply = OllamaAnswer(name, kind)
        served = self.gateway.backends[model].served_name
        try:
            self._window(model, asked_context(data))
            keep = keep_alive_s(data.get("keep_alive"))
            reply.top_logprobs = top_logprobs(data) if kind in ("chat", "generate") else None
            if kind == "chat":
                if not data.get("messages"):
                    return await self.bare(call, keep, reply)
                path, body = "/v1/chat/completions", chat_request(data, served)
            elif kind == "generate":
                if not data.get("prompt") and not data.get("images"):
                    return await self.bare(call, keep, reply)
                path, body = generate_request({**data, "prompt": data.get("prompt", "")}, served)
                if path == "/v1/chat/completions":  # the answer carries the conversation on
                    reply.turns = [(m["role"], text_of(m["content"])) for m in body["messages"]]
            else:
                path, body = "/v1/embeddings", embed_request(data, served, kind)
                reply.dimensions = body.get("dimensions")
        except BadRequest as exc:
            raise InvalidRequest(str(exc)) from None
        if keep is not None:
            _keep_alive(self.gateway, model, keep)
        body, sent = self.px.reader.outgoing(model, name, body)  # the model's filters too
        stream = bool(body.get("stream"))
        response = await self.px.serve(
            replace(call, path=path, body=sent, stream=stream, dialect=reply, data=body)
        )
        if path == FILL_PATH and response.status_code in (404, 501):
            return _no_insert(name, response)
        return response  # its errors written by `reply` (the call's dialect)

    def _window(self, model: str, asked: int | None) -> None:
        """A request asked for a larger window than `model` is served with: it is served in the
        model's own (the answer's `x-corral-context` says which), and the log says once per
        model how to give it more."""
        m = self.config.models.get(model)
        caps = m.capabilities if m is not None else None
        context = caps.context if caps is not None else 0
        if asked is None or not context or asked <= context or model in self._told:
            return
        self._told.add(model)
        log.warning(
            "model %s: a client asked for num_ctx %d; it is served with its context of %d "
            "(give it more with `corral serve --context %s=%d` or `contexts:` under "
            "`models_dir:`; README.md, Context)",
            model,
            asked,
            context,
            model,
            asked,
        )

    async def bare(self, call: Call, keep: float | None, reply: OllamaAnswer) -> Response:
        """Nothing to generate: `keep_alive: 0` unloads the model once idle; otherwise the
        model loads, in its turn like any request (a turn that uses no slot)."""
        model = call.model
        if keep == 0:
            _keep_alive(self.gateway, model, 0.0)
            return Response(reply.bare("unload"), media_type="application/json")
        if keep is not None:
            _keep_alive(self.gateway, model, keep)
        gone = functools.partial(disconnected, call.request)
        async with self.px.turns.admit(
            model, call.priority, gone, caller(call.request.scope)
        ) as slot:
            pass  # the model is loaded: the turn ends at once, using no slot
        return Response(reply.bare("load", slot.wait_s), media_type="application/json")


def ollama_routes(door: OllamaDoor) -> APIRouter:
    """Ollama's other routes: `/`, the model list, what is loaded, one model's details, and
    the model-store commands."""
    router = APIRouter(include_in_schema=False, route_class=OllamaRoute)
    config, gateway = door.config, door.gateway
    read = door.read

    @router.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return PlainTextResponse("Ollama is running")

    @router.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags(request: Request) -> Response:
        listed = _listed(config, gateway, caller(request.scope))
        return JSONResponse({"models": [_tag(n, config.models[n], gateway.state_of(n))
                                        for n in listed]})  # fmt: skip

    @router.get("/api/ps")
    async def ps(request: Request) -> Response:
        status = gateway.status()["models"]
        listed = _listed(config, gateway, caller(request.scope))
        loaded = [n for n in listed if status[n]["state"] == "ready"]
        return JSONResponse({"models": [_loaded(n, config.models[n], status[n]) for n in loaded]})

    @router.post("/api/show")
    async def show(request: Request) -> Response:
        data = await read(request)
        model = door.resolve(data.get("model") or data.get("name"), caller(request.scope))
        m = config.models[model]
        details = _details(m)
        arch = details["family"] or "unknown"
        info: dict[str, Any] = {"general.architecture": arch}
        if m.metadata.get("parameters"):
            info["general.parameter_count"] = m.metadata["parameters"]
        context = _context(m)
        if context:
            info[f"{arch}.context_length"] = context
        return JSONResponse(
            {
                "modelfile": f"# served by Corral\nFROM {m.metadata.get('file', model)}\n",
                "parameters": "",
                "template": "",
                "details": details,
                "model_info": info,
                "capabilities": _capabilities(m),
                "modified_at": _modified(m),
            }
        )

    @router.post("/api/pull")
    async def pull(request: Request) -> Response:
        data = await read(request)
        name = data.get("model") or data.get("name")
        who = caller(request.scope)
        if door.lookup(name, who) is None:
            return ollama_error(
                404,
                f"{door.unknown(name, who)}. Corral serves the models already on "
                "disk and downloads nothing: run `ollama pull` (Corral reads Ollama's store) or "
                "put the GGUF file in a models folder (corral serve --models DIR)",
            )
        done = {"status": "success"}  # already here: what Ollama answers for a pulled model
        if data.get("stream", True) is False:
            return JSONResponse(done)
        return Response(json.dumps(done) + "\n", media_type="application/x-ndjson")

    async def store_command(request: Request) -> Response:
        verb = request.url.path.split("/")[2]
        return ollama_error(
            501,
            f"Corral does not {verb} models: it serves the models already on disk (a models "
            "folder, Ollama's store, or its config); use `ollama` itself to manage the store",
        )

    for route in _STORE_COMMANDS:
        router.add_api_route(route, store_command, methods=["POST", "HEAD"])
    router.add_api_route("/api/delete", store_command, methods=["DELETE"])

    return router


def _loaded(name: str, m: ModelConfig, s: dict[str, Any]) -> dict[str, Any]:
    """A loaded model as `/api/ps` lists it (`s`: its `/api/status` entry)."""
    entry = _entry(name, m)
    if s["unloads_in_s"] is not None:
        entry["expires_at"] = _iso(time.time() + s["unloads_in_s"])
    elif s["ttl_s"] is not None and s["idle_s"] is None:  # busy: from its next idle
        entry["expires_at"] = _iso(time.time() + s["ttl_s"])
    else:
        entry["expires_at"] = _FOREVER
    memory_gb = m.memory_gb or 0.0
    entry["size_vram"] = 0 if _cpu(s["device"]) else int(memory_gb * 1e9)
    entry["size"] = int(memory_gb * 1e9) or entry["size"]
    context = _context(m)
    if context:
        entry["context_length"] = context
    del entry["modified_at"]
    return entry


def _no_insert(name: str, response: Response) -> Response:
    """A fill-in-the-middle request its model's server cannot serve, as Ollama refuses one for
    a model without FIM: 400, `"<model>" does not support insert`, and the server's reason."""
    said = json.loads(bytes(response.body)).get("error", "")
    why = "its server has no /infill" if response.status_code == 404 else said
    return ollama_error(
        400,
        f"{json.dumps(name)} does not support insert (fill-in-the-middle with `suffix`): {why}",
    )


def _keep_alive(gateway: Gateway, model: str, seconds: float) -> None:
    sched = gateway.scheduler
    assert sched is not None
    sched.on_keep_alive(model, seconds)


def _listed(config: Config, gateway: Gateway, who: Principal) -> list[str]:
    """The models Ollama's lists show `who`."""
    return [n for n in gateway.backends if not config.models[n].unlisted and who.may_use(n)]


def _cpu(device: str | None) -> bool:
    """The device `corral serve --models` makes of the host's memory (machine.py)."""
    return device is not None and device.startswith("cpu")


def _context(m: ModelConfig) -> int:
    if m.capabilities is not None and m.capabilities.context:
        return m.capabilities.context
    value = m.metadata.get("context_length")
    return value if isinstance(value, int) else 0


def _modified(m: ModelConfig) -> str:
    file = m.metadata.get("file")
    try:
        return _iso(Path(file).stat().st_mtime) if isinstance(file, str) else _iso(0.0)
    except OSError:
        return _iso(0.0)


def _details(m: ModelConfig) -> dict[str, Any]:
    arch = str(m.metadata.get("architecture", ""))
    return {
        "parent_model": "",
        "format": "gguf" if m.metadata.get("file") else "",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": str(m.metadata.get("parameter_size", "")),
        "quantization_level": str(m.metadata.get("quantization", "")),
    }


def _capabilities(m: ModelConfig) -> list[str]:
    caps = m.capabilities
    if m.metadata.get("embedding"):
        return ["embedding"]
    out = ["completion"]
    if caps is not None and caps.tools:
        out.append("tools")
    if caps is not None and "image" in caps.inputs:
        out.append("vision")
    return out


def _tag(name: str, m: ModelConfig, state: str | None) -> dict[str, Any]:
    """A model as `/api/tags` lists it: Ollama's fields, and what agents ask of a listing
    without loading the model: its context, capabilities and state (Corral's
    fields; Ollama's clients ignore fields they do not know)."""
    entry = _entry(name, m)
    context = _context(m)
    if context:
        entry["context_length"] = context
    entry["capabilities"] = _capabilities(m)
    if state is not None:
        entry["state"] = state
    return entry


def _entry(name: str, m: ModelConfig) -> dict[str, Any]:
    size = m.metadata.get("size_bytes")
    file = m.metadata.get("file", "")
    # Ollama's clients cache what a model can do by its digest: it changes with capabilities.
    said = ",".join(_capabilities(m))
    digest = hashlib.sha256(f"{name}\0{file}\0{size}\0{said}".encode()).hexdigest()
    return {
        "name": tag_of(name),
        "model": tag_of(name),
        "modified_at": _modified(m),
        "size": size if isinstance(size, int) else int((m.memory_gb or 0.0) * 1e9),
        "digest": digest,
        "details": _details(m),
    }


def _iso(epoch_s: float) -> str:
    if not math.isfinite(epoch_s) or epoch_s >= _LAST_EPOCH_S:  # past what a date can say
        return _FOREVER
    return datetime.fromtimestamp(epoch_s, UTC).isoformat().replace("+00:00", "Z")
