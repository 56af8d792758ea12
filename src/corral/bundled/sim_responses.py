"""OpenAI's Responses API (`POST /v1/responses`) for the simulated server: pure
functions from a request and the words the sim model says to the answer, whole or as its
stream of events. What openai-python reads: `output` items (`message` with `output_text`
parts, `function_call`), `usage`, and the streamed events each with its `sequence_number`.

It is stateless, like llama-server's: `previous_response_id`, `background` and `conversation`
are refused (`refusal`), since nothing is stored to continue or fetch.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from corral.bundled import sim_turns
from corral.bundled.sim_schema import fill

Event = tuple[dict[str, Any], bool]  # an event, and whether a token's time passes before it


def refusal(body: dict[str, Any]) -> str | None:
    """Why this server cannot take the request, or None."""
    for key in ("previous_response_id", "background", "conversation"):
        if body.get(key):
            return (
                f"`{key}` needs a server that stores responses; this one (like llama-server) "
                "keeps none: send the whole conversation in `input`"
            )
    raw = body.get("input")
    if raw is not None and not isinstance(raw, str | list):
        return "`input` must be a string or a list of input items"
    return None


def prompt_text(body: dict[str, Any]) -> str:
    """The text of `instructions` and every input item, for the words of the answer."""
    parts = [str(body.get("instructions") or "")]
    raw = body.get("input")
    if isinstance(raw, str):
        return "\n".join([*parts, raw])
    for item in raw or []:
        if not isinstance(item, dict):
            continue
        content = item.get("content", item.get("output", ""))
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(str(content or ""))
    return "\n".join(parts)


def tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """The function the model calls now (`sim_turns.pick` over `tool_choice`: auto, none,
    required, a named function), its arguments filled from its schema; None: it answers in
    text (after a function's output, unless a call is required)."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    functions = [t.get("function", t) for t in tools if t.get("type", "function") == "function"]
    named = {str(f["name"]): f for f in functions if isinstance(f, dict) and f.get("name")}
    raw = body.get("tool_choice")
    if isinstance(raw, dict):
        choice = sim_turns.Choice("required", str(raw.get("name")) if raw.get("name") else None)
    else:
        choice = sim_turns.Choice(raw if raw in ("none", "required") else "auto")
    items = body.get("input")
    items = [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
    called = {str(i.get("name")) for i in items if i.get("type") == "function_call"}
    last = items[-1] if items else {"role": "user"}  # a string input: the user's words
    user_last = last.get("type", "message") == "message" and last.get("role", "user") == "user"
    name = sim_turns.pick(list(named), choice, user_last, called)
    if name is None:
        return None
    args = fill(named[name].get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:24]}",
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": json.dumps(args),
        "status": "completed",
    }


def output_text(body: dict[str, Any], words: list[str]) -> tuple[str, bool]:
    """The answer's text, and whether it is whole (structured output ends by itself; plain
    text runs to the words asked for)."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return json.dumps(fill(fmt.get("schema"), words)), True
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return json.dumps({"answer": " ".join(words)}), True
    return " ".join(words), False


def response(
    body: dict[str, Any],
    model: str,
    rid: str,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `response` object, echoing the request's settings as OpenAI's does."""
    fmt = body.get("text") if isinstance(body.get("text"), dict) else None
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": fmt or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [_flat(t) for t in body.get("tools") or [] if isinstance(t, dict)],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": body.get("metadata") or {},
    }
    return out


def usage_of(prompt: str, output_tokens: int) -> dict[str, Any]:
    n = len(prompt.split())
    return {
        "input_tokens": n,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n + output_tokens,
    }


class Answer:
    """One answer to a Responses request: `whole()` the response object, `events()` its
    stream. `pieces` is how many tokens it takes (a token's time each)."""

    def __init__(
        self, body: dict[str, Any], model: str, words: list[str], cut: bool = False
    ) -> None:
        """`words`: the text's tokens, `cut`: whether `max_output_tokens` ended them."""
        self.body, self.model = body, model
        self.rid = f"resp_{uuid.uuid4().hex[:24]}"
        self.prompt = prompt_text(body)
        self.call = tool_call(body)
        text, whole = output_text(body, words)
        self.text = text
        self.status = "incomplete" if cut and not whole and self.call is None else "completed"
        self.deltas = [text] if whole else [w if i == 0 else " " + w for i, w in enumerate(words)]
        self.pieces = (
            2 + len(self.call["arguments"]) // 4 if self.call is not None else len(self.deltas)
        )
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"

    def _items(self) -> list[dict[str, Any]]:
        if self.call is not None:
            return [self.call]
        return [
            {
                "type": "message",
                "id": self.msg_id,
                "status": "completed",
                "role": "assistant",
                "content": [_text_part(self.text)],
            }
        ]

    def whole(self) -> dict[str, Any]:
        tokens = self.pieces if self.call is not None else len(self.deltas)
        usage = usage_of(self.prompt, tokens)
        return response(self.body, self.model, self.rid, self._items(), self.status, usage)

    def events(self) -> list[Event]:
        """The stream: created, in_progress, the output item's events, then completed (or
        incomplete), numbered in order."""
        out: list[Event] = []
        begun = response(self.body, self.model, self.rid, [], "in_progress", None)
        out.append(({"type": "response.created", "response": begun}, False))
        out.append(({"type": "response.in_progress", "response": begun}, False))
        if self.call is not None:
            out += self._call_events()
        else:
            out += self._text_events()
        final = self.whole()
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        out.append(({"type": kind, "response": final}, False))
        for n, (event, _) in enumerate(out):
            event["sequence_number"] = n
        return out

    def _text_events(self) -> list[Event]:
        at = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        begun = {
            "type": "message",
            "id": self.msg_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        out: list[Event] = [
            ({"type": "response.output_item.added", "output_index": 0, "item": begun}, False),
            ({"type": "response.content_part.added", **at, "part": _text_part("")}, False),
        ]
        for delta in self.deltas:
            event = {"type": "response.output_text.delta", **at, "delta": delta, "logprobs": []}
            out.append((event, True))
        done = {"type": "response.output_text.done", **at, "text": self.text, "logprobs": []}
        out.append((done, False))
        out.append(
            ({"type": "response.content_part.done", **at, "part": _text_part(self.text)}, False)
        )
        item = self._items()[0]
        out.append(({"type": "response.output_item.done", "output_index": 0, "item": item}, False))
        return out

    def _call_events(self) -> list[Event]:
        call = self.call
        assert call is not None
        begun = {**call, "arguments": "", "status": "in_progress"}
        args = call["arguments"]
        half = len(args) // 2
        at = {"item_id": call["id"], "output_index": 0}
        out: list[Event] = [
            ({"type": "response.output_item.added", "output_index": 0, "item": begun}, True)
        ]
        for piece in (args[:half], args[half:]):
            event = {"type": "response.function_call_arguments.delta", **at, "delta": piece}
            out.append((event, True))
        done = {
            "type": "response.function_call_arguments.done",
            **at,
            "name": call["name"],
            "arguments": args,
        }
        out.append((done, False))
        out.append(({"type": "response.output_item.done", "output_index": 0, "item": call}, False))
        return out


def _flat(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the Responses API lists it (name and parameters at the top; a
    client may send chat's nested `function` shape)."""
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        return tool
    return {"type": "function", "strict": fn.get("strict"), **fn}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def sse(event: dict[str, Any]) -> bytes:
    """One event as the Responses API streams it: its type named, then its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
