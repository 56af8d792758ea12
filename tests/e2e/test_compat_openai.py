"""OpenAI's and Anthropic's APIs compatibility suite: the documented requests of the
Responses API, structured output through the clients' own `parse` helpers on ordinary pydantic
models, and Anthropic's Messages streamed and with tools, through `corral serve` over the sim
model (what `make run` serves), with the official `openai` and `anthropic` clients, LangChain's
`ChatOpenAI` and `ChatOllama`, and raw HTTP for the framing. Every answer is read by the
client's strict validation; the real llama-server's /v1/responses is in test_models_folder.py.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.support.gateway import SIM, Gateway, serve

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
models:
  gpt-sim:
    load_s: 0.2
    capabilities: {{tools: true}}
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 4
server:
  log_dir: LOG_DIR
"""
    folder: Path = tmp_path_factory.mktemp("openai-compat")
    with serve(folder, config) as g:
        yield g


# Ordinary pydantic models, as the clients' own examples use them: nesting ($defs and $ref),
# lists, enums, optional fields, literals, dates and bounds.
class Step(BaseModel):
    explanation: str
    output: str


class MathResponse(BaseModel):
    steps: list[Step]
    final_answer: str


class Table(enum.StrEnum):
    orders = "orders"
    customers = "customers"


class Operator(enum.StrEnum):
    eq = "="
    gt = ">"


class DynamicValue(BaseModel):
    column_name: str


class Condition(BaseModel):
    column: str
    operator: Operator
    value: str | int | DynamicValue


class Query(BaseModel):
    table_name: Table
    columns: list[str]
    conditions: list[Condition]
    order_by: Literal["asc", "desc"]


class Event(BaseModel):
    name: str
    day: date
    guests: int = Field(ge=1, le=500)
    notes: str | None = None
    tags: list[str] = Field(default_factory=list, max_length=3)


def client(gw: Gateway) -> openai.OpenAI:
    return gw.client(max_retries=0)


# --- the Responses API ------------------------------------------------------------------------


def test_responses_plain_whole_and_streamed(gw: Gateway) -> None:
    """Item 10: every Responses example got a 404 through `make run`."""
    c = client(gw)
    whole = c.responses.create(model="gpt-sim", input="Tell me a three sentence story.")
    assert whole.object == "response"
    assert whole.status == "completed"
    assert whole.output_text
    assert whole.usage is not None
    assert whole.usage.output_tokens == len(whole.output_text.split())
    events = list(c.responses.create(model="gpt-sim", input="Tell me a story.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert text == done[0].text
    capped = c.responses.create(model="gpt-sim", input="x", max_output_tokens=3)
    assert capped.status == "incomplete"
    assert capped.incomplete_details is not None
    assert capped.incomplete_details.reason == "max_output_tokens"


def test_responses_with_instructions_and_input_items(gw: Gateway) -> None:
    c = client(gw)
    answer = c.responses.create(
        model="gpt-sim",
        instructions="Talk like a pirate.",
        input=[
            {"role": "user", "content": "Are semicolons optional in JavaScript?"},
            {"role": "assistant", "content": "Arr, mostly."},
            {"role": "user", "content": [{"type": "input_text", "text": "And in Python?"}]},
        ],
    )
    assert answer.output_text
    assert answer.instructions == "Talk like a pirate."


def test_responses_structured_output_parse_and_stream(gw: Gateway) -> None:
    c = client(gw)
    parsed = c.responses.parse(model="gpt-sim", input="solve 8x + 31 = 2", text_format=MathResponse)
    assert isinstance(parsed.output_parsed, MathResponse)
    assert parsed.output_parsed.steps
    with c.responses.stream(
        model="gpt-sim", input="solve 8x + 31 = 2", text_format=MathResponse
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.done" in kinds
    assert isinstance(final.output_parsed, MathResponse)
    raw = httpx.post(
        f"{gw.url}/v1/responses",
        json={
            "model": "gpt-sim",
            "input": "plan a party",
            "text": {"format": {"type": "json_schema", "name": "event",
                                "schema": Event.model_json_schema()}},
        },
        timeout=30,
    )  # fmt: skip
    Event.model_validate_json(raw.json()["output"][0]["content"][0]["text"])


def test_responses_tools_call_then_answer(gw: Gateway) -> None:
    c = client(gw)
    ask = "look up all my orders in november that were not delivered on time"
    called = c.responses.parse(
        model="gpt-sim", input=ask, tools=[openai.pydantic_function_tool(Query)]
    )
    call = called.output[0]
    assert call.type == "function_call"
    assert isinstance(call.parsed_arguments, Query)
    with c.responses.stream(
        model="gpt-sim", input=ask, tools=[openai.pydantic_function_tool(Query)]
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call"
    # The tool's output goes back as an input item; the model answers in text.
    after = c.responses.create(
        model="gpt-sim",
        input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "3 orders"},
        ],
        tools=[{"type": "function", "name": "Query", "parameters": Query.model_json_schema(),
                "strict": False}],
    )  # fmt: skip
    assert after.output[0].type == "message"
    assert after.output_text


def test_responses_sse_framing_names_each_event(gw: Gateway) -> None:
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/responses",
        json={"model": "gpt-sim", "input": "hi", "stream": True, "max_output_tokens": 2},
        timeout=30,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    for block in body.strip().split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")


def test_stored_responses_are_refused_with_the_way_round(gw: Gateway) -> None:
    """Corral and the servers behind it keep no responses: asking for one, or continuing from
    one, is a clear error in OpenAI's shape, not a bare 404."""
    c = client(gw)
    with pytest.raises(openai.NotFoundError) as read:
        c.responses.retrieve("resp_123")
    assert "keeps no responses" in str(read.value)
    assert "/upstream/" in str(read.value)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete("resp_123")
    with pytest.raises(openai.BadRequestError) as follow:
        c.responses.create(model="gpt-sim", input="and then?", previous_response_id="resp_1")
    assert "previous_response_id" in str(follow.value)


# --- structured output on the chat route ------------------------------------------------------


def test_chat_parse_with_ordinary_pydantic_models(gw: Gateway) -> None:
    """Item 9: the sim answered $ref, optional fields and enums with a placeholder that
    openai's `parse` could not validate."""
    c = client(gw)
    for model in (MathResponse, Query, Event):
        done = c.chat.completions.parse(
            model="gpt-sim",
            messages=[{"role": "user", "content": "fill it in"}],
            response_format=model,
        )
        assert isinstance(done.choices[0].message.parsed, model)
    tool = c.chat.completions.parse(
        model="gpt-sim",
        messages=[{"role": "user", "content": "find late orders"}],
        tools=[openai.pydantic_function_tool(Query)],
    )
    calls = tool.choices[0].message.tool_calls or []
    assert isinstance(calls[0].function.parsed_arguments, Query)


def test_langchain_structured_output_over_both_doors(gw: Gateway) -> None:
    chat = ChatOpenAI(model="gpt-sim", base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    for method in ("json_schema", "function_calling"):
        got = chat.with_structured_output(Query, method=method).invoke("late orders")
        assert isinstance(got, Query), method
    local = ChatOllama(model="gpt-sim", base_url=gw.url)
    got = local.with_structured_output(Event, method="json_schema").invoke("plan a party")
    assert isinstance(got, Event)
    got = local.with_structured_output(MathResponse, method="function_calling").invoke("8x = 2")
    assert isinstance(got, MathResponse)


def test_chat_thinking_and_embeddings_of_any_dimension(gw: Gateway) -> None:
    c = client(gw)
    thought = c.chat.completions.create(
        model="gpt-sim", messages=[{"role": "user", "content": "think"}], reasoning_effort="high"
    )
    extra = thought.choices[0].message.model_extra or {}
    assert extra.get("reasoning_content")
    for dims in (1, 384, 1536):
        e = c.embeddings.create(model="gpt-sim", input=["a", "b"], dimensions=dims)
        assert [len(d.embedding) for d in e.data] == [dims, dims]
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="gpt-sim", input="a", dimensions=0)


# --- Anthropic's Messages API -----------------------------------------------------------------


def test_anthropic_messages_whole_streamed_tools_and_thinking(gw: Gateway) -> None:
    """Item 10: the anthropic SDK failed with a bare AssertionError on a stream."""
    a = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "Hello, Claude"}]
    whole = a.messages.create(model="gpt-sim", max_tokens=6, messages=hello)  # type: ignore[arg-type]
    assert whole.stop_reason == "max_tokens"
    assert whole.content[0].type == "text"
    with a.messages.stream(model="gpt-sim", max_tokens=6, messages=hello) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.usage.output_tokens == 6
    tools = [
        {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "input_schema": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        }
    ]
    ask = [{"role": "user", "content": "What's the weather like in San Francisco?"}]
    used = a.messages.create(model="gpt-sim", max_tokens=64, tools=tools, messages=ask)  # type: ignore[arg-type]
    assert used.stop_reason == "tool_use"
    block = used.content[0]
    assert block.type == "tool_use"
    assert block.input["unit"] == "celsius"
    with a.messages.stream(model="gpt-sim", max_tokens=64, tools=tools, messages=ask) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "tool_use"
    result = [
        *ask,
        {"role": "assistant", "content": used.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": "15 degrees"}]},
    ]  # fmt: skip
    after = a.messages.create(model="gpt-sim", max_tokens=4, tools=tools, messages=result)  # type: ignore[arg-type]
    assert after.content[0].type == "text"
    with a.messages.stream(
        model="gpt-sim",
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=hello,  # type: ignore[arg-type]
    ) as stream:
        thought = stream.get_final_message()
    assert [b.type for b in thought.content] == ["thinking", "text"]


def test_token_counts_and_audio_translations_reach_the_model(gw: Gateway) -> None:
    """openai-python's responses_input_tokens.py got a 405, audio.py a 404 on translations."""
    c = client(gw)
    counted = c.responses.input_tokens.count(model="gpt-sim", input="one two three")
    assert counted.input_tokens == 3
    a = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    tokens = a.messages.count_tokens(
        model="gpt-sim", messages=[{"role": "user", "content": "one two"}]
    )
    assert tokens.input_tokens == 2
    heard = c.audio.translations.create(model="gpt-sim", file=("a.mp3", b"ID3abc"))
    assert "6 bytes" in heard.text


def test_the_responses_websocket_is_refused_with_its_reason(gw: Gateway) -> None:
    """The Responses API's WebSocket mode keeps responses: refused in its own error event and
    the close's reason (it was a bare HTTP 403)."""
    c = client(gw)
    with c.responses.connect() as connection:
        first = connection.recv()  # said at once, before any request
        assert first.type == "error"
        assert "over HTTP only" in first.error.message


def test_anthropic_errors_come_in_anthropics_shape(gw: Gateway) -> None:
    """The gateway's own refusals on /v1/messages came in OpenAI's shape; the anthropic SDK
    reads `error.type` and `error.message` of its own."""
    a = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        a.messages.create(model="nope", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    body = missing.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "gpt-sim" in body["error"]["message"]  # names what is served
    for path in ("/v1/messages", "/v/messages"):
        bad = httpx.post(f"{gw.url}{path}", content=b"{not json", timeout=30)
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert bad.json()["type"] == "error"
    server_said = httpx.post(f"{gw.url}/v1/messages", json={"model": "gpt-sim"}, timeout=30)
    assert server_said.status_code == 400  # the server's own Anthropic error, as it came
    assert (
        "max_tokens" in server_said.json()["error"]["message"]
        or "messages" in (server_said.json()["error"]["message"])
    )


def test_a_route_the_server_lacks_is_named_in_the_error(gw: Gateway) -> None:
    """A server without a route (no image generation here; an older llama-server has no
    /v1/responses) answered a bare 404 "Not Found": the error now names the route."""
    with pytest.raises(openai.NotFoundError) as lacking:
        client(gw).images.generate(model="gpt-sim", prompt="a sunset")
    assert "answered 404 to /v1/images/generations" in str(lacking.value)
