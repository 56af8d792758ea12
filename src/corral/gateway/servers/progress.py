"""The loading progress Corral writes into a streamed chat (`send_loading_state`), marked so
that it never becomes part of a conversation: every line of it starts with `MARK`, and a
request's assistant turns lose those lines before any model sees them (clients such as
OpenCode send an answer's reasoning back with every later request)."""

from __future__ import annotations

from typing import Any

MARK = "[corral] "
MARK_BYTES = MARK.encode()
_FIELDS = ("reasoning_content", "reasoning", "content")


def line(text: str) -> str:
    """One line of progress, marked."""
    return f"{MARK}{text}\n"


def strip(data: dict[str, Any]) -> bool:
    """Take Corral's progress lines out of `data`'s assistant messages (their reasoning and
    text); True when something was taken out. A field left empty is removed."""
    changed = False
    for message in data.get("messages") or []:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        for field in _FIELDS:
            text = message.get(field)
            if not isinstance(text, str) or MARK not in text:
                continue
            kept = "".join(
                part for part in text.splitlines(keepends=True) if not part.startswith(MARK)
            )
            changed = True
            if kept.strip() or field == "content":
                message[field] = kept.lstrip("\n")
            else:
                del message[field]
    return changed
