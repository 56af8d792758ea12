"""Corral's loading progress is taken out of the assistant turns a client sends back."""

from __future__ import annotations

from typing import Any

from corral.gateway.servers import progress


def test_progress_lines_leave_assistant_turns_and_nothing_else() -> None:
    told = progress.line("waiting for model m to load") + progress.line("1 s")
    data: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": told + "my words"},  # a user's text is theirs
            {"role": "assistant", "reasoning_content": told, "content": told + "Paris."},
            {"role": "assistant", "reasoning": told + "I think so.\n"},
        ]
    }
    assert progress.strip(data)
    user, first, second = data["messages"]
    assert user["content"] == told + "my words"
    assert "reasoning_content" not in first  # nothing left of it
    assert first["content"] == "Paris."
    assert second["reasoning"] == "I think so.\n"
    assert not progress.strip(data)  # nothing more to take out
