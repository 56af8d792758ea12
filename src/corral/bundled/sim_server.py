"""The simulated backend: a real OpenAI-compatible HTTP server that emulates a model server's load
time and token speed, for demos, tests and benchmarks (`corral sim-backend`).

Like llama-server, it answers `/health` with 503 until its load time has passed (counted from the
process's start, interpreter start-up included, as a real server's load is) and refuses work
until then; it serves at most `parallel` requests at once (the rest wait for a slot) and produces
`tokens_per_s` tokens per second per request, streamed as server-sent events when asked. The text
is deterministic in the prompt, so tests can compare answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corral.bundled import sim_chat, sim_messages, sim_responses, sim_turns
from corral.bundled.sim_sleep import SimSleep
from corral.bundled.sim_slots import SimSlots

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Answer(Protocol[T_co]):
    """What the sim's APIs answer with (`sim_chat`, `sim_responses`, `sim_messages`): the
    whole JSON, or its events each with whether a token's time passes before it."""

    pieces: int  # tokens: the time a whole answer takes

    def whole(self) -> dict[str, Any]: ...

    def events(self) -> Sequence[tuple[T_co, bool]]: ...


_WORDS = [
    "the",
    "quick",
    "model",
    "loads",
    "once",
    "and",
    "serves",
    "every",
    "request",
    "in",
    "its",
    "queue",
    "before",
    "the",
    "next",
    "swap",
    "while",
    "the",
    "scheduler",
    "keeps",
    "the",
    "device",
    "busy",
    "generating",
    "tokens",
    "instead",
    "of",
    "moving",
    "weights",
]


@dataclass(frozen=True)
class SimSettings:
    model: str
    load_s: float = 2.0  # not healthy until this long after start
    tokens_per_s: float = 50.0  # per request
    parallel: int = 1  # requests served at once; the rest wait for a slot
    max_tokens: int = 16  # when a request does not say (answer_tokens 0)
    # An answer's natural length (0.5x-1.5x, by the prompt), cut by a request's cap; 0: as long
    # as the request's cap (the sim as a load generator). `sim_turns.length`.
    answer_tokens: int = 0
    embedding_dim: int = 16
    unload_s: float = 0.0  # a stop (SIGTERM) takes this long, like freeing the device
    # vLLM's sleep mode: going to sleep takes `sleep_s`; a wake from level 1 (the
    # weights in host memory) `wake_s`, from level 2 (the weights discarded) `wake2_s`; both
    # default to the load time. `memory_gb`: the weights, reported where they are.
    sleep_s: float = 0.0
    wake_s: float | None = None
    wake2_s: float | None = None
    memory_gb: float = 0.0
    sleep_api: bool = True  # False: no sleep endpoints (404), like a server without sleep mode
    # A prompt cache per slot (bundled/sim_slots.py): prompts processed at `prefill_tok_s` (a
    # word a token) where their slot does not hold them; None: prompts take no time, no /slots.
    prefill_tok_s: float | None = None
    state_tok_s: float = 200_000.0  # a slot saved or restored (`slot_save_path`) at this speed
    slot_save_path: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        status_code=status,
    )


class Refused(Exception):
    """A request the sim server refuses: answered with `response` (the app's handler)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.response = _error(status, message, kind)


async def _refused(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return exc.response


def _words(seed: str, n: int) -> list[str]:
    start = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big")
    return [_WORDS[(start + i) % len(_WORDS)] for i in range(n)]


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


async def _left(request: Request) -> None:
    """Returns when the client has gone (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class SimServer:
    """The sim server's state and its routes, one method each; its 'load' began when the
    process started."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.slots = asyncio.Semaphore(settings.parallel)
        self.created = int(time.time())
        # Epoch times, so a benchmark can tell its own load time from the gateway's overhead.
        age_s = process_age_s()
        self.started_epoch = time.time() - age_s
        self.ready_at = time.monotonic() - age_s + settings.load_s
        self.ready_epoch = self.started_epoch + settings.load_s
        # vLLM's sleep API and SGLang's memory release (bundled/sim_sleep.py).
        self.nap = SimSleep(
            settings.load_s, settings.sleep_s, settings.wake_s, settings.wake2_s, settings.memory_gb
        )
        self.served = 0  # requests answered, in /health: tells a model's copies' work apart
        self.cancelled = 0  # whole answers whose client left first (their work stopped)
        self.per_token_s = 1.0 / settings.tokens_per_s
        self.prompts = (
            SimSlots(
                settings.parallel,
                settings.prefill_tok_s,
                settings.state_tok_s,
                Path(settings.slot_save_path) if settings.slot_save_path else None,
            )
            if settings.prefill_tok_s
            else None
        )

    def ready(self) -> bool:
        return self.nap.refusal() is None and time.monotonic() >= self.ready_at

    async def health(self, _: Request) -> Response:
        if self.nap.asleep:  # like vLLM: the server is up, the weights are not
            return JSONResponse({"status": "sleeping", **self.nap.status()})
        if time.monotonic() < self.ready_at:
            return JSONResponse({"status": "loading model"}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "started_at": self.started_epoch,
                "ready_at": self.nap.woke_at or self.ready_epoch,
                "served": self.served,
                "cancelled": self.cancelled,
                **self.nap.status(),
            }
        )

    async def models(self, _: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "sim",
                    }
                ],
            }
        )

    async def parse(self, request: Request) -> dict[str, Any]:
        """The request's JSON object; `Refused` while asleep or loading, or for a body that is
        not a JSON object."""
        refusal = self.nap.refusal()
        if refusal is not None:
            raise Refused(503, refusal, "unavailable_error")
        if not self.ready():
            raise Refused(503, "Loading model", "unavailable_error")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Refused(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "the request body must be a JSON object")
        return body

    async def generate(self, request: Request, chat: bool) -> Response:
        body = await self.parse(request)
        prompt = _prompt_text(body)
        size = self.length(prompt, body.get("max_completion_tokens") or body.get("max_tokens"))
        words = _words(prompt, size.tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        model = self.settings.model
        answer = sim_chat.Answer(body, rid, chat, model, words, len(prompt.split()), size.cut)
        cache = self.prompts
        if cache is None:
            return await self.reply(answer, bool(body.get("stream")), bytes, request=request)
        said = prompt.split()
        slot, cached = cache.take(said, body.get("id_slot"))
        timings = cache.timings(len(said), cached)
        prefill_s = timings["prompt_ms"] / 1000
        if body.get("stream"):  # the slot is the stream's until it ends
            events = self.play(answer.events(), bytes, prefill_s, lambda: cache.done(slot, said))
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            whole = await self.reply(answer, False, bytes, prefill_s, request)
        finally:
            cache.done(slot, said)
        if whole.status_code != 200:  # the client left
            return whole
        out = json.loads(bytes(whole.body))
        return JSONResponse({**out, "timings": timings})

    def length(self, prompt: str, limit: object) -> sim_turns.Length:
        """An answer's length (`sim_turns.length`) under a request's cap (an integer, or
        none)."""
        cap = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        s = self.settings
        return sim_turns.length(prompt, cap, s.answer_tokens, s.max_tokens)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def embeddings(self, request: Request) -> Response:
        body = await self.parse(request)
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else list(raw or [])
        if not inputs:
            return _error(400, "input must be a string or a non-empty list of strings")
        dims = body.get("dimensions", self.settings.embedding_dim)
        if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= MAX_DIMENSIONS:
            return _error(400, f"dimensions must be an integer from 1 to {MAX_DIMENSIONS}")
        data = [
            {"object": "embedding", "index": i, "embedding": self._embedding(str(text), dims)}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(len(str(t).split()) for t in inputs)
        self.served += 1
        async with self.slots:
            await asyncio.sleep(
                tokens / self.settings.tokens_per_s / 10
            )  # prompt processing is fast
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.settings.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def transcriptions(self, request: Request) -> Response:
        if not self.ready():
            return _error(503, "Loading model", "unavailable_error")
        async with request.form() as form:
            audio, model = form.get("file"), form.get("model")
            if audio is None or isinstance(audio, str):
                return _error(400, "missing the `file` part")
            size = len(await audio.read())
        self.served += 1
        async with self.slots:
            await asyncio.sleep(size / 1e6)  # a second per MB of audio
        return JSONResponse(
            {"text": f"{size} bytes of audio heard by {model or self.settings.model}"}
        )

    async def speech(self, request: Request) -> Response:
        body = await self.parse(request)
        text = str(body.get("input", ""))
        if body.get("response_format") == "pcm":  # 24 kHz 16-bit samples: silence, 20 ms a char
            return Response(b"\0\0" * 480 * min(len(text), 2000), media_type="audio/pcm")
        return Response(b"ID3" + text.encode()[:64], media_type="audio/mpeg")

    async def rerank(self, request: Request) -> Response:
        body = await self.parse(request)
        query = str(body.get("query", ""))
        documents = [str(d) for d in body.get("documents") or []]
        words = set(query.lower().split())
        scores = [len(words & set(d.lower().split())) / (1 + len(words)) for d in documents]
        results = [{"index": i, "relevance_score": x} for i, x in enumerate(scores)]
        results.sort(key=lambda r: -float(r["relevance_score"]))
        return JSONResponse({"model": self.settings.model, "results": results})

    async def reply(
        self,
        answer: Answer[T],
        stream: bool,
        write: Callable[[T], bytes],
        prefill_s: float = 0.0,
        request: Request | None = None,
    ) -> Response:
        """An answer whole, after its prompt's and its tokens' time in a slot, or streamed
        (`play`). Like llama-server, a client that leaves (`request`'s connection closes)
        cancels the work and frees the slot at once."""
        if stream:
            events = self.play(answer.events(), write)
            return StreamingResponse(events, media_type="text/event-stream")
        self.served += 1
        async with self.slots:
            work = asyncio.ensure_future(
                asyncio.sleep(prefill_s + answer.pieces * self.per_token_s)
            )
            waits: set[asyncio.Future[Any]] = {work}
            if request is not None:
                waits.add(asyncio.ensure_future(_left(request)))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if not work.done() or work.cancelled():
                self.cancelled += 1
                return Response(status_code=499)  # nobody reads it
        return JSONResponse(answer.whole())

    async def play(
        self,
        events: Sequence[tuple[T, bool]],
        write: Callable[[T], bytes],
        prefill_s: float = 0.0,
        ended: Callable[[], None] | None = None,
    ) -> AsyncIterator[bytes]:
        """An answer's stream of events, its prompt's time first, a token's time before each
        event that is one; `ended` runs however the stream ends."""
        self.served += 1
        try:
            async with self.slots:
                await asyncio.sleep(prefill_s)
                for event, tick in events:
                    if tick:
                        await asyncio.sleep(self.per_token_s)
                    yield write(event)
        finally:
            if ended is not None:
                ended()

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (llama-server speaks it too): text, tools, thinking,
        whole or streamed."""
        body = await self.parse(request)
        wrong = sim_messages.refusal(body)
        if wrong is not None:
            return JSONResponse(sim_messages.error(wrong), status_code=400)
        prompt = sim_messages.prompt_text(body)
        size = self.length(prompt, body["max_tokens"])
        answer = sim_messages.Answer(
            body, self.settings.model, _words(prompt, size.tokens), size.cut
        )
        return await self.reply(answer, bool(body.get("stream")), sim_messages.sse, request=request)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: text, tools, structured output, whole or streamed."""
        body = await self.parse(request)
        wrong = sim_responses.refusal(body)
        if wrong is not None:
            return _error(400, wrong)
        prompt = sim_responses.prompt_text(body)
        size = self.length(prompt, body.get("max_output_tokens"))
        words = _words(prompt, size.tokens)
        answer = sim_responses.Answer(body, self.settings.model, words, size.cut)
        return await self.reply(
            answer, bool(body.get("stream")), sim_responses.sse, request=request
        )

    async def input_tokens(self, request: Request) -> Response:
        """How many tokens a Responses request's input is (words, for the sim)."""
        body = await self.parse(request)
        n = len(sim_responses.prompt_text(body).split())
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token count of a Messages request (words, for the sim)."""
        body = await self.parse(request)
        return JSONResponse({"input_tokens": len(sim_messages.prompt_text(body).split())})

    async def infill(self, request: Request) -> Response:
        """llama-server's fill-in-the-middle (`input_prefix`, `input_suffix`), in its native
        shape: `content`, `stop`, `stop_type`, token counts, `timings`."""
        body = await self.parse(request)
        prefix, suffix = body.get("input_prefix", ""), body.get("input_suffix", "")
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            return _error(400, "input_prefix and input_suffix must be strings")
        n = body.get("n_predict", body.get("max_tokens", self.settings.max_tokens))
        n = (
            n
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0
            else self.settings.max_tokens
        )
        words = _words(f"{prefix}\0{suffix}", n)
        evaluated = len(prefix.split()) + len(suffix.split())

        def native(content: str, i: int, stop: bool) -> dict[str, Any]:
            out: dict[str, Any] = {
                "index": 0,
                "content": content,
                "stop": stop,
                "model": self.settings.model,
                "tokens_predicted": i,
                "tokens_evaluated": evaluated,
            }
            if stop:
                out["stop_type"] = "limit"
                ms = 1000 * i / self.settings.tokens_per_s
                out["timings"] = {"prompt_n": evaluated, "prompt_ms": 1.0, "predicted_n": i,
                                  "predicted_ms": ms}  # fmt: skip
            return out

        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if body.get("stream"):
            events = [(native(p, i + 1, False), True) for i, p in enumerate(pieces)]
            events.append((native("", len(pieces), True), False))
            return StreamingResponse(
                self.play(events, sim_chat.sse), media_type="text/event-stream"
            )
        self.served += 1
        async with self.slots:
            await asyncio.sleep(len(words) * self.per_token_s)
        return JSONResponse(native("".join(pieces), len(pieces), True))

    async def props(self, _: Request) -> Response:
        return JSONResponse(
            {"model_alias": self.settings.model, "total_slots": self.settings.parallel}
        )

    def _embedding(self, text: str, dims: int) -> list[float]:
        return embedding(self.settings.model, text, dims)

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/props", self.props),
            Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", self.transcriptions, methods=["POST"]),
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/infill", self.infill, methods=["POST"]),
            *(Route(p, self.rerank, methods=["POST"]) for p in ("/v1/rerank", "/rerank")),
            *(self.nap.routes() if self.settings.sleep_api else []),
            *(self.prompts.routes() if self.prompts is not None else []),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ]


def build_app(settings: SimSettings) -> Starlette:
    """The sim server's ASGI app; its 'load' began when the process started."""
    return Starlette(routes=SimServer(settings).routes(), exception_handlers={Refused: _refused})


MAX_DIMENSIONS = 8192


def embedding(model: str, text: str, dims: int) -> list[float]:
    """A unit vector of `dims` values, fixed by the model and the text; any length (an
    embedding model trained to be cut, as Ollama's `dimensions` assumes)."""
    seed = hashlib.sha256(f"{model}\0{text}".encode()).digest()
    digest = b"".join(
        hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(dims // 32 + 1)
    )
    raw = [(digest[i] - 127.5) / 127.5 for i in range(dims)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def serve(settings: SimSettings, host: str, port: int) -> None:
    """Run the sim server until SIGTERM/SIGINT; a stop takes `settings.unload_s`, no more: the
    process exits that long after the signal (uvicorn's own graceful shutdown adds a tick and
    the interpreter's teardown, which would make every simulated unload longer than asked)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            time.sleep(settings.unload_s)  # freeing the device; nothing else runs meanwhile
            os._exit(0)

    config = uvicorn.Config(
        build_app(settings), host=host, port=port, log_level="warning", access_log=False
    )
    Server(config).run()
