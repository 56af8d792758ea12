"""A conversation as cumulative digests: key `i` names the conversation's first `i + 1`
messages (a chat) or its first `i + 1` whole chunks of characters (a plain prompt), so two requests
share their first `k` messages exactly when their first `k` keys are equal. A saved state is
found for a request by the longest run of equal keys, without keeping anybody's text.

Whatever a client sends is hashed, never interpreted: any JSON value hashes, and the cost is
bounded by the request's size, which the gateway bounds already."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

KEY_CHARS = 32  # hex digits kept of each digest: 128 bits
TEXT_CHUNK = 1024  # a plain prompt's characters per key
MAX_KEYS = 4096  # keys kept per conversation; a longer one is matched on its first ones


def chat_keys(messages: Sequence[Any]) -> list[str]:
    """One key per message: its role, content, name and tool calls, in order. A message that
    is not an object still hashes (as the JSON it is)."""
    h = hashlib.sha256()
    keys: list[str] = []
    for m in messages[:MAX_KEYS]:
        if isinstance(m, Mapping):
            m = {k: m.get(k) for k in ("role", "content", "name", "tool_calls", "tool_call_id")}
        h.update(_canonical(m))
        h.update(b"\x1e")  # a message boundary no JSON text contains
        keys.append(h.hexdigest()[:KEY_CHARS])
    return keys


def text_keys(prompt: str, chunk: int = TEXT_CHUNK) -> list[str]:
    """One key per whole `chunk` characters of a plain prompt: a prompt that goes on from
    another has all of its keys (a shorter last chunk would differ), so a longer save of the
    same prompt supersedes the shorter one."""
    h = hashlib.sha256()
    keys: list[str] = []
    for start in range(0, min(len(prompt) // chunk, MAX_KEYS) * chunk, chunk):
        h.update(prompt[start : start + chunk].encode("utf-8", "surrogatepass"))
        keys.append(h.hexdigest()[:KEY_CHARS])
    return keys


def shared(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading keys `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    ).encode("utf-8", "surrogatepass")
