"""The OpenAI Agents SDK's handoff with a tool, written as its docs write it: a triage agent on
one Corral model hands a weather question to a specialist on another, which calls its tool
(`tool_choice="required"`, reset by the SDK after the call) and answers. Prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


async def main(url: str, first: str, second: str, cap: str = "0") -> None:
    """`cap`: max_tokens per answer (a real small model may never stop), 0 for none."""
    limit = ModelSettings(max_tokens=int(cap)) if int(cap) else ModelSettings()
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="corral")
    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny and 21 C in {city}"

    specialist = Agent(
        name="Weather agent",
        instructions="You answer weather questions. Call get_weather, then answer in a sentence.",
        model=OpenAIChatCompletionsModel(model=second, openai_client=client),
        tools=[get_weather],
        model_settings=limit.resolve(ModelSettings(tool_choice="required")),
    )
    triage = Agent(
        name="Triage agent",
        instructions="Hand every weather question to the weather agent.",
        handoffs=[specialist],
        model=OpenAIChatCompletionsModel(model=first, openai_client=client),
        model_settings=limit,
    )
    result = await Runner.run(triage, "What is the weather in Paris?", max_turns=6)
    out = {"last_agent": result.last_agent.name, "tool_calls": len(asked),
           "final": str(result.final_output)[:200]}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
