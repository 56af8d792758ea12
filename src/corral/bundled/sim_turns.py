"""How long the simulated model talks and which tool it calls: the decisions its three APIs
(chat and completions, Responses, Messages) share, pure functions of a request's parts.

A model says as much as its answer needs and stops (`finish_reason: "stop"`); only a cap below
that cuts it (`"length"`). It calls a tool when asked to (`tool_choice` "required" or a named
tool, each API's spelling mapped by its caller), and on its own when the user spoke last; after
a tool's answer it talks, unless a call is required."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Length:
    """An answer's length in tokens (words, for the sim) and whether a cap cut it."""

    tokens: int
    cut: bool


def length(prompt: str, limit: int | None, answer_tokens: int, default_tokens: int) -> Length:
    """`answer_tokens` > 0: the answer's natural length, 0.5x to 1.5x of it as the prompt
    varies (fixed for a prompt), cut by the request's `limit`. 0: the sim as a load generator,
    as long as the request's `limit` (cut: it ran to the cap), else `default_tokens`."""
    limit = None if limit is None else max(limit, 0)
    if answer_tokens <= 0:
        return Length(default_tokens, False) if limit is None else Length(limit, True)
    spread = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:2], "big") / 65535
    natural = max(1, round(answer_tokens * (0.5 + spread)))
    if limit is not None and limit < natural:
        return Length(limit, True)
    return Length(natural, False)


@dataclass(frozen=True)
class Choice:
    """A request's `tool_choice`, whatever the API: "auto", "none", "required" and a `name`."""

    mode: str = "auto"
    name: str | None = None


def pick(
    tools: list[str], choice: Choice, user_last: bool, called: set[str], said: str = ""
) -> str | None:
    """The tool the model calls now, or None for text. Required: the first tool it has not
    called in this conversation (so a loop of tool then answer tool, as pydantic-ai's output
    tool, ends), else the last; named: that one (when offered). Auto, the user last: the tool
    the user's words ask for (`said`: "call the task tool"), else the first."""
    if not tools or choice.mode == "none":
        return None
    if choice.name is not None:
        return choice.name if choice.name in tools else None
    if choice.mode == "required":
        return next((t for t in tools if t not in called), tools[-1])
    if not user_last:
        return None
    asked = [t for t in _ASKED_TOOL.findall(said) if t in tools]
    return asked[0] if asked else tools[0]


_ASKED_TOOL = re.compile(r"\b([A-Za-z_][\w-]{0,63})\s+tool\b")


def named_in_text(tools: list[str], turns: list[object]) -> set[str]:
    """The tools whose quoted name an assistant's text turns mention: the calls of a client that
    keeps them as text (smolagents sends `Calling tools: [{... 'name': 'get_weather' ...}]`),
    which a model reads as made. `turns`: the assistant turns' contents (text or parts)."""
    text = " ".join(text_of(t) for t in turns)
    return {t for t in tools if f"'{t}'" in text or f'"{t}"' in text}


def text_of(content: object) -> str:
    """A message's text: its content, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def cut_at_stop(words: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """The words before the first stop sequence in their text, and the sequence that matched
    (None: no stop matched, the words unchanged)."""
    text = " ".join(words)
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return words, None
    at, stop = min(found)
    kept = text[:at].rstrip(" ")
    return (kept.split(" ") if kept else []), stop


def stops_of(raw: object) -> list[str]:
    """A request's stop sequences (`stop`, `stop_sequences`): a string or a list of them;
    anything else is none."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list):
        return [s for s in raw if isinstance(s, str)]
    return []
