"""Requests at a fixed concurrency (closed loop) or a Poisson rate (open loop), each one timed:
time to first token, the gaps between tokens, end to end. Streams are read as they arrive (chat
and completions ask for `stream: true` with usage), so the first token is the first content
chunk the client saw. Pure asyncio over one aiohttp session; nothing is sent before the clock
starts, and a point's rate counts the requests that ended inside it."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Endpoint = Literal["chat", "completions", "embeddings"]
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
    "dog", "while", "seven", "wizards", "quietly", "judge", "boxes",
]  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """What to send: `url` is the server's base (…/v1 is added), `models` are used in turn."""

    url: str
    endpoint: Endpoint
    models: list[str]
    requests: int
    prompt_words: int = 32
    max_tokens: int = 64
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass
class Sample:
    """One request as the client saw it (seconds from the point's start)."""

    model: str
    sent_s: float
    first_s: float | None = None  # first content token
    done_s: float | None = None
    tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    error: str | None = None

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


@dataclass
class Point:
    """The samples of one load level, and its wall time."""

    label: str  # "concurrency 4" or "rate 2.5/s"
    concurrency: int | None
    rate: float | None
    samples: list[Sample]
    elapsed_s: float

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.error is None and s.done_s is not None]
        e2e = [s.e2e_s for s in ok if s.e2e_s is not None]
        ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
        itl = [g for s in ok for g in s.gaps_s]
        tokens = sum(s.tokens for s in ok)
        row: dict[str, Any] = {
            "label": self.label,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": len(self.samples),
            "completed": len(ok),
            "errors": len(self.samples) - len(ok),
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(len(ok) / self.elapsed_s, 3) if self.elapsed_s else 0.0,
            "output_tokens_per_s": round(tokens / self.elapsed_s, 2) if self.elapsed_s else 0.0,
        }
        for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
            for q in (50, 95, 99):
                row[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
        return row


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


def body(spec: Spec, model: str, i: int) -> dict[str, Any]:
    words = " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(spec.prompt_words))
    if spec.endpoint == "embeddings":
        # As the official clients ask by default: base64 vectors, a quarter of float JSON's size.
        return {"model": model, "input": words, "encoding_format": "base64"}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if spec.endpoint == "chat":
        messages = [{"role": "user", "content": words}]
        return {"model": model, "messages": messages, "max_tokens": spec.max_tokens, **stream}
    return {"model": model, "prompt": words, "max_tokens": spec.max_tokens, **stream}


async def one(
    session: aiohttp.ClientSession, spec: Spec, model: str, i: int, began: float
) -> Sample:
    s = Sample(model, time.monotonic() - began)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    url = spec.url.rstrip("/") + PATHS[spec.endpoint]
    try:
        async with session.post(url, json=body(spec, model, i), headers=headers) as resp:
            if resp.status >= 400:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            if spec.endpoint == "embeddings":
                await resp.read()
                s.first_s = time.monotonic() - began
                s.tokens = 0
            else:
                await _read_stream(resp, s, began)
            s.done_s = time.monotonic() - began
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    return s


async def _read_stream(resp: aiohttp.ClientResponse, s: Sample, began: float) -> None:
    last: float | None = None
    chunks = usage = 0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            raise aiohttp.ClientPayloadError(str(event["error"])[:200])
        if event.get("usage"):
            usage = int(event["usage"].get("completion_tokens") or 0)
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            if text:
                now = time.monotonic() - began
                if last is None:
                    s.first_s = now
                else:
                    s.gaps_s.append(now - last)
                last = now
                chunks += 1
    s.tokens = usage or chunks


async def run_point(
    spec: Spec,
    concurrency: int | None = None,
    rate: float | None = None,
    progress: Callable[[], None] | None = None,
    seed: int = 0,
) -> Point:
    """`spec.requests` requests at `concurrency` in flight, or arriving at `rate` per second."""
    assert (concurrency is None) != (rate is None), "give a concurrency or a rate"
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    samples: list[Sample] = []
    counter = itertools.count()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        began = time.monotonic()

        async def send(i: int) -> None:
            sample = await one(session, spec, spec.models[i % len(spec.models)], i, began)
            samples.append(sample)
            if progress is not None:
                progress()

        if concurrency is not None:

            async def loop() -> None:
                while (i := next(counter)) < spec.requests:
                    await send(i)

            await asyncio.gather(*(loop() for _ in range(concurrency)))
        else:
            assert rate is not None
            rng = random.Random(seed)
            tasks = []
            for i in range(spec.requests):
                tasks.append(asyncio.ensure_future(send(i)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        elapsed = time.monotonic() - began
    label = f"concurrency {concurrency}" if concurrency is not None else f"rate {rate:g}/s"
    return Point(label, concurrency, rate, samples, elapsed)


def tune(points: list[Point], p95_ms: float, within: float = 0.05) -> Point | None:
    """The point with the most requests per second whose end-to-end p95 is within `p95_ms`
    and that had no errors; among points within `within` (5%) of that throughput, the one with
    the lowest p95 (more concurrency that buys no throughput only adds waiting)."""
    rows = [(p, p.summary()) for p in points]
    fits = [
        (p, r)
        for p, r in rows
        if r["errors"] == 0 and r["e2e_p95_ms"] is not None and r["e2e_p95_ms"] <= p95_ms
    ]
    if not fits:
        return None
    top = max(r["requests_per_s"] for _, r in fits)
    close = [(p, r) for p, r in fits if r["requests_per_s"] >= top * (1 - within)]
    return min(close, key=lambda x: x[1]["e2e_p95_ms"])[0]
