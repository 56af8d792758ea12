"""pydantic-ai with a tool and structured output, as its docs write it: the default output mode
(an output tool the model must call), a plain tool before it. Prints one JSON line: the output,
or the model's error where pydantic-ai gave up on what the model said."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


class Forecast(BaseModel):
    city: str
    summary: str
    temperature_c: float


def main(url: str, model_name: str, cap: str = "0") -> None:
    """`cap`: max_tokens per answer (a real small model may never stop), 0 for none."""
    model = OpenAIChatModel(
        model_name, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="corral")
    )
    agent = Agent(
        model,
        output_type=Forecast,
        instructions="Look the weather up with get_weather, then give the forecast.",
        model_settings={"max_tokens": int(cap)} if int(cap) else None,
    )
    asked: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny and 21 C in {city}"

    try:
        result = agent.run_sync("What is the weather in Paris?")
    except UnexpectedModelBehavior as exc:
        # What the model said broke pydantic-ai's own rules (an output that never validates,
        # an answer cut at the cap): the model's doing, said as such. An HTTP error is not
        # caught: it is Corral's.
        print(json.dumps({"output": None, "tool_calls": len(asked),
                          "model_error": f"{type(exc).__name__}: {exc}"[:300]}))  # fmt: skip
        return
    out = {"output": result.output.model_dump(), "tool_calls": len(asked),
           "requests": result.usage().requests}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
