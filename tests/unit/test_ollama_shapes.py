"""Ollama's requests and answers in OpenAI's terms (gateway/doors/ollama_shapes.py): pure,
table-tested, with the answers a server cuts short or garbles."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from corral.gateway.doors.ollama_answers import OllamaAnswer
from corral.gateway.doors.ollama_shapes import (
    BadRequest,
    chat_request,
    embed_request,
    generate_request,
    keep_alive_s,
)


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        (-1, math.inf),
        ("-1", math.inf),
        ("-1m", math.inf),
        (300, 300.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("250ms", 0.25),
        ("10s", 10.0),
    ],
)
def test_keep_alive_takes_what_ollama_takes(raw: Any, seconds: float | None) -> None:
    assert keep_alive_s(raw) == seconds


@pytest.mark.parametrize("raw", ["soon", "5 minutes", "m5", "", "5x", True, [1], "nan"])
def test_a_keep_alive_that_is_no_duration_names_the_field(raw: Any) -> None:
    with pytest.raises(BadRequest, match="keep_alive"):
        keep_alive_s(raw)


def test_chat_maps_options_format_images_tools_and_thinking() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 20).decode()
    body = {
        "model": "x",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is this?", "images": [png]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "look", "arguments": {"at": "it"}}}],
            },
            {"role": "tool", "content": "a cat", "tool_name": "look"},
        ],
        "tools": [{"type": "function", "function": {"name": "look", "parameters": {}}}],
        "options": {
            "num_predict": 9,
            "temperature": 0.1,
            "top_k": 5,
            "num_ctx": 8192,
            "stop": ["\n"],
        },
        "format": {"type": "object"},
        "think": False,
    }
    out = chat_request(body, "served")
    assert out["model"] == "served"
    assert out["max_tokens"] == 9
    assert (out["temperature"], out["top_k"], out["stop"]) == (0.1, 5, ["\n"])
    assert "num_ctx" not in out  # fixed when the server starts
    assert out["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert out["chat_template_kwargs"] == {"enable_thinking": False}
    assert out["stream"] is True  # Ollama's default
    assert out["stream_options"] == {"include_usage": True}
    image = out["messages"][1]["content"][1]
    assert image["image_url"]["url"].startswith("data:image/png;base64,")
    call = out["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"at": "it"}
    assert out["messages"][3]["tool_call_id"] == call["id"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": "x", "images": "abc"}]}, "images"),
        ({"messages": [], "options": [1]}, "options"),
        ({"messages": [], "format": "yaml"}, "format"),
        ({"messages": [], "stream": "yes"}, "stream"),
        ({"messages": [], "think": "maybe"}, "think"),
    ],
)
def test_a_bad_chat_request_names_its_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        chat_request(body, "m")


def test_generate_is_a_chat_request_or_with_raw_a_completion() -> None:
    path, out = generate_request({"prompt": "hi", "system": "s", "stream": False}, "m")
    assert path == "/v1/chat/completions"
    assert out["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
    ]
    assert "stream_options" not in out
    path, out = generate_request({"prompt": "hi", "raw": True, "options": {"num_predict": -1}}, "m")
    assert path == "/v1/completions"
    assert out["prompt"] == "hi"
    assert "max_tokens" not in out  # -1: no limit
    assert embed_request({"input": ["a", "b"]}, "m", "embed")["input"] == ["a", "b"]
    with pytest.raises(BadRequest, match="prompt"):
        embed_request({"input": "a"}, "m", "embeddings")


async def _events(*lines: str) -> AsyncIterator[bytes]:
    for line in lines:
        yield line.encode()


def _run(answer: OllamaAnswer, *lines: str) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [x async for x in answer.stream(_events(*lines), 0.5)]

    out = b"".join(asyncio.run(collect()))
    assert out.endswith(b"\n")
    assert b"\n\n" not in out  # NDJSON: one object a line, nothing blank
    return [json.loads(x) for x in out.splitlines()]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def test_a_stream_becomes_ndjson_with_tool_calls_whole_and_a_final_line() -> None:
    lines = _run(
        OllamaAnswer("m:latest", "chat"),
        _sse({"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}),
        _sse({"choices": [{"delta": {"content": "lo", "reasoning_content": "hmm"}}]}),
        _sse(
            {
                "choices": [
                    {
                        "delta": {
                            "tool_calls": [
                                {"index": 0, "function": {"name": "f", "arguments": '{"a"'}}
                            ]
                        }
                    }
                ]
            }
        ),
        _sse(
            {
                "choices": [
                    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}
                ]
            }
        ),
        _sse({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
        "data: [DONE]\n\n",
    )
    assert [x["message"]["content"] for x in lines[:2]] == ["Hel", "lo"]
    assert lines[1]["message"]["thinking"] == "hmm"
    assert lines[2]["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
    last = lines[-1]
    assert (last["done"], last["done_reason"]) == (True, "stop")
    assert (last["prompt_eval_count"], last["eval_count"]) == (7, 3)
    assert last["load_duration"] == 500_000_000
    assert last["model"] == "m:latest"


def test_an_error_event_mid_stream_ends_with_an_error_line() -> None:
    lines = _run(
        OllamaAnswer("m", "generate"),
        _sse({"choices": [{"delta": {"content": "a"}}]}),
        '\ndata: {"error": {"message": "model m: the answer was cut short"}}\n\n',
        _sse({"choices": [{"delta": {"content": "never"}}]}),
    )
    assert lines == [lines[0], {"error": "model m: the answer was cut short"}]
    assert lines[0]["response"] == "a"


def test_garbled_events_are_skipped_and_closing_the_stream_closes_the_relay() -> None:
    closed: list[bool] = []

    async def relay() -> AsyncIterator[bytes]:
        try:
            yield b"data: {not json\n\n"
            yield b": a comment\n"
            yield _sse({"choices": [{"delta": {"content": "x"}}]}).encode()
            yield _sse({"choices": [{"delta": {"content": "y"}}]}).encode()
        finally:
            closed.append(True)

    async def first() -> bytes:
        it = OllamaAnswer("m", "chat").stream(relay(), 0.0)
        line = await it.__anext__()
        await it.aclose()  # the client left: the relay's finally (the slot) runs now
        return line

    assert json.loads(asyncio.run(first()))["message"]["content"] == "x"
    assert closed == [True]


def test_whole_answers_chat_completion_and_embeddings() -> None:
    chat = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
        "timings": {"prompt_ms": 10.0, "predicted_ms": 20.0},
    }
    out = json.loads(OllamaAnswer("m", "chat").whole(json.dumps(chat).encode(), 0.0))
    assert out["message"]["content"] == ""
    assert out["message"]["tool_calls"][0]["function"]["arguments"] == {"arguments": "not json"}
    assert (out["prompt_eval_duration"], out["eval_duration"]) == (10_000_000, 20_000_000)
    emb = {"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}]}
    out = json.loads(OllamaAnswer("m", "embed").whole(json.dumps(emb).encode(), 0.0))
    assert out["embeddings"] == [[1.0], [2.0]]
    out = json.loads(OllamaAnswer("m", "embeddings").whole(json.dumps(emb).encode(), 0.0))
    assert out == {"embedding": [1.0]}
    with pytest.raises(json.JSONDecodeError):
        OllamaAnswer("m", "chat").whole(b"<html>", 0.0)


@pytest.mark.parametrize(
    "raw", [1e308, 1e12, 10**400, "99999999999999999h", "1" * 400, "inf", float("inf")]
)
def test_a_keep_alive_past_gos_largest_duration_is_forever(raw: Any) -> None:
    """Past 292 years (1e308 once made /api/ps answer 500 for every client, and 400
    digits a plain-text 500)."""
    assert keep_alive_s(raw) == math.inf


def test_options_set_generation_fields_only() -> None:
    """`options` never names the model, the messages or the stream (`options:
    {"model": ...}` chose the upstream model, past `upstream_model`)."""
    hostile = {
        "model": "gpt-4o", "messages": [], "stream": False, "tools": [1], "prompt": "x",
        "id_slot": 3, "n_probs": 5, "max_tokens": 1, "response_format": {"type": "text"},
    }  # fmt: skip
    options = {**hostile, "temperature": 0.5, "num_keep": 4, "repeat_last_n": 64}
    chat = chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "options": options}, "served"
    )
    _, generated = generate_request({"prompt": "hi", "options": options}, "served")
    for out in (chat, generated):
        assert out["model"] == "served"
        assert out["stream"] is True
        assert (out["temperature"], out["n_keep"], out["repeat_last_n"]) == (0.5, 4, 64)
        assert not {"tools", "prompt", "id_slot", "n_probs", "max_tokens"} & set(out)
        assert "response_format" not in out
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("think", "effort"), [("low", "low"), ("medium", "medium"), ("high", "high"), ("max", "high")]
)
def test_every_thinking_level_ollama_documents_is_taken(think: str, effort: str) -> None:
    """`think: "max"` got a 400."""
    out = chat_request({"messages": [{"role": "user", "content": "hi"}], "think": think}, "m")
    assert out["chat_template_kwargs"] == {"enable_thinking": True}
    assert out["reasoning_effort"] == effort
