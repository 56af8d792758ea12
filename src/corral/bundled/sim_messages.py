"""Anthropic's Messages API (`POST /v1/messages`) for the simulated server: pure
functions from a request and the sim model's words to the answer, whole or as the stream of
events the anthropic SDK reads (message_start, content blocks with their deltas, message_delta,
message_stop). Tools (`tool_use` blocks) and extended thinking (`thinking` blocks) included.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from corral.bundled import sim_turns
from corral.bundled.sim_schema import fill

Event = tuple[dict[str, Any], bool]  # an event, and whether a token's time passes before it


def refusal(body: dict[str, Any]) -> str | None:
    """What is wrong with the request, in the API's terms, or None."""
    if not isinstance(body.get("messages"), list):
        return "messages: Field required (a list of {role, content})"
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return "max_tokens: Field required (a positive integer)"
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict):
                inner = block.get("text", block.get("content", ""))
                parts.append(_text(inner) if not isinstance(inner, str) else inner)
        return " ".join(parts)
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    turns = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    return "\n".join([_text(body.get("system")), *(_text(m.get("content")) for m in turns)])


def tool_use(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool the model calls now (`sim_turns.pick` over Anthropic's `tool_choice`: auto,
    any, tool, none), its input filled from `input_schema`; None: it answers in text."""
    tools = {
        str(t["name"]): t for t in body.get("tools") or [] if isinstance(t, dict) and "name" in t
    }
    raw = body.get("tool_choice")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "tool":
        choice = sim_turns.Choice(
            "required", str(raw.get("name")) if isinstance(raw, dict) else None
        )
    else:
        choice = sim_turns.Choice({"any": "required", "none": "none"}.get(str(kind), "auto"))
    turns = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    called = {
        str(b.get("name"))
        for m in turns
        if m.get("role") == "assistant" and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use"
    }
    last = turns[-1] if turns else {}
    content = last.get("content")
    answered = isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content
    )  # a tool answered: the model speaks now, unless a call is required
    name = sim_turns.pick(list(tools), choice, last.get("role") == "user" and not answered, called)
    if name is None:
        return None
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": fill(tools[name].get("input_schema") or {"type": "object", "properties": {}}),
    }


class Answer:
    """One answer: `whole()` the message, `events()` its stream; `pieces` tokens long."""

    def __init__(
        self, body: dict[str, Any], model: str, words: list[str], cut: bool = False
    ) -> None:
        """`words`: the text's tokens, `cut`: whether `max_tokens` ended them."""
        self.body, self.model = body, model
        words, self.stop_sequence = sim_turns.cut_at_stop(
            words, sim_turns.stops_of(body.get("stop_sequences"))
        )
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.prompt = prompt_text(body)
        self.call = tool_use(body)
        thinking = body.get("thinking")
        self.thinking = (
            "Thinking it over: " + " ".join(words[:4])
            if isinstance(thinking, dict) and thinking.get("type") == "enabled"
            else None
        )
        self.words = words
        if self.call is not None:
            self.stop = "tool_use"
        elif self.stop_sequence is not None:
            self.stop = "stop_sequence"
        else:
            self.stop = "max_tokens" if cut else "end_turn"
        said = 2 + len(json.dumps(self.call["input"])) // 4 if self.call else len(words)
        self.pieces = said + (1 if self.thinking else 0)

    def _blocks(self) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if self.thinking is not None:
            blocks.append({"type": "thinking", "thinking": self.thinking, "signature": "sim"})
        if self.call is not None:
            blocks.append(self.call)
        else:
            blocks.append({"type": "text", "text": " ".join(self.words)})
        return blocks

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": len(self.prompt.split()),
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self._blocks(),
            "stop_reason": self.stop,
            "stop_sequence": self.stop_sequence,
            "usage": self._usage(self.pieces),
        }

    def events(self) -> list[Event]:
        begun = {**self.whole(), "content": [], "stop_reason": None, "usage": self._usage(1)}
        out: list[Event] = [({"type": "message_start", "message": begun}, False)]
        out.append(({"type": "ping"}, False))
        for index, block in enumerate(self._blocks()):
            out += _block_events(index, block, self.words)
        delta = {"stop_reason": self.stop, "stop_sequence": self.stop_sequence}
        usage = {"output_tokens": self.pieces}
        out.append(({"type": "message_delta", "delta": delta, "usage": usage}, False))
        out.append(({"type": "message_stop"}, False))
        return out


def _block_events(index: int, block: dict[str, Any], words: list[str]) -> list[Event]:
    kind = block["type"]
    if kind == "text":
        start: dict[str, Any] = {"type": "text", "text": ""}
        deltas = [
            {"type": "text_delta", "text": w if i == 0 else " " + w} for i, w in enumerate(words)
        ]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    else:  # tool_use: its input streamed as JSON in parts
        start = {**block, "input": {}}
        args = json.dumps(block["input"])
        half = len(args) // 2
        deltas = [
            {"type": "input_json_delta", "partial_json": piece}
            for piece in (args[:half], args[half:])
        ]
    out: list[Event] = [
        ({"type": "content_block_start", "index": index, "content_block": start}, False)
    ]
    for delta in deltas:
        tick = delta["type"] != "signature_delta"
        out.append(({"type": "content_block_delta", "index": index, "delta": delta}, tick))
    out.append(({"type": "content_block_stop", "index": index}, False))
    return out


def sse(event: dict[str, Any]) -> bytes:
    """One event as Anthropic streams it: `event: <type>`, then its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An error body in Anthropic's shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}
