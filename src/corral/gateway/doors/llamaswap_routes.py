"""llama-swap's own management routes, with its answers' shapes (internal/server/api.go and
apigroup.go), so its tools and scripts keep working against `corral serve`:

- `GET /running`: `{"running": [{"model", "state", "cmd", "proxy", "ttl", "name",
  "description"}]}` for every model not unloaded, sorted by model;
- `GET /unload` and `POST /api/models/unload`: unload every idle model (`OK`, `{"msg": "ok"}`);
- `POST /api/models/unload/{model}`: unload one (`OK`; 404 for an unknown model);
- `GET /logs`: the tail of every model server's log, each line prefixed with its model;
- `GET /logs/stream`: the same, then every new line as it is written (plain text, chunked);
- `GET /api/version`: `{"version", "commit", "build_date"}`.

Unlike llama-swap, a model with queued or running requests is not stopped under them: the unload
routes skip it (and say so in the log), as Corral's own unload API does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from corral import __version__
from corral.backends.logs import Follower
from corral.config import Config
from corral.gateway.doors.ollama_shapes import OLLAMA_API_VERSION
from corral.gateway.pipeline.calls import unknown_model
from corral.gateway.servers.runtime import Gateway
from corral.modelfiles.folder import shown

log = logging.getLogger("corral.gateway")


def llamaswap_routes(config: Config, gateway: Gateway) -> APIRouter:
    """llama-swap's own routes: what runs, unloading, the servers' logs, its version."""
    router = APIRouter(include_in_schema=False)

    def unload(models: list[str]) -> None:
        sched = gateway.scheduler
        assert sched is not None
        for model in models:
            reason = sched.on_unload_requested(model)
            if reason is not None:
                log.info("unload %s skipped: %s", model, reason)

    @router.get("/running")
    async def running() -> Response:
        sched = gateway.scheduler
        assert sched is not None
        out = []
        for name in sorted(gateway.backends):
            state = sched.models[name].state.value
            if state == "unloaded":
                continue
            m = config.models[name]
            out.append(
                {
                    "model": name,
                    "state": state,
                    "cmd": shown(gateway.redact(m.cmd or "")),  # a path's bytes: text
                    "proxy": gateway.backends[name].proxy_url,
                    "ttl": int(m.ttl_s or 0),
                    "name": "",
                    "description": "",
                }
            )
        return JSONResponse({"running": out})

    @router.get("/unload")
    async def unload_all() -> Response:
        unload(list(gateway.backends))
        return PlainTextResponse("OK")

    @router.post("/api/models/unload")
    async def api_unload_all() -> Response:
        unload(list(gateway.backends))
        return JSONResponse({"msg": "ok"})

    @router.post("/api/models/unload/{model:path}")
    async def api_unload(model: str) -> Response:
        resolved = config.resolve(model)
        if resolved is None or resolved not in gateway.backends:
            raise unknown_model(model, config)
        unload([resolved])
        return PlainTextResponse("OK")

    _logs(router, gateway)

    @router.api_route("/api/version", methods=["GET", "HEAD"])  # Ollama's clients ask too
    async def version() -> Response:
        """Ollama's clients compare `version` with the least one they need (0.1.0, Corral's
        own, was refused): it is the Ollama release whose API Corral's door speaks;
        llama-swap's `commit` names Corral's own version."""
        return JSONResponse(
            {"version": OLLAMA_API_VERSION, "commit": f"corral {__version__}", "build_date": ""}
        )

    return router


def _logs(router: APIRouter, gateway: Gateway) -> None:
    """llama-swap's `/logs` (the servers' last lines) and `/logs/stream` (and what follows).
    The files are read on threads: a log never holds the serving loop."""

    def last_lines(n: int) -> list[str]:
        lines = []
        for name, backend in sorted(gateway.backends.items()):
            lines += [f"[{name}] {line}" for line in backend.log_tail(n).splitlines()]
        return lines

    @router.get("/logs")
    async def logs() -> Response:
        lines = await asyncio.to_thread(last_lines, 200)
        return PlainTextResponse(gateway.redact("\n".join(lines) + ("\n" if lines else "")))

    @router.get("/logs/stream")
    async def logs_stream() -> Response:
        files = {
            name: Follower(path)
            for name, b in gateway.backends.items()
            if (path := getattr(b, "log_path", None)) is not None
        }

        def begin() -> list[str]:
            # Followed from here before the answer begins, and the history read after: a line
            # written as the stream starts may come twice, never be missed.
            for f in files.values():
                f.skip()
            return last_lines(50)

        history = await asyncio.to_thread(begin)

        async def lines() -> AsyncIterator[bytes]:
            for line in history:
                yield gateway.redact(line + "\n").encode()
            while True:
                await asyncio.sleep(0.25)
                read = await asyncio.to_thread(lambda: {n: f.read() for n, f in files.items()})
                for name, new in read.items():
                    for text in new:
                        yield gateway.redact(f"[{name}] {text}\n").encode()

        return StreamingResponse(lines(), media_type="text/plain; charset=utf-8")
