"""The sim server's sleep mode (`SimSleep`, a part `sim_server.SimServer` owns): the endpoints of
vLLM's sleep API and of SGLang's memory release, with configurable times, and where the weights
are. It follows the engines' rules closely enough that a client doing the wrong thing fails:

- vLLM: `POST /sleep?level=1|2`; `POST /wake_up` (optionally `?tags=weights` or
  `?tags=kv_cache`); `POST /collective_rpc` with `{"method": "reload_weights"}`; `GET
  /is_sleeping`; `POST /reset_prefix_cache`. A level-2 sleeper discarded its weights: woken
  without `reload_weights` it answers with an error, as vLLM would answer with garbage.
- SGLang: `POST /release_memory_occupation` and `POST /resume_memory_occupation`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status)


@dataclass
class SimSleep:
    """The sleep state. `sleep_s`: the time to fall asleep; `wake_s` and `wake2_s`: a wake from
    level 1 and the weights' reload after level 2 (None: `load_s`)."""

    load_s: float
    sleep_s: float = 0.0
    wake_s: float | None = None
    wake2_s: float | None = None
    memory_gb: float = 0.0
    level: int = 0  # 0 awake, 1 weights in host memory, 2 weights discarded
    weights: bool = True  # on the device and valid
    kv_cache: bool = True
    woke_at: float | None = None  # epoch seconds of the last wake
    counts: dict[str, int] = field(
        default_factory=lambda: {"sleep": 0, "wake_up": 0, "reload_weights": 0}
    )

    @property
    def asleep(self) -> bool:
        return not (self.weights and self.kv_cache)

    def refusal(self) -> str | None:
        """Why a request cannot be served now (None: it can)."""
        if self.asleep:
            return "the model is sleeping; POST /wake_up first"
        if self.level == 2:
            return (
                "the weights were discarded by a level-2 sleep and not reloaded (POST "
                '/collective_rpc {"method": "reload_weights"} after waking the weights)'
            )
        return None

    def memory(self) -> dict[str, float]:
        """Where the weights are: on the device awake, in host memory asleep at level 1."""
        gb = self.memory_gb
        return {
            "device_memory_gb": 0.0 if self.asleep else gb,
            "host_memory_gb": gb if self.level == 1 and self.asleep else 0.0,
        }

    def status(self) -> dict[str, Any]:
        return {"level": self.level, **self.counts, **self.memory()}

    async def _fall_asleep(self, level: int) -> None:
        if not self.asleep:
            await asyncio.sleep(self.sleep_s)
            self.weights = self.kv_cache = False
            self.level = level
            self.counts["sleep"] += 1

    async def _wake(self, tags: set[str]) -> None:
        if not self.asleep:
            return
        if "weights" in tags and not self.weights:
            if self.level == 1:  # copied back from host memory
                await asyncio.sleep(self.load_s if self.wake_s is None else self.wake_s)
            self.weights = True
        if "kv_cache" in tags:
            self.kv_cache = True
        if not self.asleep:
            self.counts["wake_up"] += 1
            if self.level == 1:
                self.level = 0
            self.woke_at = time.time()

    # --- vLLM ---------------------------------------------------------------------------------
    async def sleep(self, request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            return _error(400, f"level must be 1 or 2; got {raw!r}")
        await self._fall_asleep(int(raw))
        return JSONResponse({"status": "sleeping", "level": self.level})

    async def wake_up(self, request: Request) -> Response:
        tags = set(request.query_params.getlist("tags")) or {"weights", "kv_cache"}
        unknown = tags - {"weights", "kv_cache"}
        if unknown:
            return _error(400, f"unknown tags {sorted(unknown)}; use weights or kv_cache")
        await self._wake(tags)
        return JSONResponse({"status": "ok"})

    async def collective_rpc(self, request: Request) -> Response:
        body = await request.json()
        method = body.get("method") if isinstance(body, dict) else None
        if method != "reload_weights":
            return _error(400, f"this server runs only reload_weights; got {method!r}")
        if not self.weights:
            return _error(400, "wake the weights first (POST /wake_up?tags=weights)")
        await asyncio.sleep(self.load_s if self.wake2_s is None else self.wake2_s)
        self.counts["reload_weights"] += 1
        if self.level == 2:
            self.level = 0
        return JSONResponse({"results": [None]})

    async def is_sleeping(self, _: Request) -> Response:
        return JSONResponse({"is_sleeping": self.asleep})

    async def reset_prefix_cache(self, _: Request) -> Response:
        self.counts["reset_prefix_cache"] = self.counts.get("reset_prefix_cache", 0) + 1
        return Response(status_code=200)

    # --- SGLang -------------------------------------------------------------------------------
    async def release(self, _: Request) -> Response:
        await self._fall_asleep(1)
        return JSONResponse({"success": True, "message": "released"})

    async def resume(self, _: Request) -> Response:
        await self._wake({"weights", "kv_cache"})
        return JSONResponse({"success": True, "message": "resumed"})

    def routes(self) -> list[Route]:
        return [
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/release_memory_occupation", self.release, methods=["POST"]),
            Route("/resume_memory_occupation", self.resume, methods=["POST"]),
        ]
