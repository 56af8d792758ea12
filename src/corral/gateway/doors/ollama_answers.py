"""OpenAI answers in Ollama's shape: `OllamaAnswer` turns a model server's answer
(JSON, or server-sent events) into Ollama's (JSON, or NDJSON: one object per line, the last with
`done: true`, durations in nanoseconds). No I/O beyond the stream it is given.

The shapes are Ollama's as its clients read them (../shared/notes/peers.md, "Ollama's API"):
`message` in every chat line, tool-call arguments as an object, a final `{"error": ...}` line
for an answer cut short.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime
from typing import Any

from corral.gateway.doors.ollama_shapes import Kind, context_of, logprobs_of, shorten

_DONE_REASON = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}


def now_iso() -> str:
    """The time as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error_body(message: str) -> bytes:
    """An error as Ollama writes one: `{"error": "..."}`."""
    return json.dumps({"error": message}, separators=(",", ":")).encode()


def error_line(message: str) -> bytes:
    """The same, as a line of a stream."""
    return error_body(message) + b"\n"


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _arguments(raw: Any) -> dict[str, Any]:
    """Tool-call arguments as the object Ollama's clients require (servers send a string)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw.strip():
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {"arguments": raw}
        return parsed if isinstance(parsed, dict) else {"value": parsed}
    return {}


class OllamaAnswer:
    """Turns one OpenAI answer into Ollama's, for the model name the client used. Made when
    the request arrives: `total_duration` counts from then, `load_duration` is the wait for
    the model (queue and swap)."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, kind: Kind) -> None:
        self.model = model
        self.kind = kind
        self.arrived = time.monotonic()
        self.dimensions: int | None = None  # /api/embed's `dimensions`: vectors cut to it
        self.top_logprobs: int | None = None  # asked for log probabilities: how many others
        # /api/generate: the conversation so far, to which the answer is added in its final
        # line's `context`; None: no context (chat, raw prompts, fill-in-the-middle).
        self.turns: list[tuple[str, str]] | None = None
        self._said: list[str] = []  # the answer's text so far, for the context

    def error(self, message: str) -> bytes:
        return error_body(message)

    # --- whole answers ------------------------------------------------------------------------
    def whole(self, content: bytes, wait_s: float) -> bytes:
        """A complete OpenAI answer (chat, completion or embeddings) as Ollama's JSON."""
        data = _as_openai(json.loads(content))
        usage = data.get("usage") or {}
        if self.kind in ("embed", "embeddings"):
            vectors = [
                shorten(d.get("embedding", []), self.dimensions)
                for d in sorted(data.get("data", []), key=_index)
            ]
            if self.kind == "embeddings":
                return json.dumps({"embedding": vectors[0] if vectors else []}).encode()
            return json.dumps(
                {
                    "model": self.model,
                    "embeddings": vectors,
                    "total_duration": _ns(time.monotonic() - self.arrived),
                    "load_duration": _ns(wait_s),
                    "prompt_eval_count": usage.get("prompt_tokens", 0),
                }
            ).encode()
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = message.get("content") if "message" in choice else choice.get("text")
        if self.turns is not None:
            self._said.append(text or "")
        out = self._line(text or "", message.get("reasoning_content"))
        if self.top_logprobs is not None:
            out["logprobs"] = logprobs_of(choice.get("logprobs"), self.top_logprobs)
        calls = [
            {
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments")),
                }
            }
            for c in message.get("tool_calls") or []
            if isinstance(c, dict) and isinstance(c.get("function"), dict)
        ]
        if calls:
            out["message"]["tool_calls"] = calls
        out.update(
            self._final(choice.get("finish_reason"), usage, data.get("timings"), wait_s, None)
        )
        return json.dumps(out).encode()

    # --- streamed answers ---------------------------------------------------------------------
    async def stream(
        self, events: AsyncIterator[bytes], wait_s: float
    ) -> AsyncGenerator[bytes, None]:
        """Server-sent events (lines cut whole by the relay) as NDJSON lines. Closing it closes
        `events` at once (the relay's `finally` frees the model's slot)."""
        try:
            async for line in self._lines(events, wait_s):
                yield line
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _lines(self, events: AsyncIterator[bytes], wait_s: float) -> AsyncIterator[bytes]:
        """The lines each piece of `events` makes, as one write (a send per token line cost a
        millisecond a request). The last lines go out with `[DONE]`; the rest of `events` is
        still read, so the server's connection ends cleanly and is reused."""
        buffer = b""
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] | None = None
        first_at: float | None = None
        done = False
        async for chunk in events:
            if done:
                continue
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            out: list[bytes] = []
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    data = _as_openai(json.loads(payload))
                except ValueError:
                    continue
                if "error" in data:
                    err = data["error"]
                    message = err.get("message") if isinstance(err, dict) else str(err)
                    yield b"".join(out) + error_line(str(message))
                    return
                usage = data.get("usage") or usage
                timings = data.get("timings") or timings
                for choice in data.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if "delta" in choice else choice.get("text")
                    thinking = delta.get("reasoning_content")
                    for call in delta.get("tool_calls") or []:
                        slot = calls.setdefault(
                            int(call.get("index", 0)), {"name": "", "arguments": ""}
                        )
                        fn = call.get("function") or {}
                        slot["name"] += fn.get("name") or ""
                        slot["arguments"] += fn.get("arguments") or ""
                    probs = (
                        logprobs_of(choice.get("logprobs"), self.top_logprobs)
                        if self.top_logprobs is not None
                        else []
                    )
                    if text or thinking or probs:
                        first_at = first_at or time.monotonic()
                        if text and self.turns is not None:
                            self._said.append(text)
                        piece = self._line(text or "", thinking)
                        if probs:
                            piece["logprobs"] = probs
                        out.append(json.dumps(piece).encode() + b"\n")
            if done:
                out += self._tail(calls, finish, usage, timings, wait_s, first_at)
            if out:
                yield b"".join(out)
        if not done:  # the server ended without [DONE]: the answer ends here all the same
            yield b"".join(self._tail(calls, finish, usage, timings, wait_s, first_at))

    def _tail(
        self,
        calls: dict[int, dict[str, Any]],
        finish: str | None,
        usage: dict[str, Any],
        timings: dict[str, Any] | None,
        wait_s: float,
        first_at: float | None,
    ) -> list[bytes]:
        """The tool calls, gathered whole, and the final line."""
        out = []
        if calls and self.kind == "chat":
            called = self._line("", None)
            called["message"]["tool_calls"] = [
                {"function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                for _, c in sorted(calls.items())
            ]
            out.append(json.dumps(called).encode() + b"\n")
        last = self._line("", None)
        last.update(self._final(finish, usage, timings, wait_s, first_at))
        out.append(json.dumps(last).encode() + b"\n")
        return out

    def _line(self, text: str, thinking: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def _final(
        self,
        finish: str | None,
        usage: dict[str, Any],
        timings: dict[str, Any] | None,
        wait_s: float,
        first_at: float | None,
    ) -> dict[str, Any]:
        end = time.monotonic()
        context: dict[str, Any] = {}
        if self.turns is not None:
            context["context"] = context_of([*self.turns, ("assistant", "".join(self._said))])
        if timings and "prompt_ms" in timings and "predicted_ms" in timings:
            prompt_s = float(timings["prompt_ms"]) / 1000  # llama-server measures them
            eval_s = float(timings["predicted_ms"]) / 1000
        else:
            started = self.arrived + wait_s
            prompt_s = (first_at - started) if first_at else 0.0
            eval_s = end - (first_at or started)
        return {
            "done": True,
            "done_reason": _DONE_REASON.get(finish or "stop", "stop"),
            "total_duration": _ns(end - self.arrived),
            "load_duration": _ns(wait_s),
            "prompt_eval_count": int(usage.get("prompt_tokens") or 0),
            "prompt_eval_duration": _ns(prompt_s),
            "eval_count": int(usage.get("completion_tokens") or 0),
            "eval_duration": _ns(eval_s),
            **context,
        }

    def bare(self, reason: str, wait_s: float = 0.0) -> bytes:
        """The answer to a request with nothing to generate (an empty prompt loads, or with
        `keep_alive: 0` unloads): one final line, `done_reason` saying which."""
        out = self._line("", None)
        out.update({"done": True, "done_reason": reason})
        if reason == "load":
            out["load_duration"] = _ns(wait_s)
            out["total_duration"] = _ns(time.monotonic() - self.arrived)
        return json.dumps(out).encode()


def _as_openai(data: Any) -> Any:
    """llama-server's native answer (`/infill`: `content`, `stop`, `stop_type`, its counts) as
    an OpenAI completion; an OpenAI answer as it is."""
    if not isinstance(data, dict) or "choices" in data or "stop" not in data:
        return data
    finish = None
    if data.get("stop"):
        finish = "length" if data.get("stop_type") == "limit" else "stop"
    out: dict[str, Any] = {
        "choices": [{"index": 0, "text": str(data.get("content") or ""), "finish_reason": finish}]
    }
    if data.get("stop"):
        out["usage"] = {
            "prompt_tokens": data.get("tokens_evaluated") or 0,
            "completion_tokens": data.get("tokens_predicted") or 0,
        }
        out["timings"] = data.get("timings")
    return out


def _index(d: dict[str, Any]) -> int:
    value = d.get("index", 0)
    return value if isinstance(value, int) else 0
