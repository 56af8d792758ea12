"""The simulated server answers like a model: a natural length that a cap cuts,
`finish_reason` stop unless it did, `tool_choice` and `stop` honoured, usage as said. Driven
by the official `openai` and `anthropic` clients against `corral sim-backend --answer-tokens`,
a real process, with the requests the agent tools send."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.integration.test_sim_backend import Sim, start_sim

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "final_result",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "score": {"type": "integer"}},
                "required": ["city", "score"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with start_sim("--answer-tokens", "40", "--tokens-per-s", "5000", "--load-s", "0") as s:
        s.wait_healthy()
        yield s


def test_an_answer_ends_by_itself_whatever_max_tokens_a_client_sends(sim: Sim) -> None:
    """OpenCode's 32,000 and aider's none: a natural answer (20-60 tokens here), finish
    `stop`, usage counting what was said; a smaller cap cuts it, finish `length`."""
    c = sim.client()
    for limit in (32000, None):
        r = c.chat.completions.create(
            model="sim-a",
            messages=[{"role": "user", "content": "write a title"}],
            max_tokens=openai.omit if limit is None else limit,
        )
        said = (r.choices[0].message.content or "").split()
        assert 20 <= len(said) <= 60
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None
        assert r.usage.completion_tokens == len(said)
    cut = c.chat.completions.create(
        model="sim-a", messages=[{"role": "user", "content": "write a title"}], max_tokens=5
    )
    assert len((cut.choices[0].message.content or "").split()) == 5
    assert cut.choices[0].finish_reason == "length"
    streamed = c.chat.completions.create(
        model="sim-a",
        messages=[{"role": "user", "content": "write a title"}],
        max_tokens=32000,
        stream=True,
    )
    finishes = [ch.choices[0].finish_reason for ch in streamed if ch.choices]
    assert finishes[-1] == "stop"
    assert 20 <= len(finishes) - 1 <= 60
    done = c.completions.create(model="sim-a", prompt="def f(", max_tokens=32000)
    assert done.choices[0].finish_reason == "stop"


def test_answers_vary_with_the_prompt_and_repeat_for_the_same_one(sim: Sim) -> None:
    c = sim.client()
    lengths = {
        len(
            (
                c.chat.completions.create(
                    model="sim-a", messages=[{"role": "user", "content": f"question {i}"}]
                )
                .choices[0]
                .message.content
                or ""
            ).split()
        )
        for i in range(8)
    }
    assert len(lengths) > 1


def test_a_required_tool_choice_calls_a_tool_after_a_tools_answer(sim: Sim) -> None:
    """pydantic-ai's output tool: a function tool answered, then `required` again: the model
    calls the tool it has not called yet, its arguments valid for the schema."""
    c = sim.client()
    first = c.chat.completions.create(
        model="sim-a",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=32000,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    assert call.function.name == "read_file"
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.usage is not None
    assert first.usage.completion_tokens < 50
    history: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = c.chat.completions.create(
        model="sim-a", messages=history, tools=TOOLS, tool_choice="required"
    )
    final = (second.choices[0].message.tool_calls or [])[0]
    assert final.type == "function"
    assert final.function.name == "final_result"
    args = json.loads(final.function.arguments)
    assert isinstance(args["city"], str)
    assert isinstance(args["score"], int)
    talked = c.chat.completions.create(model="sim-a", messages=history, tools=TOOLS)
    assert talked.choices[0].message.tool_calls is None  # auto: after a tool's answer, it talks
    assert talked.choices[0].finish_reason == "stop"


def test_a_named_tool_choice_calls_that_tool_and_none_calls_none(sim: Sim) -> None:
    c = sim.client()
    ask: list[Any] = [{"role": "user", "content": "score it"}]
    named = c.chat.completions.create(
        model="sim-a",
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "final_result"}},
    )
    call = (named.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    assert call.function.name == "final_result"
    none = c.chat.completions.create(model="sim-a", messages=ask, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content


def test_stop_sequences_end_the_answer_before_them(sim: Sim) -> None:
    c = sim.client()
    ask: list[Any] = [{"role": "user", "content": "say something long"}]
    whole = c.chat.completions.create(model="sim-a", messages=ask).choices[0].message.content or ""
    stop = whole.split()[5]
    cut = c.chat.completions.create(model="sim-a", messages=ask, stop=[stop, "Observation:"])
    kept = whole[: whole.find(stop)].rstrip()  # the text before the stop's first occurrence
    assert (cut.choices[0].message.content or "") == kept
    assert len(kept) < len(whole)
    assert cut.choices[0].finish_reason == "stop"


def test_messages_and_responses_end_by_themselves_and_honour_tool_choice(sim: Sim) -> None:
    a = anthropic.Anthropic(base_url=sim.url, api_key="unused")
    said = a.messages.create(
        model="sim-a", max_tokens=8000, messages=[{"role": "user", "content": "hello"}]
    )
    assert said.stop_reason == "end_turn"
    assert said.usage.output_tokens <= 60
    cut = a.messages.create(
        model="sim-a", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 3
    text = " ".join(b.text for b in said.content if b.type == "text")
    stop = text.split()[2]
    stopped = a.messages.create(
        model="sim-a",
        max_tokens=8000,
        messages=[{"role": "user", "content": "hello"}],
        stop_sequences=[stop],
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    tools: list[Any] = [
        {"name": "look", "input_schema": {"type": "object", "properties": {}}},
        {"name": "answer", "input_schema": {"type": "object", "properties": {}}},
    ]
    answered: list[Any] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
    ]
    forced = a.messages.create(
        model="sim-a", max_tokens=100, messages=answered, tools=tools, tool_choice={"type": "any"}
    )
    assert [b.name for b in forced.content if b.type == "tool_use"] == ["answer"]

    o = sim.client()
    done = o.responses.create(model="sim-a", input="hello", max_output_tokens=32000)
    assert done.status == "completed"
    short = o.responses.create(model="sim-a", input="hello", max_output_tokens=16)
    assert short.status == "incomplete"
    named = o.responses.create(
        model="sim-a",
        input="go",
        tools=[
            {
                "type": "function",
                "name": "look",
                "parameters": {"type": "object", "properties": {}},
                "strict": False,
            },
            {
                "type": "function",
                "name": "answer",
                "parameters": {"type": "object", "properties": {}},
                "strict": False,
            },
        ],
        tool_choice={"type": "function", "name": "answer"},
    )
    assert [i.name for i in named.output if i.type == "function_call"] == ["answer"]


def test_a_call_kept_as_text_counts_as_made(sim: Sim) -> None:
    """smolagents keeps its calls as the assistant's text (`Calling tools: [...]`) and their
    results as the user's: the model reads the call as made and calls the next tool, as a
    model would, so smolagents' loop reaches its `final_answer` (it looped to max_steps)."""
    c = sim.client()
    calling = "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {'name': " \
        "'read_file', 'arguments': {'path': 'a'}}}]"  # fmt: skip
    history: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": calling}]},
        {"role": "user", "content": [{"type": "text", "text": "Observation:\nsunny"}]},
    ]
    out = c.chat.completions.create(
        model="sim-a", messages=history, tools=TOOLS, tool_choice="required"
    )
    call = (out.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    assert call.function.name == "final_result"
