"""Ollama's API through `corral serve`, driven by the official `ollama` client and LangChain's
`ChatOllama`/`OllamaEmbeddings`: list, show, ps, chat and generate plain and
streamed, tool calls, JSON formats, embeddings, keep_alive 0 and -1, errors in Ollama's shape,
and the same models through the official `openai` client. The models are sim backends (real
HTTP servers speaking OpenAI's API); the real gemma GGUF through this API is in
test_models_folder.py."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings

from tests.support.gateway import KEY, SIM, Gateway, serve

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
models:
  alpha:
    load_s: 0.2
    aliases: ["alpha:1b"]
    capabilities: {{tools: true, context: 4096}}
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 2
  beta:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
"""
    folder: Path = tmp_path_factory.mktemp("ollama-api")
    with serve(folder, config) as g:
        yield g


def client(gw: Gateway) -> ollama.Client:
    return ollama.Client(host=gw.url, headers=AUTH)


def text(s: str | None) -> str:
    assert s is not None
    return s


def state(gw: Gateway, model: str) -> str:
    status = httpx.get(f"{gw.url}/api/status", headers=AUTH).json()
    return str(status["models"][model]["state"])


def test_the_root_and_version_answer_as_ollama_does(gw: Gateway) -> None:
    assert httpx.get(f"{gw.url}/").text == "Ollama is running"
    assert httpx.head(f"{gw.url}/").status_code == 200
    version = httpx.get(f"{gw.url}/api/version", headers=AUTH).json()["version"]
    assert all(part.isdigit() for part in version.split("."))  # Open WebUI parses it with int()
    # Clients refuse a server older than the features they use (0.1.0 was refused).
    assert tuple(map(int, version.split("."))) >= (0, 13, 5)


def test_list_show_and_ps_with_the_official_client(gw: Gateway) -> None:
    c = client(gw)
    names = sorted(m.model or "" for m in c.list().models)
    assert names == ["alpha:latest", "beta:latest"]
    shown = c.show("alpha")
    assert shown.modelinfo is not None
    assert "general.architecture" in shown.modelinfo
    assert shown.capabilities is not None
    assert "tools" in shown.capabilities
    assert "completion" in (c.show("beta:latest").capabilities or [])
    c.generate(model="beta", prompt="hello", options={"num_predict": 2})
    running = {m.model: m for m in c.ps().models}
    assert "beta:latest" in running
    assert running["beta:latest"].expires_at is not None  # a datetime: ISO 8601 parsed


def test_chat_plain_and_streamed_with_the_official_client(gw: Gateway) -> None:
    c = client(gw)
    messages = [{"role": "user", "content": "say something"}]
    whole = c.chat(model="alpha", messages=messages, options={"num_predict": 5})
    assert whole.done
    assert whole.done_reason == "length"
    assert whole.message.role == "assistant"
    assert len(text(whole.message.content).split()) == 5
    assert whole.eval_count == 5
    assert whole.prompt_eval_count == 2
    assert whole.total_duration
    assert whole.total_duration >= (whole.load_duration or 0)
    parts = list(c.chat(model="alpha", messages=messages, stream=True, options={"num_predict": 5}))
    assert [p.done for p in parts] == [False] * 5 + [True]
    assert "".join(text(p.message.content) for p in parts) == whole.message.content  # deterministic
    assert parts[-1].eval_count == 5
    assert parts[-1].done_reason == "length"


def test_generate_plain_and_streamed_with_system_and_raw(gw: Gateway) -> None:
    c = client(gw)
    plain = c.generate(model="alpha:1b", prompt="one two", options={"num_predict": 3})
    assert plain.done
    assert len(text(plain.response).split()) == 3
    streamed = list(
        c.generate(model="alpha", prompt="one two", stream=True, options={"num_predict": 3})
    )
    assert streamed[-1].done
    assert "".join(text(p.response) for p in streamed) == plain.response
    raw = c.generate(model="alpha", prompt="one two", raw=True, options={"num_predict": 2})
    assert len(text(raw.response).split()) == 2
    system = c.generate(model="alpha", prompt="x", system="be brief", options={"num_predict": 1})
    assert system.prompt_eval_count == 3  # the system prompt reached the server with the prompt


def test_tool_calls_arrive_with_arguments_as_objects(gw: Gateway) -> None:
    def get_weather(city: str, days: int) -> str:
        """The weather in a city.

        Args:
            city: the city
            days: how many days
        """
        return "sunny"

    c = client(gw)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for stream in (False, True):
        if stream:
            chunks = list(
                c.chat(model="alpha", messages=messages, tools=[get_weather], stream=True)
            )
            calls = [t for ch in chunks for t in ch.message.tool_calls or []]
        else:
            calls = list(
                c.chat(model="alpha", messages=messages, tools=[get_weather]).message.tool_calls
                or []
            )
        assert [t.function.name for t in calls] == ["get_weather"]
        args = dict(calls[0].function.arguments)
        assert set(args) == {"city", "days"}  # an object, typed as the tool's schema says
        assert isinstance(args["city"], str)
        assert args["days"] == 1
    # The tool's answer goes back; the model then talks (the call's id was matched by name).
    after = c.chat(
        model="alpha",
        messages=[
            *messages,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}
                ],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        tools=[get_weather],
        options={"num_predict": 2},
    )
    assert not after.message.tool_calls
    assert len(text(after.message.content).split()) == 2


def test_json_format_and_schema(gw: Gateway) -> None:
    c = client(gw)
    messages = [{"role": "user", "content": "a city"}]
    as_json = c.chat(model="alpha", messages=messages, format="json")
    assert set(json.loads(text(as_json.message.content))) == {"answer"}
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
    }
    shaped = c.generate(model="alpha", prompt="a city", format=schema)
    shaped_answer = json.loads(text(shaped.response))
    assert set(shaped_answer) == {"city", "people"}
    assert isinstance(shaped_answer["city"], str)
    assert shaped_answer["people"] == 1


def test_embed_and_the_older_embeddings(gw: Gateway) -> None:
    c = client(gw)
    one = c.embed(model="beta", input="hello world")
    assert len(one.embeddings) == 1
    assert len(one.embeddings[0]) == 16
    two = c.embed(model="beta", input=["hello world", "goodbye"])
    assert len(two.embeddings) == 2
    assert two.embeddings[0] == one.embeddings[0]
    old = c.embeddings(model="beta", prompt="hello world")
    assert list(old.embedding) == one.embeddings[0]


def test_keep_alive_zero_unloads_and_minus_one_stays(gw: Gateway) -> None:
    c = client(gw)
    c.generate(model="beta", prompt="x", options={"num_predict": 1}, keep_alive=0)
    deadline = time.monotonic() + 30
    while state(gw, "beta") != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(gw, "beta") == "unloaded"
    loaded = c.generate(model="beta", prompt="", keep_alive=-1)  # an empty prompt loads
    assert loaded.done_reason == "load"
    assert state(gw, "beta") == "ready"
    ps = {m.model: m for m in c.ps().models}
    assert ps["beta:latest"].expires_at is not None
    assert ps["beta:latest"].expires_at.year > 2200
    # A soft pin (docs/design/sleep.md): never unloaded for idleness, evicted last.
    assert httpx.get(f"{gw.url}/api/status", headers=AUTH).json()["models"]["beta"]["pinned"]
    unloaded = c.generate(model="beta", prompt="", keep_alive=0)  # Open WebUI's "unload"
    assert unloaded.done_reason == "unload"
    deadline = time.monotonic() + 30
    while state(gw, "beta") != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(gw, "beta") == "unloaded"
    c.generate(model="beta", prompt="x", options={"num_predict": 1}, keep_alive="10m")
    status = httpx.get(f"{gw.url}/api/status", headers=AUTH).json()["models"]["beta"]
    assert status["ttl_s"] == 600
    assert 0 < status["unloads_in_s"] <= 600


def test_errors_come_in_ollamas_shape(gw: Gateway) -> None:
    c = client(gw)
    with pytest.raises(ollama.ResponseError) as missing:
        c.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404
    assert "alpha:latest" in missing.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        c.generate(model="alpha", prompt="x", keep_alive="soon")
    assert bad.value.status_code == 400
    assert "keep_alive" in bad.value.error
    r = httpx.post(f"{gw.url}/api/chat", headers=AUTH, content=b"{not json")
    assert r.status_code == 400
    assert set(r.json()) == {"error"}
    r = httpx.post(f"{gw.url}/api/chat", headers=AUTH, json={"model": "alpha", "messages": "hi"})
    assert r.status_code == 400
    assert "messages" in r.json()["error"]
    r = httpx.post(f"{gw.url}/api/chat", json={"model": "alpha", "messages": []})
    assert r.status_code == 401  # api_keys guard Ollama's routes too
    for path, method in (
        ("/api/push", "POST"),
        ("/api/create", "POST"),
        ("/api/copy", "POST"),
        ("/api/delete", "DELETE"),
    ):
        r = httpx.request(method, f"{gw.url}{path}", headers=AUTH, json={"model": "alpha"})
        assert r.status_code == 501, path
        assert "on disk" in r.json()["error"], path
    assert c.pull("alpha").status == "success"  # already here, as Ollama answers
    with pytest.raises(ollama.ResponseError) as absent:
        c.pull("llama3.2:3b")
    assert absent.value.status_code == 404
    assert "downloads nothing" in absent.value.error


def test_langchain_chat_ollama_and_embeddings(gw: Gateway) -> None:
    kwargs = {"base_url": gw.url, "client_kwargs": {"headers": AUTH}}
    llm = ChatOllama(model="alpha", num_predict=4, validate_model_on_init=True, **kwargs)
    answer = llm.invoke([HumanMessage("hello")])
    assert len(str(answer.content).split()) == 4
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["output_tokens"] == 4
    streamed = "".join(str(chunk.content) for chunk in llm.stream("hello"))
    assert streamed == answer.content

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    called = llm.bind_tools([add]).invoke("add 2 and 3")
    assert [c["name"] for c in called.tool_calls] == ["add"]
    assert called.tool_calls[0]["args"] == {"a": 2, "b": 3}  # read off the prompt, in turn
    vectors = OllamaEmbeddings(model="beta", **kwargs).embed_documents(["a", "b"])
    assert len(vectors) == 2
    assert len(vectors[0]) == 16


def test_the_same_models_through_the_openai_client(gw: Gateway) -> None:
    oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, _strict_response_validation=True)
    out = oa.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "say something"}], max_tokens=5
    )
    via_ollama = client(gw).chat(
        model="alpha",
        messages=[{"role": "user", "content": "say something"}],
        options={"num_predict": 5},
    )
    assert out.choices[0].message.content == via_ollama.message.content


def test_a_crash_mid_stream_ends_with_an_error_line_the_ollama_client_raises(gw: Gateway) -> None:
    c = client(gw)
    c.generate(model="beta", prompt="x", options={"num_predict": 1})
    got: list[str] = []

    def read() -> None:
        for part in c.chat(
            model="beta",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            options={"num_predict": 100_000},
        ):
            got.append(part.message.content or "")
            if len(got) == 3:
                status = httpx.get(f"{gw.url}/api/status", headers=AUTH).json()
                os.kill(status["models"]["beta"]["pid"], signal.SIGKILL)

    with pytest.raises(ollama.ResponseError) as info:
        read()
    assert len(got) >= 3
    assert "model beta: the answer was cut short (its server exited)" in info.value.error
    assert c.generate(model="beta", prompt="y", options={"num_predict": 1}).done  # back again


def test_a_client_that_leaves_mid_stream_frees_the_slot_at_once(gw: Gateway) -> None:
    """The relay under the Ollama translation is closed with it: nothing stays in flight."""
    with httpx.stream(
        "POST",
        f"{gw.url}/api/generate",
        headers=AUTH,
        json={"model": "alpha", "prompt": "x", "options": {"num_predict": 100_000}},
        timeout=30,
    ) as r:
        first = next(r.iter_lines())
        assert json.loads(first)["done"] is False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = httpx.get(f"{gw.url}/api/status", headers=AUTH).json()["models"]["alpha"]
        if status["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert status["in_flight"] == 0


def test_embed_with_dimensions_gives_vectors_of_that_length(gw: Gateway) -> None:
    """`dimensions` reaches the server (full-length vectors came back). The sim
    model honours it, its short vectors the start of its long ones scaled to unit length, as
    Ollama's are; over llama-server, which ignores the field, Corral cuts them
    (test_models_folder.py)."""
    c = client(gw)
    full = c.embed(model="beta", input=["hello world", "goodbye"]).embeddings
    short = c.embed(model="beta", input=["hello world", "goodbye"], dimensions=5).embeddings
    for whole, cut in zip(full, short, strict=True):
        assert len(cut) == 5
        assert sum(x * x for x in cut) == pytest.approx(1.0)
        scale = cut[0] / whole[0]
        assert cut == pytest.approx([x * scale for x in whole[:5]])
    assert len(c.embed(model="beta", input="x", dimensions=999).embeddings[0]) == 999
    with pytest.raises(ollama.ResponseError) as caught:
        c.embed(model="beta", input="x", dimensions=0)
    assert caught.value.status_code == 400
    assert "dimensions" in caught.value.error


def test_every_answer_has_one_date_one_server_and_a_request_id(gw: Gateway) -> None:
    """The model server's `Date` and `Server` came back beside uvicorn's, and there was no
    `x-request-id`, so the openai client's `request_id` was None."""
    oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    raw = oai.chat.completions.with_raw_response.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    answers: list[Any] = [raw.http_response]  # the openai client's httpx and ours
    with oai.chat.completions.with_streaming_response.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    ) as streamed:
        answers.append(streamed.http_response)
    for path, body in [
        ("/api/chat", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}),
        ("/api/generate", {"model": "beta", "prompt": "hi", "stream": False}),
        ("/api/chat", {"model": "nope", "messages": []}),  # a refusal too
    ]:
        answers.append(httpx.post(f"{gw.url}{path}", json=body, headers=AUTH, timeout=60))
    answers.append(httpx.get(f"{gw.url}/api/tags", headers=AUTH))
    for r in answers:
        assert len(r.headers.get_list("date")) == 1, r.request.url
        assert len(r.headers.get_list("server")) == 1, r.request.url
        assert r.headers["x-request-id"].startswith("req_")
    assert len({r.headers["x-request-id"] for r in answers}) == len(answers)
    mine = httpx.get(f"{gw.url}/api/tags", headers={**AUTH, "x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"


def test_logprobs_through_the_official_client_whole_and_streamed(gw: Gateway) -> None:
    """The client's own logprobs examples crashed: the fields were dropped and never asked of
    the model server."""
    c = client(gw)
    hi = [{"role": "user", "content": "hi! be concise."}]
    chat = c.chat(
        model="alpha", messages=hi, logprobs=True, top_logprobs=3, options={"num_predict": 4}
    )
    assert chat.logprobs is not None
    assert "".join(p.token for p in chat.logprobs) == chat.message.content
    for p in chat.logprobs:
        assert p.top_logprobs is not None
        assert len(p.top_logprobs) == 3
        assert p.top_logprobs[0].token == p.token
        assert all(a.logprob <= p.logprob for a in p.top_logprobs)
    gen = c.generate(model="beta", prompt="hi", logprobs=True, options={"num_predict": 4})
    assert gen.logprobs is not None
    assert "".join(p.token for p in gen.logprobs) == gen.response
    assert all(not p.top_logprobs for p in gen.logprobs)  # none asked for
    raw = c.generate(
        model="beta",
        prompt="hi",
        raw=True,
        logprobs=True,
        top_logprobs=2,
        options={"num_predict": 3},
    )
    assert raw.logprobs is not None
    assert [len(p.top_logprobs or []) for p in raw.logprobs] == [2] * len(raw.logprobs)
    parts = list(
        c.chat(model="alpha", messages=hi, logprobs=True, stream=True, options={"num_predict": 4})
    )
    streamed = [p for part in parts for p in part.logprobs or []]
    assert "".join(p.token for p in streamed) == "".join(
        part.message.content or "" for part in parts
    )
    plain = c.chat(model="alpha", messages=hi, options={"num_predict": 2})
    assert plain.logprobs is None  # not asked, not sent
    with pytest.raises(ollama.ResponseError) as caught:
        c.chat(model="alpha", messages=hi, logprobs=True, top_logprobs=21)
    assert caught.value.status_code == 400
    assert "top_logprobs" in caught.value.error


def test_a_model_servers_error_reaches_ollamas_clients_in_ollamas_shape(gw: Gateway) -> None:
    """The server's own error (OpenAI's shape: it takes at most 8,192 dimensions) is written
    once, by the Ollama door's dialect: `{"error": "<the server's message>"}`, its status, and
    the gateway's headers as on any answer."""
    with pytest.raises(ollama.ResponseError) as refused:
        client(gw).embed(model="alpha", input="x", dimensions=100_000)
    assert refused.value.status_code == 400
    assert "from 1 to 8192" in refused.value.error
    r = httpx.post(
        f"{gw.url}/api/embed",
        headers=AUTH,
        json={"model": "alpha", "input": "x", "dimensions": 100_000},
    )
    assert r.status_code == 400
    assert r.json() == {"error": "dimensions must be an integer from 1 to 8192"}
    assert r.headers["content-type"] == "application/json"
    assert "x-corral-wait-ms" in r.headers
