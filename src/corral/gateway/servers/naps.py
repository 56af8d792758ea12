"""The gateway's sleeping servers (`Naps`, a part the `Gateway` owns): which server sleeps on
which device, how each model sleeps and wakes (backends/sleep.py), and the two operations a swap
runs on them. Failures degrade to what the gateway did before sleep existed, never to a lost
request: a server that cannot sleep is stopped, and one that cannot wake (it died asleep, or its
sleep API refused) is started afresh. docs/design/sleep.md."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import httpx
import psutil

from corral.backends.base import Backend
from corral.backends.process import BackendError
from corral.backends.sleep import Napper
from corral.backends.upstream import UpstreamBackend
from corral.config import ModelConfig
from corral.gateway.servers.fleet import napper

log = logging.getLogger("corral.gateway")

# Host memory left to everything but sleeping models when `host.memory_gb` is unset.
HOST_MARGIN_FRACTION = 0.1
HOST_MARGIN_MIN_GB = 4.0


def host_memory_gb() -> float:
    """What sleeping models may hold on this machine by default: its memory less a margin (a
    tenth, at least 4 GB) for the gateway, the servers' own processes and everything else."""
    total_gb = psutil.virtual_memory().total / 1e9
    return max(0.0, total_gb - max(HOST_MARGIN_MIN_GB, total_gb * HOST_MARGIN_FRACTION))


class Naps:
    """Owns the sleeping servers, keyed by (model, device)."""

    def __init__(self) -> None:
        self._nappers: dict[str, Napper] = {}
        # (model, device) -> its server, and the level it sleeps at (None: its configured one)
        self._asleep: dict[tuple[str, str], tuple[Backend, int | None]] = {}
        self._http: httpx.AsyncClient | None = None  # one client for every sleep API call

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def configure(self, name: str, m: ModelConfig) -> None:
        """`name`'s sleep settings from now on (a server asleep keeps sleeping)."""
        n = napper(name, m)
        if n is None:
            self._nappers.pop(name, None)
        else:
            self._nappers[name] = n

    def fall_asleep(
        self,
        names: Sequence[str],
        device: str,
        servers: Sequence[Backend | None],
        deep: Sequence[str] = (),
    ) -> list[tuple[str, Backend, int | None]]:
        """`names` go to sleep on `device` (their servers, by the same index; those in `deep`
        at level 2): recorded now, put to sleep by `nap` in the swap. Returns (name, server,
        level) for those with a server."""
        out = [
            (n, b, 2 if n in deep else None)
            for n, b in zip(names, servers, strict=True)
            if b is not None
        ]
        for n, b, level in out:
            self._asleep[n, device] = (b, level)
        return out

    def waking(self, model: str, device: str) -> tuple[Backend | None, int | None]:
        """The server of `model` asleep on `device` and the level it sleeps at, taken out to
        be woken or stopped (no server: the wake starts one afresh)."""
        return self._asleep.pop((model, device), (None, None))

    def servers(self) -> Iterator[Backend]:
        return iter([b for b, _ in self._asleep.values()])

    def sleeping(self) -> list[tuple[str, str]]:
        """(model, device) of each sleeping server."""
        return list(self._asleep)

    async def nap(self, name: str, server: Backend, level: int | None = None) -> float:
        """Put `name`'s server to sleep (at `level`, default its own); a server that cannot is
        stopped instead (its wake then starts it afresh). Returns the seconds it took."""
        n = self._nappers.get(name)
        try:
            if n is None:
                raise BackendError(f"model {name}: its sleep settings were removed")
            if isinstance(server, UpstreamBackend):
                return await server.nap(level)
            return await n.sleep(server.proxy_url, server.headers, level, self._client())
        except BackendError as exc:
            log.warning("%s; stopping its server instead (it starts afresh next time)", exc)
            with contextlib.suppress(BackendError):
                return await server.stop()
        return 0.0

    async def bring_in(
        self, model: str, server: Backend, wake: bool, level: int | None = None
    ) -> tuple[float, bool]:
        """Make `model`'s server ready: woken (from `level`, default its own) if `wake` and it
        still sleeps, else started. Returns (seconds, whether it woke)."""
        n = self._nappers.get(model)
        if wake and n is not None:
            try:
                if isinstance(server, UpstreamBackend):
                    return await server.wake(), True
                if server.running:
                    took = await n.wake(
                        server.proxy_url, server.headers, level, client=self._client()
                    )
                    return took, True
                log.warning("model %s: its server died asleep; starting it afresh", model)
            except BackendError as exc:
                log.warning("%s; starting its server afresh", exc)
                with contextlib.suppress(BackendError):
                    await server.stop()
        return await server.start(), False
