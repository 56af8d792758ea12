"""The recent requests, for the dashboard's activity view: model, route, status, how
long each waited and for how many swaps, its time to first byte, its tokens and tokens/s.
Kept in memory, bounded (`SIZE` entries); the gateway owns it, the proxy records into it.

Tokens are the server's own count (`usage.completion_tokens`) when its answer carries one, else,
for a stream, its pieces of text (`"content": "..."`, one a token for llama-server and vLLM),
else unknown.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

SIZE = 200  # entries kept; the dashboard shows the newest
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EMPTY = tuple(b'"content"' + sep + v for sep in (b":", b": ") for v in (b'""', b"null"))
TAIL_BYTES = 2048  # of a stream, kept to find its usage (the last events)
_CONTEXT = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')
_PREFILLED = re.compile(rb'"prompt_n"\s*:\s*(\d+)')  # llama-server's timings
_PREFILL_MS = re.compile(rb'"prompt_ms"\s*:\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)')


def pieces(chunk: bytes) -> int:
    """Pieces of text in a chunk of server-sent events: its `"content"` keys less the empty
    ones, counted by `bytes.count` (a stream's every chunk passes here: no regex)."""
    n = chunk.count(b'"content"')
    if n:
        for empty in _EMPTY:
            n -= chunk.count(empty)
    return n


def completion_tokens(data: bytes) -> int | None:
    """The last `completion_tokens` count in `data` (a JSON answer, or a stream's tail)."""
    found = _USAGE.findall(data)
    return int(found[-1]) if found else None


def prefill(data: bytes) -> tuple[int, int, float]:
    """From an answer (or a stream's tail): its prompt's tokens (`usage`), and the tokens the
    server processed for it and the seconds that took (llama-server's `timings`); 0 where the
    answer does not say."""
    context, done, ms = _CONTEXT.findall(data), _PREFILLED.findall(data), _PREFILL_MS.findall(data)
    took_s = float(ms[-1]) / 1000.0 if ms and done else 0.0
    return (
        int(context[-1]) if context else 0,
        int(done[-1]) if done else 0,
        took_s if math.isfinite(took_s) else 0.0,  # a server's odd figure is no figure
    )


@dataclass(frozen=True, slots=True)
class Served:
    at: float  # epoch seconds, when it arrived
    model: str
    route: str
    status: int
    device: str | None
    wait_s: float  # for its model's turn: queue and swaps
    swaps_waited: int  # loads begun while it waited
    first_byte_s: float | None  # arrival to the first byte of the answer
    duration_s: float  # arrival to the last byte
    tokens: int | None
    tokens_per_s: float | None  # after the first byte (a whole answer: after its dispatch)
    principal: str | None = None  # whose call it was (None: no keys)
    service_class: str = "interactive"  # batch: its principal may ask for batch work only


class Activity:
    def __init__(self, size: int = SIZE) -> None:
        self._recent: deque[Served] = deque(maxlen=size)

    def record(
        self,
        model: str,
        route: str,
        status: int,
        device: str | None,
        wait_s: float,
        swaps_waited: int,
        arrived: float,
        first_byte: float | None,
        tokens: int | None,
        principal: str | None = None,
        background: bool = False,
    ) -> None:
        """One request done; `arrived` and `first_byte` on the monotonic clock (`first_byte`
        None: a whole answer, whose tokens/s count from its dispatch)."""
        now = time.monotonic()
        gen_s = now - (first_byte if first_byte is not None else arrived + wait_s)
        self._recent.append(
            Served(
                at=round(time.time() - (now - arrived), 3),
                model=model,
                route=route,
                status=status,
                device=device,
                wait_s=round(wait_s, 4),
                swaps_waited=swaps_waited,
                first_byte_s=round(first_byte - arrived, 4) if first_byte is not None else None,
                duration_s=round(now - arrived, 4),
                tokens=tokens,
                tokens_per_s=round(tokens / gen_s, 1) if tokens and gen_s > 0.001 else None,
                principal=principal,
                service_class="batch" if background else "interactive",
            )
        )

    def recent(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest `limit` requests, newest first."""
        out: list[dict[str, Any]] = []
        for s in reversed(self._recent):
            if len(out) >= limit:
                break
            out.append(asdict(s))
        return out
