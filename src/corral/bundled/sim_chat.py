"""OpenAI's chat and completions answers for the simulated server: pure functions
from a request and the sim model's words to the parts of its answer: a tool call, structured
output, shown reasoning, log probabilities, and the streamed chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from corral.bundled import sim_turns
from corral.bundled.sim_schema import Cues, cues_of, fill, keys_of


def tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool call the model makes now (`sim_turns.pick`), its arguments made from the
    tool's schema; None: it answers in text."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    fns = [t.get("function") for t in tools]
    named = {str(f.get("name")): f for f in fns if isinstance(f, dict) and f.get("name")}
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    called = {
        str((c.get("function") or {}).get("name"))
        for m in messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or []
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
    }
    replies = [m.get("content") for m in messages if m.get("role") == "assistant"]
    called |= sim_turns.named_in_text(list(named), replies)
    raw = body.get("tool_choice")
    if isinstance(raw, dict):
        fn = raw.get("function")
        choice = sim_turns.Choice("required", str(fn.get("name")) if isinstance(fn, dict) else None)
    else:
        choice = sim_turns.Choice(raw if raw in ("none", "required") else "auto")
    user_last = bool(messages) and messages[-1].get("role") == "user"
    asked = sim_turns.text_of(messages[-1].get("content")) if user_last else ""
    name = sim_turns.pick(list(named), choice, user_last, called, asked)
    if name is None:
        return None
    schema = named[name].get("parameters") or {"type": "object", "properties": {}}
    args = fill(schema, cues=prompt_cues(body), optional=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def call_deltas(call: dict[str, Any]) -> list[dict[str, Any]]:
    args = call["function"]["arguments"]
    half = len(args) // 2
    head = {"index": 0, "id": call["id"], "type": "function"}
    return [
        {**head, "function": {"name": call["function"]["name"], "arguments": ""}},
        {"index": 0, "function": {"arguments": args[:half]}},
        {"index": 0, "function": {"arguments": args[half:]}},
    ]


def formatted(body: dict[str, Any], words: list[str]) -> str | None:
    """The answer as JSON when `response_format` asks for it (an object, or the schema's)."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    cues = prompt_cues(body)
    if fmt.get("type") == "json_object":  # the keys the prompt names, as a model would use
        keys = keys_of(cues) or ["answer"]
        share = max(1, len(words) // len(keys))
        return json.dumps({k: " ".join(words[i * share : (i + 1) * share]) or "answer"
                           for i, k in enumerate(keys)})  # fmt: skip
    if fmt.get("type") == "json_schema":
        return json.dumps(fill((fmt.get("json_schema") or {}).get("schema"), words, cues))
    return None


def prompt_cues(body: dict[str, Any]) -> Cues:
    """What the last user message gives a value (`sim_schema.Cues`)."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return cues_of(sim_turns.text_of(users[-1]) if users else "")


def thought(body: dict[str, Any], words: list[str]) -> list[str]:
    """The reasoning a thinking model shows first, when a chat asks for it (`reasoning_effort`,
    or `chat_template_kwargs.enable_thinking: true` as llama-server takes it); else none."""
    kwargs = body.get("chat_template_kwargs")
    enabled = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if enabled is False or (enabled is None and not body.get("reasoning_effort")):
        return []
    effort = body.get("reasoning_effort")
    n = {"low": 2, "medium": 4, "high": 8}.get(effort if isinstance(effort, str) else "", 4)
    return ["Thinking:", *words[:n]]


def event(rid: str, model: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives a request asks for with each token's log probability (chat:
    `logprobs: true` and `top_logprobs`; completions: `logprobs: N`), or None."""
    if chat:
        if body.get("logprobs") is not True:
            return None
        top = body.get("top_logprobs")
        return top if isinstance(top, int) and not isinstance(top, bool) else 0
    n = body.get("logprobs")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def logprobs(pieces: list[str], top: int, chat: bool) -> dict[str, Any]:
    """Log probabilities for `pieces`, OpenAI's shape (chat's `content` list; completions'
    parallel lists): made up but fixed, each alternative less likely than the token."""
    rows = []
    for piece in pieces:
        logprob = -0.05 * (1 + len(piece) % 7)
        alts = [(piece, logprob)] + [(f"{piece.strip()}~{k}", logprob - k) for k in range(1, top)]
        rows.append((piece, logprob, alts[: max(top, 0)]))
    if not chat:
        return {
            "tokens": [p for p, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [dict(alts) for _, _, alts in rows],
            "text_offset": [sum(len(p) for p, _, _ in rows[:k]) for k in range(len(rows))],
        }
    return {
        "content": [
            {
                "token": p,
                "logprob": lp,
                "bytes": list(p.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts
                ],
            }
            for p, lp, alts in rows
        ]
    }


def chunk(
    rid: str,
    chat: bool,
    model: str,
    text: str | None,
    finish: str | None,
    first: bool,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return sse(
        {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
    )


class Answer:
    """One chat or completions answer: `whole()` the JSON, `events()` its server-sent events
    (each with whether a token's time passes before it); `pieces` tokens long."""

    def __init__(
        self,
        body: dict[str, Any],
        rid: str,
        chat: bool,
        model: str,
        words: list[str],
        prompt_tokens: int,
        cut: bool = False,
    ) -> None:
        """`words`: the text's tokens, `cut`: whether a cap ended them (`sim_turns.length`)."""
        self.rid, self.chat, self.model = rid, chat, model
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.call = tool_call(body) if chat else None
        self.shaped = formatted(body, words)
        words, stop = sim_turns.cut_at_stop(words, sim_turns.stops_of(body.get("stop")))
        self.words = [self.shaped] if self.shaped is not None else words
        self.probs = logprobs_asked(body, chat)
        self.thought = thought(body, self.words) if chat and self.call is None else []
        if self.call is not None:
            self.finish = "tool_calls"
            self.pieces = 2 + len(self.call["function"]["arguments"]) // 4
        else:
            ended = self.shaped is not None or stop is not None or not cut
            self.finish = "stop" if ended else "length"
            self.pieces = len(self.words) + len(self.thought)
        self.usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.pieces,
            "total_tokens": prompt_tokens + self.pieces,
        }

    def whole(self) -> dict[str, Any]:
        text = " ".join(self.words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "logprobs": None}
        if self.call is not None:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": [self.call]}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.thought:  # as llama-server and vLLM return a thinking model's reasoning
                choice["message"]["reasoning_content"] = " ".join(self.thought)
        else:
            choice["text"] = text
        if self.probs is not None and self.call is None:
            pieces = [w if i == 0 else " " + w for i, w in enumerate(self.words)]
            choice["logprobs"] = logprobs(pieces, self.probs, self.chat)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def events(self) -> list[tuple[bytes, bool]]:
        rid, chat, model = self.rid, self.chat, self.model
        out: list[tuple[bytes, bool]] = []
        if self.call is not None:  # as OpenAI streams one: the name, then the arguments in parts
            for delta in call_deltas(self.call):
                out.append((sse(event(rid, model, {"tool_calls": [delta]}, None)), True))
            out.append((sse(event(rid, model, {}, "tool_calls")), False))
        else:
            for i, word in enumerate(self.thought):
                delta = {"reasoning_content": word if i == 0 else " " + word}
                if i == 0:
                    delta["role"] = "assistant"
                out.append((sse(event(rid, model, delta, None)), True))
            for i, word in enumerate(self.words):
                piece = word if i == 0 else " " + word
                probs = None if self.probs is None else logprobs([piece], self.probs, chat)
                first = i == 0 and not self.thought
                out.append((chunk(rid, chat, model, piece, None, first, probs), True))
            out.append((chunk(rid, chat, model, None, self.finish, first=not self.words), False))
        if self.include_usage:
            last: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": self.usage,
            }
            out.append((sse(last), False))
        out.append((b"data: [DONE]\n\n", False))
        return out
