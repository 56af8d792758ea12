"""Putting a model's server to sleep and waking it (`Napper`): vLLM's sleep mode and SGLang's
memory release, for started servers and upstreams alike (docs/design/sleep.md).

- vLLM (`--enable-sleep-mode`; its sleep endpoints need `VLLM_SERVER_DEV_MODE=1`, which Corral
  sets for the servers it starts): `POST /sleep?level=1|2`. A level-1 sleeper wakes with `POST
  /wake_up`. A level-2 sleeper discarded its weights: `POST /wake_up?tags=weights`, `POST
  /collective_rpc {"method": "reload_weights"}`, `POST /wake_up?tags=kv_cache`, then `POST
  /reset_prefix_cache`, as vLLM's documentation prescribes.
- SGLang: `POST /release_memory_occupation` and `POST /resume_memory_occupation`.

After a wake, a one-token completion warms the engine up: vLLM's own measurements show the first
answer after a wake is 5.8-7.1x slower without one, and the scheduler should count that in the
wake, not in a person's first answer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from corral.backends.process import BackendError

SleepKind = Literal["vllm", "sglang"]

_HINTS = {
    "vllm": "start vLLM with --enable-sleep-mode (and VLLM_SERVER_DEV_MODE=1 in its environment)",
    "sglang": "start SGLang with --enable-memory-saver",
}


@dataclass(frozen=True)
class Napper:
    """How to put one model's server to sleep and wake it. `level` is the configured depth;
    each call may say another (an upstream "stopped" sleeps at level 2)."""

    model: str
    kind: SleepKind = "vllm"
    level: int = 1
    served_name: str = ""
    warmup: bool = True
    timeout_s: float = 120.0

    async def sleep(
        self,
        url: str,
        headers: dict[str, str],
        level: int | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> float:
        """The server frees its device (and, at level 2, its weights); returns the seconds it
        took. Raises `BackendError` naming the call and the fix. `client`: a shared one (a new
        client costs milliseconds: its TLS context), else one for this call."""
        started = time.monotonic()
        depth = self.level if level is None else level
        async with self._session(url, headers, client) as c:
            if self.kind == "vllm":
                await self._call(c, "POST", f"/sleep?level={depth}")
            else:
                await self._call(c, "POST", "/release_memory_occupation", {})
        return time.monotonic() - started

    async def wake(
        self,
        url: str,
        headers: dict[str, str],
        level: int | None = None,
        warm: bool = True,
        client: httpx.AsyncClient | None = None,
    ) -> float:
        """The server that slept at `level` (default: the configured one) serves again, warmed
        up (unless not `warm`); returns the seconds it took."""
        started = time.monotonic()
        depth = self.level if level is None else level
        async with self._session(url, headers, client) as c:
            if self.kind == "sglang":
                await self._call(c, "POST", "/resume_memory_occupation", {})
            elif depth == 1:
                await self._call(c, "POST", "/wake_up")
            else:
                await self._call(c, "POST", "/wake_up?tags=weights")
                await self._call(c, "POST", "/collective_rpc", {"method": "reload_weights"})
                await self._call(c, "POST", "/wake_up?tags=kv_cache")
                await self._call(c, "POST", "/reset_prefix_cache")
            if self.warmup and warm:
                body = {"model": self.served_name or self.model, "prompt": "hi", "max_tokens": 1}
                await self._call(c, "POST", "/v1/completions", body)
        return time.monotonic() - started

    async def is_sleeping(
        self, url: str, headers: dict[str, str], client: httpx.AsyncClient | None = None
    ) -> bool:
        """Whether a vLLM server sleeps now (SGLang cannot say: False)."""
        if self.kind != "vllm":
            return False
        async with self._session(url, headers, client) as c:
            r = await self._call(c, "GET", "/is_sleeping")
        try:
            return bool(r.json().get("is_sleeping"))
        except (ValueError, AttributeError):
            return False

    @contextlib.asynccontextmanager
    async def _session(
        self, url: str, headers: dict[str, str], client: httpx.AsyncClient | None
    ) -> AsyncIterator[_Session]:
        if client is not None:
            yield _Session(client, url, headers)
            return
        async with httpx.AsyncClient(timeout=self.timeout_s) as own:
            yield _Session(own, url, headers)

    async def _call(self, c: _Session, method: str, path: str, body: Any = None) -> httpx.Response:
        what = f"model {self.model}: {method} {path}"
        try:
            r = await c.client.request(
                method, c.url + path, json=body, headers=c.headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise BackendError(f"{what} failed ({type(exc).__name__}: {exc})") from None
        if r.status_code >= 400:
            hint = f"; {_HINTS[self.kind]}" if r.status_code in (404, 405) else ""
            raise BackendError(f"{what} answered {r.status_code}: {r.text[:200]}{hint}")
        return r


@dataclass(frozen=True)
class _Session:
    client: httpx.AsyncClient
    url: str
    headers: dict[str, str]
