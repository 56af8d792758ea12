"""A server that is already running (Ollama, vLLM, a remote OpenAI-compatible one). Corral does not
start it, but it can still schedule its swaps: an optional load hook and unload hook are HTTP
calls made when the scheduler loads or evicts the model, for example Ollama's `keep_alive`.

One with a sleep API (`sleep:`, backends/sleep.py) sleeps instead: the scheduler puts it to
sleep at its level when it may come back soon (`nap`/`wake`), and at level 2 when it "stops",
since that frees its device and host memory alike; a start wakes it from whichever sleep it is
in (a server found asleep at start is woken as from level 2, which serves either)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx

from corral.backends.process import BackendError
from corral.backends.sleep import Napper


@dataclass(frozen=True)
class Hook:
    method: str
    path: str
    json: Any = None


class UpstreamBackend:
    def __init__(
        self,
        model: str,
        url: str,
        served_name: str | None = None,
        load: Hook | None = None,
        unload: Hook | None = None,
        check_endpoint: str | None = None,
        timeout_s: float = 120.0,
        api_key: str | None = None,
        napper: Napper | None = None,
    ) -> None:
        self.model = model
        # llama-swap sends a peer's key both ways: OpenAI's header and Anthropic's.
        self.headers = (
            {} if not api_key else {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}
        )
        self.proxy_url = url.rstrip("/")
        self.served_name = served_name or model
        self._load, self._unload = load, unload
        self._check = check_endpoint
        self._timeout_s = timeout_s
        self._up = False
        self._log: deque[str] = deque(maxlen=200)
        self.napper = napper
        self._slept: int | None = None  # the level it sleeps at, if Corral put it to sleep
        self._http: httpx.AsyncClient | None = None  # for the sleep API (a client per call costs)

    async def _client(self) -> httpx.AsyncClient:
        """The client for its hooks and sleeps, made once and off the loop (its TLS context
        reads the CA bundle: tens of milliseconds every stream would wait)."""
        if self._http is None:
            made = await asyncio.to_thread(httpx.AsyncClient)
            if self._http is None:  # another call made one meanwhile: keep that
                self._http = made
            else:
                await made.aclose()
        return self._http

    @property
    def running(self) -> bool:
        return self._up

    @property
    def pid(self) -> int | None:
        return None

    async def start(self) -> float:
        started = time.monotonic()
        if self.napper is not None:
            await self._wake_if_asleep()
        client = await self._client()
        if self._load is not None:
            await self._call(client, self._load, "load")
        if self._check is not None:
            await self._wait_healthy(client, started)
        self._up = True
        return time.monotonic() - started

    async def stop(self) -> float:
        started = time.monotonic()
        self._up = False
        if self._unload is not None:
            await self._call(await self._client(), self._unload, "unload")
        if self.napper is not None and self._slept != 2:
            if self._slept == 1:  # vLLM sleeps once: wake (fast, from host memory) to sleep deeper
                await self.napper.wake(
                    self.proxy_url, self.headers, 1, warm=False, client=await self._client()
                )
                self._slept = None
            await self.nap(2)  # the deepest sleep is as close to a stop as an upstream gets
        return time.monotonic() - started

    async def nap(self, level: int | None = None) -> float:
        """Put the server to sleep (its configured level unless told); returns the seconds."""
        assert self.napper is not None
        depth = self.napper.level if level is None else level
        self._up = False
        try:
            took = await self.napper.sleep(
                self.proxy_url, self.headers, depth, await self._client()
            )
        except BackendError as exc:
            self._note(str(exc))
            raise
        self._slept = depth
        self._note(f"asleep at level {depth} in {took:.2f} s")
        return took

    async def wake(self) -> float:
        """Wake it from the sleep `nap` put it in; returns the seconds it took."""
        started = time.monotonic()
        await self._wake_if_asleep()
        self._up = True
        return time.monotonic() - started

    async def _wake_if_asleep(self) -> None:
        napper = self.napper
        assert napper is not None
        level = self._slept
        http = await self._client()
        if level is None and await napper.is_sleeping(self.proxy_url, self.headers, http):
            level = 2  # asleep before this run: the wake that serves either level
        if level is None:
            return
        try:
            took = await napper.wake(self.proxy_url, self.headers, level, client=http)
        except BackendError as exc:
            self._note(str(exc))
            raise
        self._slept = None
        self._note(f"awake from level {level} in {took:.2f} s")

    async def _call(self, client: httpx.AsyncClient, hook: Hook, what: str) -> None:
        url = self.proxy_url + hook.path
        try:
            r = await client.request(hook.method, url, json=hook.json, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            self._note(f"{what} hook {hook.method} {url}: {type(exc).__name__}: {exc}")
            raise BackendError(
                f"model {self.model}: {what} hook {hook.method} {hook.path} failed "
                f"({type(exc).__name__})",
                self.log_tail(),
            ) from None
        self._note(f"{what} hook {hook.method} {url}: {r.status_code} {r.text[:200]}")
        if r.status_code >= 400:
            raise BackendError(
                f"model {self.model}: {what} hook {hook.method} {hook.path} answered "
                f"{r.status_code}",
                self.log_tail(),
            )

    async def _wait_healthy(self, client: httpx.AsyncClient, started: float) -> None:
        url = self.proxy_url + (self._check or "")
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url, timeout=self._timeout_s)).status_code == 200:
                    return
            if time.monotonic() - started >= self._timeout_s:
                raise BackendError(
                    f"model {self.model}: {url} not healthy within {self._timeout_s:g} s"
                )
            await asyncio.sleep(0.05)

    def _note(self, line: str) -> None:
        self._log.append(f"{time.strftime('%H:%M:%S')} {line}")

    async def exited(self, timeout_s: float) -> bool:
        return False  # not ours to watch: a failed request is only a failed request

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._log)[-lines:])
