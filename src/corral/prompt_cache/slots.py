"""llama-server's slot API, for a server started with `--slot-save-path DIR`: list the slots,
save one's prompt cache to a file of DIR, restore it into a slot, erase a slot.

Every answer is checked before it is used (a server of another version may say less); a
refusal or an answer that is not what it should be raises `SlotError` naming the call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class SlotError(Exception):
    """A slot call failed: the server refused it, did not answer, or answered oddly."""


@dataclass(frozen=True)
class Slot:
    """A slot of the server: its id, context size, tokens its cache holds (None: the server
    does not say), and whether it is serving a request now."""

    id: int
    n_ctx: int
    tokens: int | None
    busy: bool
    task: int | None = None  # the id of the last task it ran (the server counts them up)


@dataclass(frozen=True)
class Moved:
    """A save or restore: the tokens and bytes it moved, and the server's own time for it."""

    tokens: int
    bytes: int
    ms: float


class Slots:
    """The slot API of the llama-server at `base_url` (no trailing slash)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, timeout_s: float = 120.0) -> None:
        self.base_url = base_url
        self._client = client
        self._timeout_s = timeout_s

    async def list(self) -> list[Slot]:
        data = await self._call("GET", "/slots", None)
        if not isinstance(data, list):
            raise SlotError("GET /slots: not a list of slots")
        out = []
        for s in data:
            if not isinstance(s, dict) or not isinstance(s.get("id"), int):
                raise SlotError("GET /slots: a slot without an id")
            tokens, task = s.get("n_prompt_tokens"), s.get("id_task")
            out.append(
                Slot(
                    id=s["id"],
                    n_ctx=_int(s.get("n_ctx"), "GET /slots", "n_ctx"),
                    tokens=tokens if _count(tokens) else None,
                    busy=s.get("is_processing") is True,
                    task=task if _count(task) else None,
                )
            )
        return out

    async def save(self, slot: int, filename: str) -> Moved:
        data = await self._call("POST", f"/slots/{slot}?action=save", {"filename": filename})
        return _moved(data, "save", "n_saved", "n_written", "save_ms")

    async def restore(self, slot: int, filename: str) -> Moved:
        data = await self._call("POST", f"/slots/{slot}?action=restore", {"filename": filename})
        return _moved(data, "restore", "n_restored", "n_read", "restore_ms")

    async def erase(self, slot: int) -> int:
        data = await self._call("POST", f"/slots/{slot}?action=erase", {})
        what = f"POST /slots/{slot}?action=erase"
        return _int(data.get("n_erased") if isinstance(data, dict) else None, what, "n_erased")

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        what = f"{method} {path.split('?')[0]}"
        try:
            r = await self._client.request(
                method, f"{self.base_url}{path}", json=body, timeout=self._timeout_s
            )
        except httpx.HTTPError as exc:
            raise SlotError(f"{what}: {type(exc).__name__}: {exc}") from None
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code >= 400:
            err = data.get("error") if isinstance(data, dict) else None
            said = err.get("message") if isinstance(err, dict) else r.text[:300]
            raise SlotError(f"{what}: {r.status_code}: {said}")
        if data is None:
            raise SlotError(f"{what}: the answer is not JSON")
        return data


def _moved(data: Any, action: str, n_key: str, bytes_key: str, ms_key: str) -> Moved:
    what = f"slot {action}"
    if not isinstance(data, dict):
        raise SlotError(f"{what}: the answer is not an object")
    timings = data.get("timings")
    ms = timings.get(ms_key) if isinstance(timings, dict) else None
    return Moved(
        tokens=_int(data.get(n_key), what, n_key),
        bytes=_int(data.get(bytes_key), what, bytes_key),
        ms=float(ms) if isinstance(ms, int | float) else 0.0,
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(value: Any, what: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SlotError(f"{what}: `{key}` is {str(value)[:40]}, not a count")
    return value
