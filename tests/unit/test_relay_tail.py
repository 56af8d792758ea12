"""The relay's per-chunk work, kept to what a bare proxy does: text pieces counted with
`bytes.count` (as the regex it replaced counted them), and the answer's tail and end read once
at its end, whatever sizes the server's chunks come in."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.gateway.pipeline.upstream import relay
from corral.gateway.servers.activity import TAIL_BYTES, completion_tokens, pieces

pytestmark = pytest.mark.unit

_PIECE = re.compile(rb'"content"\s*:\s*"[^"]')  # the rule `pieces` keeps
DELTAS = [
    b'{"role":"assistant","content":""}',
    b'{"content":"Hel"}',
    b'{"content": "lo"}',
    b'{"content":null,"tool_calls":[{"index":0}]}',
    b'{"content": null}',
    b'{"content": ""}',
    b'{"reasoning_content":"hm"}',
]


def event(delta: bytes) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":' + delta + b"}]}\n\n"


@given(st.lists(st.sampled_from(DELTAS), max_size=30))
def test_pieces_counts_what_the_regex_counted(deltas: list[bytes]) -> None:
    chunk = b"".join(event(d) for d in deltas)
    assert pieces(chunk) == len(_PIECE.findall(chunk))


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c


class _Response:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)
        self.released = self.closed = False

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


def _answer(n: int) -> bytes:
    usage = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % n
    return b"".join(event(b'{"content":"t%d"}' % i) for i in range(n)) + usage + b"data: [DONE]\n\n"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.lists(st.integers(1, 400), min_size=1, max_size=40))
def test_the_relayed_tail_holds_the_usage_and_the_end_however_the_chunks_are_cut(
    n: int, cuts: list[int]
) -> None:
    whole = _answer(n)
    chunks, at = [], 0
    for c in cuts * (len(whole) // sum(cuts) + 1):
        if at >= len(whole):
            break
        chunks.append(whole[at : at + c])
        at += c
    ends: list[tuple[bool, bytes]] = []

    async def cut_short(exc: BaseException) -> str:
        raise AssertionError(exc)

    async def run() -> bytes:
        out = b""
        resp = _Response(chunks)
        async for part in relay(resp, True, cut_short, None, lambda w, t: ends.append((w, t))):  # type: ignore[arg-type]
            assert part.endswith(b"\n")  # cut at line ends
            out += part
        assert resp.released
        return out

    assert asyncio.run(run()) == whole
    assert len(ends) == 1
    answered, tail = ends[0]
    assert answered
    assert tail == whole[-TAIL_BYTES:]
    assert completion_tokens(tail) == n


def test_a_client_that_leaves_before_the_end_mark_is_not_answered() -> None:
    whole = _answer(5)
    chunks = [whole[:40], whole[40:200], whole[200:]]
    ends: list[tuple[bool, bytes]] = []

    async def cut_short(exc: BaseException) -> str:
        raise AssertionError(exc)

    async def run() -> None:
        it = cast(
            AsyncGenerator[bytes, None],
            relay(_Response(chunks), True, cut_short, None, lambda w, t: ends.append((w, t))),  # type: ignore[arg-type]
        )
        await it.__anext__()
        await it.aclose()  # the client left after the first lines

    asyncio.run(run())
    assert ends[0][0] is False
    assert b"[DONE]" not in ends[0][1]
