"""Ollama's API compatibility suite: each request example of Ollama's API
documentation (docs/api.md: generate, chat, embed, the model commands), written here from the
docs, sent as raw HTTP and through the official `ollama` client, and its answer checked against
the documented shape: fields and their types, NDJSON framing, status codes, error shape.

The models are sim backends (what `make run` serves); what depends on a real model
(logprobs, fill-in-the-middle refused by a model without FIM tokens, embeddings) is over the
packaged gemma GGUF in test_models_folder.py.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from pydantic import BaseModel

from tests.support.gateway import KEY, SIM, Gateway, serve

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {KEY}"}
# A 1x1 PNG, as the docs' image examples send one (base64, no data: prefix).
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
models:
  llama3.2:
    load_s: 0.2
    capabilities: {{tools: true, context: 4096}}
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 2
  all-minilm:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
"""
    folder: Path = tmp_path_factory.mktemp("ollama-compat")
    with serve(folder, config) as g:
        yield g


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", headers=AUTH, json=body, timeout=30)


def lines(r: httpx.Response) -> list[dict[str, Any]]:
    """An NDJSON answer: one JSON object a line, every line whole."""
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert r.text.endswith("\n")
    return [json.loads(line) for line in r.text.splitlines()]


DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def final_fields(obj: dict[str, Any], model: str, context: bool = False) -> None:
    """The documented final object of /api/generate or /api/chat."""
    assert obj["model"] == model
    assert obj["created_at"].endswith("Z")
    assert obj["done"] is True
    assert obj["done_reason"] in ("stop", "length")
    for key in DURATIONS:
        assert isinstance(obj[key], int), key
        assert obj[key] >= 0, key
    assert obj["total_duration"] >= obj["load_duration"]
    assert isinstance(obj["prompt_eval_count"], int)
    assert isinstance(obj["eval_count"], int)
    assert obj["eval_count"] > 0
    if context:
        assert isinstance(obj["context"], list)
        assert all(isinstance(x, int) for x in obj["context"])
    else:
        assert "context" not in obj


# --- /api/generate -------------------------------------------------------------------------


def test_generate_streamed_by_default_in_ndjson(gw: Gateway) -> None:
    """Generate a completion (streaming): a line a token, then the final line with the
    statistics and `context`."""
    out = lines(post(gw, "/api/generate", {"model": "llama3.2", "prompt": "Why is the sky blue?"}))
    *tokens, last = out
    assert tokens
    assert all(t["done"] is False and isinstance(t["response"], str) for t in tokens)
    assert all(t["model"] == "llama3.2" and "created_at" in t for t in tokens)
    assert last["response"] == ""
    final_fields(last, "llama3.2", context=True)


def test_generate_whole_with_stream_false(gw: Gateway) -> None:
    r = post(gw, "/api/generate", {"model": "llama3.2", "prompt": "Why?", "stream": False})
    assert r.status_code == 200
    obj = r.json()
    assert isinstance(obj["response"], str)
    assert obj["response"]
    final_fields(obj, "llama3.2", context=True)


def test_generate_context_continues_the_conversation(gw: Gateway) -> None:
    """Item 6: `context` came back missing; older clients pass it back to continue. It carries
    the conversation, so the next answer sees the first exchange."""
    c = ollama.Client(host=gw.url, headers=AUTH)
    first = c.generate(model="llama3.2", prompt="my name is Ada", options={"num_predict": 3})
    assert first.context
    again = c.generate(
        model="llama3.2",
        prompt="what is my name?",
        context=first.context,
        options={"num_predict": 3},
    )
    alone = c.generate(model="llama3.2", prompt="what is my name?", options={"num_predict": 3})
    # The sim's prompt count is its words: the context's turns (4 + 3 words) were sent too.
    assert again.prompt_eval_count == (alone.prompt_eval_count or 0) + 4 + 3
    assert again.context
    assert len(again.context) > len(first.context)
    streamed = list(
        c.generate(
            model="llama3.2", prompt="and then?", context=again.context, stream=True,
            options={"num_predict": 2},
        )
    )  # fmt: skip
    assert streamed[-1].context
    assert len(streamed[-1].context) > len(again.context)
    # A context from another server (token ids) is refused, naming the field and the fix.
    with pytest.raises(ollama.ResponseError) as foreign:
        c.generate(model="llama3.2", prompt="x", context=[1, 2, 3])
    assert foreign.value.status_code == 400
    assert "context" in foreign.value.error
    assert "/api/chat" in foreign.value.error
    damaged = [*first.context[:-1], 2**24 - 1]
    with pytest.raises(ollama.ResponseError) as bad:
        c.generate(model="llama3.2", prompt="x", context=damaged)
    assert bad.value.status_code == 400


def test_generate_with_suffix_fills_the_middle(gw: Gateway) -> None:
    """Item 4: `suffix` was sent as a chat and ignored; it goes to the server's /infill."""
    prefix, suffix = "def compute_gcd(a, b):", "    return result"
    body = {
        "model": "llama3.2",
        "prompt": prefix,
        "suffix": suffix,
        "options": {"temperature": 0},
        "stream": False,
    }
    obj = post(gw, "/api/generate", body).json()
    assert obj["response"]
    final_fields(obj, "llama3.2")  # no context for an insert, as Ollama
    assert obj["prompt_eval_count"] == 5  # the prefix's and the suffix's words reached /infill
    c = ollama.Client(host=gw.url, headers=AUTH)
    other = c.generate(model="llama3.2", prompt="def compute_gcd(a, b):", suffix="    pass")
    assert other.response != obj["response"]  # the suffix counts
    pieces = list(c.generate(model="llama3.2", prompt=prefix, suffix=suffix, stream=True))
    assert "".join(p.response or "" for p in pieces) == obj["response"]
    assert pieces[-1].done
    assert pieces[-1].eval_count == obj["eval_count"]


def test_generate_structured_outputs_and_json_mode(gw: Gateway) -> None:
    class Answer(BaseModel):
        age: int
        available: bool

    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}, "available": {"type": "boolean"}},
        "required": ["age", "available"],
    }
    obj = post(
        gw,
        "/api/generate",
        {
            "model": "llama3.2",
            "prompt": "Ollama is 22 years old",
            "format": schema,
            "stream": False,
        },
    ).json()
    Answer.model_validate_json(obj["response"])
    obj = post(
        gw,
        "/api/generate",
        {"model": "llama3.2", "prompt": "colours as JSON", "format": "json", "stream": False},
    ).json()
    assert isinstance(json.loads(obj["response"]), dict)


def test_generate_with_images_raw_seed_and_every_option(gw: Gateway) -> None:
    with_image = post(
        gw,
        "/api/generate",
        {
            "model": "llama3.2",
            "prompt": "What is in this picture?",
            "stream": False,
            "images": [PNG],
        },
    )
    assert with_image.status_code == 200, with_image.text
    raw = post(
        gw,
        "/api/generate",
        {"model": "llama3.2", "prompt": "[INST] why? [/INST]", "raw": True, "stream": False},
    ).json()
    assert raw["response"]
    final_fields(raw, "llama3.2")  # raw: no context, as documented
    seeded = {"seed": 123, "temperature": 0}
    same = [
        post(
            gw,
            "/api/generate",
            {"model": "llama3.2", "prompt": "Why?", "options": seeded, "stream": False},
        ).json()["response"]
        for _ in range(2)
    ]
    assert same[0] == same[1]
    every = {
        "num_keep": 5, "seed": 42, "num_predict": 100, "top_k": 20, "top_p": 0.9, "min_p": 0.0,
        "typical_p": 0.7, "repeat_last_n": 33, "temperature": 0.8, "repeat_penalty": 1.2,
        "presence_penalty": 1.5, "frequency_penalty": 1.0, "penalize_newline": True,
        "stop": ["\n", "user:"], "numa": False, "num_ctx": 1024, "num_batch": 2, "num_gpu": 1,
        "main_gpu": 0, "use_mmap": True, "num_thread": 8,
    }  # fmt: skip
    obj = post(
        gw,
        "/api/generate",
        {"model": "llama3.2", "prompt": "Why?", "stream": False, "options": every},
    ).json()
    final_fields(obj, "llama3.2", context=True)
    assert obj["eval_count"] == 100  # num_predict reached the server; the runner's were let be


def test_generate_think_returns_thinking(gw: Gateway) -> None:
    for think in (True, "low", "high", "max"):
        obj = post(
            gw,
            "/api/generate",
            {"model": "llama3.2", "prompt": "how many r in strawberry?", "think": think,
             "stream": False},
        ).json()  # fmt: skip
        assert obj["thinking"], think
        assert obj["response"]
    off = post(
        gw,
        "/api/generate",
        {"model": "llama3.2", "prompt": "x", "think": False, "stream": False},
    ).json()
    assert "thinking" not in off


def test_load_and_unload_with_an_empty_prompt(gw: Gateway) -> None:
    loaded = post(gw, "/api/generate", {"model": "llama3.2"}).json()
    assert loaded["done"] is True
    assert loaded["done_reason"] == "load"
    assert loaded["response"] == ""
    gone = post(gw, "/api/generate", {"model": "llama3.2", "keep_alive": 0}).json()
    assert gone["done"] is True
    assert gone["done_reason"] == "unload"
    loaded = post(gw, "/api/chat", {"model": "llama3.2", "messages": []}).json()
    assert loaded["done_reason"] == "load"
    assert loaded["message"]["content"] == ""


# --- /api/chat ----------------------------------------------------------------------------


def test_chat_streamed_whole_history_images_and_seed(gw: Gateway) -> None:
    hello = [{"role": "user", "content": "why is the sky blue?"}]
    *tokens, last = lines(post(gw, "/api/chat", {"model": "llama3.2", "messages": hello}))
    assert tokens
    assert all(t["message"]["role"] == "assistant" for t in tokens)
    assert all(t["done"] is False for t in tokens)
    final_fields(last, "llama3.2")
    assert last["message"] == {"role": "assistant", "content": ""}
    whole = post(gw, "/api/chat", {"model": "llama3.2", "messages": hello, "stream": False})
    obj = whole.json()
    assert obj["message"]["content"] == "".join(t["message"]["content"] for t in tokens)
    final_fields(obj, "llama3.2")
    history = [
        *hello,
        {"role": "assistant", "content": "due to rayleigh scattering."},
        {"role": "user", "content": "how is that different than mie scattering?"},
    ]
    assert post(gw, "/api/chat", {"model": "llama3.2", "messages": history, "stream": False})
    pictured = [{"role": "user", "content": "what is in this image?", "images": [PNG]}]
    r = post(gw, "/api/chat", {"model": "llama3.2", "messages": pictured, "stream": False})
    assert r.status_code == 200
    assert r.json()["message"]["content"]


def test_chat_structured_outputs_with_a_pydantic_schema(gw: Gateway) -> None:
    """Item 9: the sim answered nested models, optional fields and enums with a placeholder
    the model did not validate."""

    class Colour(enum.StrEnum):
        red = "red"
        blue = "blue"

    class Pet(BaseModel):
        name: str
        animal: str
        age: int
        colour: Colour
        favourite_toy: str | None = None

    class PetList(BaseModel):
        pets: list[Pet]

    c = ollama.Client(host=gw.url, headers=AUTH)
    answer = c.chat(
        model="llama3.2",
        messages=[{"role": "user", "content": "I have two cats, Luna and Loki"}],
        format=PetList.model_json_schema(),
    )
    pets = PetList.model_validate_json(answer.message.content or "")
    assert pets.pets
    assert pets.pets[0].colour in Colour


def test_chat_tools_whole_and_streamed(gw: Gateway) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather for a location",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "description": "The city"},
                        "format": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["location", "format"],
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "What is the weather today in Paris?"}]
    obj = post(
        gw, "/api/chat", {"model": "llama3.2", "messages": ask, "tools": tools, "stream": False}
    ).json()
    calls = obj["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_current_weather"
    args = calls[0]["function"]["arguments"]
    assert isinstance(args, dict)
    assert args["format"] == "celsius"
    out = lines(post(gw, "/api/chat", {"model": "llama3.2", "messages": ask, "tools": tools}))
    streamed = [t for line in out for t in line["message"].get("tool_calls", [])]
    assert streamed == calls
    final_fields(out[-1], "llama3.2")


def test_chat_think_returns_the_thinking_in_the_message(gw: Gateway) -> None:
    c = ollama.Client(host=gw.url, headers=AUTH)
    ask = [{"role": "user", "content": "what is 10 + 23?"}]
    whole = c.chat(model="llama3.2", messages=ask, think=True)
    assert whole.message.thinking
    assert whole.message.content
    parts = list(c.chat(model="llama3.2", messages=ask, think="max", stream=True))
    assert "".join(p.message.thinking or "" for p in parts)
    assert "".join(p.message.content or "" for p in parts)


# --- embeddings and the model commands ------------------------------------------------------


def test_embed_single_many_truncate_dimensions_and_the_older_route(gw: Gateway) -> None:
    one = post(gw, "/api/embed", {"model": "all-minilm", "input": "Why is the sky blue?"}).json()
    assert one["model"] == "all-minilm"
    assert len(one["embeddings"]) == 1
    assert all(isinstance(x, float) for x in one["embeddings"][0])
    for key in ("total_duration", "load_duration", "prompt_eval_count"):
        assert isinstance(one[key], int), key
    many = post(
        gw,
        "/api/embed",
        {"model": "all-minilm", "input": ["Why is the sky blue?", "Why is the grass green?"]},
    ).json()
    assert len(many["embeddings"]) == 2
    assert many["embeddings"][0] == one["embeddings"][0]
    sized = post(
        gw,
        "/api/embed",
        {"model": "all-minilm", "input": "x", "truncate": False, "dimensions": 8,
         "options": {"temperature": 0}, "keep_alive": "5m"},
    ).json()  # fmt: skip
    assert len(sized["embeddings"][0]) == 8
    old = post(gw, "/api/embeddings", {"model": "all-minilm", "prompt": "Here is an article"})
    assert set(old.json()) == {"embedding"}


def test_the_model_commands_list_show_ps_version_and_the_store_refusals(gw: Gateway) -> None:
    tags = httpx.get(f"{gw.url}/api/tags", headers=AUTH).json()["models"]
    for m in tags:
        assert set(m) >= {"name", "model", "modified_at", "size", "digest", "details"}
        assert set(m["details"]) >= {"format", "family", "parameter_size", "quantization_level"}
    assert {m["name"] for m in tags} == {"llama3.2:latest", "all-minilm:latest"}
    shown = post(gw, "/api/show", {"model": "llama3.2"}).json()
    assert set(shown) >= {"modelfile", "parameters", "template", "details", "model_info"}
    assert "tools" in shown["capabilities"]
    post(
        gw,
        "/api/generate",
        {"model": "llama3.2", "prompt": "x", "stream": False, "keep_alive": "5m"},
    )
    running = httpx.get(f"{gw.url}/api/ps", headers=AUTH).json()["models"]
    assert running
    assert set(running[0]) >= {"name", "model", "size", "digest", "expires_at"}
    assert isinstance(running[0]["size_vram"], int)
    version = httpx.get(f"{gw.url}/api/version", headers=AUTH).json()
    assert set(version) >= {"version"}
    for path, body in (
        ("/api/create", {"model": "mario", "from": "llama3.2", "system": "You are Mario."}),
        ("/api/copy", {"source": "llama3.2", "destination": "llama3-backup"}),
        ("/api/push", {"model": "mattw/pygmalion:latest"}),
    ):
        r = post(gw, path, body)
        assert r.status_code == 501, path
        assert set(r.json()) == {"error"}, path
    r = httpx.request("DELETE", f"{gw.url}/api/delete", headers=AUTH, json={"model": "llama3:13b"})
    assert r.status_code == 501
    assert set(r.json()) == {"error"}
    pulled = post(gw, "/api/pull", {"model": "llama3.2"})
    assert lines(pulled)[-1] == {"status": "success"}
    assert post(gw, "/api/pull", {"model": "llama3.2", "stream": False}).json() == {
        "status": "success"
    }


def test_errors_are_one_error_field_with_the_documented_status(gw: Gateway) -> None:
    missing = post(gw, "/api/generate", {"model": "nope", "prompt": "x"})
    assert missing.status_code == 404
    assert set(missing.json()) == {"error"}
    for body in (
        {"model": "llama3.2", "prompt": 3},
        {"model": "llama3.2", "prompt": "x", "suffix": 3},
        {"model": "llama3.2", "prompt": "x", "think": "extreme"},
        {"model": "llama3.2", "prompt": "x", "logprobs": True, "top_logprobs": 99},
        {"model": "llama3.2", "prompt": "x", "format": 7},
    ):
        r = post(gw, "/api/generate", body)
        assert r.status_code == 400, body
        assert set(r.json()) == {"error"}, body
