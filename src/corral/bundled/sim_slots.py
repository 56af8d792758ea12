"""llama-server's prompt cache and slot API, simulated, for `corral replay` and tests:
each slot holds the words of the last prompt it processed; a request processes the words its
slot does not hold (the longest common beginning is reused) at `prefill_tok_s`, a word a token,
before its answer. `GET /slots` lists them; with a save folder, `POST /slots/{id}?action=save`
writes a slot's words to a file there and `restore` reads them back, each at `state_tok_s`,
as llama-server's `--slot-save-path` does (a name with a path in it is refused)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral.prompt_cache.keys import shared

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}")


class SimSlots:
    """`n` slots; `save_dir` None: no save or restore."""

    def __init__(
        self, n: int, prefill_tok_s: float, state_tok_s: float, save_dir: Path | None
    ) -> None:
        self.held: list[list[str]] = [[] for _ in range(n)]
        self.busy = [False] * n
        self.used_at = [0.0] * n
        self.task = [-1] * n
        self._tasks = 0
        self.prefill_tok_s = prefill_tok_s
        self.state_tok_s = state_tok_s
        self.save_dir = save_dir

    def take(self, words: list[str], asked: Any) -> tuple[int, int]:
        """A slot for a prompt of `words` (`asked`: the body's `id_slot`, if any): the one
        asked for, else the free one holding the longest beginning of it, else the least
        recently used; and how many of its words that slot holds. Marks it busy."""
        free = [i for i, b in enumerate(self.busy) if not b] or list(range(len(self.busy)))
        if isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked < len(self.busy):
            slot = asked
        else:
            slot = max(free, key=lambda i: (shared(self.held[i], words), -self.used_at[i]))
            if not shared(self.held[slot], words):
                slot = min(free, key=lambda i: self.used_at[i])
        self.busy[slot] = True
        self._tasks += 1
        self.task[slot] = self._tasks
        return slot, shared(self.held[slot], words)

    def done(self, slot: int, words: list[str]) -> None:
        self.held[slot] = words
        self.busy[slot] = False
        self.used_at[slot] = time.monotonic()

    def timings(self, words: int, cached: int) -> dict[str, Any]:
        """llama-server's `timings` of a prompt of `words` with `cached` of them held."""
        n = words - cached
        return {"cache_n": cached, "prompt_n": n, "prompt_ms": 1000 * n / self.prefill_tok_s}

    async def listing(self, _: Request) -> Response:
        return JSONResponse(
            [
                {
                    "id": i,
                    "n_ctx": 1 << 20,
                    "is_processing": self.busy[i],
                    **({"id_task": self.task[i]} if self.task[i] >= 0 else {}),
                    **({"n_prompt_tokens": len(w)} if w else {}),
                }
                for i, w in enumerate(self.held)
            ]
        )

    async def action(self, request: Request) -> Response:
        try:
            slot = int(request.path_params["slot"])
            if not 0 <= slot < len(self.held):
                raise ValueError
        except ValueError:
            return _refuse("Invalid slot ID")
        what = request.query_params.get("action")
        if what == "erase":
            n, self.held[slot] = len(self.held[slot]), []
            return JSONResponse({"id_slot": slot, "n_erased": n})
        if self.save_dir is None:
            return _refuse("This server does not support slots action (no --slot-save-path)")
        try:
            body = await request.json()
        except ValueError:
            return _refuse("the body is not JSON")
        name = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            return _refuse("Invalid filename")
        path = self.save_dir / name
        if what == "save":
            words = self.held[slot]
            data = json.dumps(words).encode()
            await asyncio.sleep(len(words) / self.state_tok_s)
            try:
                path.write_bytes(data)
            except OSError as exc:
                return _refuse(f"Unable to save slot: {exc}")
            ms = 1000 * len(words) / self.state_tok_s
            return JSONResponse(
                {"id_slot": slot, "filename": name, "n_saved": len(words),
                 "n_written": len(data), "timings": {"save_ms": ms}}
            )  # fmt: skip
        if what == "restore":
            try:
                data = path.read_bytes()
                words = json.loads(data)
                assert isinstance(words, list)
            except (OSError, ValueError, AssertionError):
                self.held[slot] = []
                return _refuse("Unable to restore slot: invalid slot save file")
            await asyncio.sleep(len(words) / self.state_tok_s)
            self.held[slot] = [str(w) for w in words]
            ms = 1000 * len(words) / self.state_tok_s
            return JSONResponse(
                {"id_slot": slot, "filename": name, "n_restored": len(words),
                 "n_read": len(data), "timings": {"restore_ms": ms}}
            )  # fmt: skip
        return _refuse("Invalid action")

    def routes(self) -> list[Route]:
        return [
            Route("/slots", self.listing),
            Route("/slots/{slot}", self.action, methods=["POST"]),
        ]


def _refuse(message: str) -> Response:
    return JSONResponse(
        {"error": {"code": 400, "message": message, "type": "invalid_request_error"}},
        status_code=400,
    )
