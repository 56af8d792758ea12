"""What the gateway needs from a model's server, whichever kind it is."""

from __future__ import annotations

from typing import Protocol


class Backend(Protocol):
    """A model's server: made ready by `start`, released by `stop`; requests go to
    `proxy_url` with the body's `model` set to `served_name`."""

    proxy_url: str
    served_name: str
    headers: dict[str, str]  # added to every proxied request (an upstream's API key)

    @property
    def running(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> float:
        """Make it ready; returns the seconds it took. Raises `BackendError`."""
        ...

    async def stop(self) -> float:
        """Release the device; returns the seconds it took."""
        ...

    async def exited(self, timeout_s: float) -> bool:
        """After a failed request: True if the server died, waiting up to `timeout_s` for its
        exit to be reported (so the crash is handled before the caller answers)."""
        ...

    def log_tail(self, lines: int = 20) -> str: ...
