"""smolagents' ToolCallingAgent with a tool, as its docs write it, on a Corral model through
`OpenAIServerModel`: it must call tools (its own `final_answer` ends the run). Prints one JSON
line."""

from __future__ import annotations

import json
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


def main(url: str, model_name: str) -> None:
    asked: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        asked.append(city)
        return f"sunny and 21 C in {city}"

    model = OpenAIServerModel(model_id=model_name, api_base=f"{url}/v1", api_key="corral")
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")
    steps = len(agent.memory.steps)
    print(json.dumps({"answer": str(answer)[:200], "tool_calls": len(asked), "steps": steps}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
