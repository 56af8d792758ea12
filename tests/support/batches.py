"""The Batch API through the official `openai` client, for the tests: a request line, an
upload, waiting for a batch to end, the lines of a result file."""

from __future__ import annotations

import json
import time
from typing import Any

import openai

ENDED = ("completed", "failed", "cancelled", "expired")


def chat_line(i: int, model: str, tokens: int = 3, **over: Any) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    return json.dumps(
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} | over
    )


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("in.jsonl", data), purpose="batch").id


def finish(client: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ENDED:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}"
        time.sleep(0.1)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
