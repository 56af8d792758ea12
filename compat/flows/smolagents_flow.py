"""smolagents' ToolCallingAgent with a tool, as its docs write it, on a Corral model through
`OpenAIServerModel`: it must call tools (its own `final_answer` ends the run). Prints one JSON
line."""

from __future__ import annotations

import json
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


def main(url: str, model_name: str, cap: str = "0") -> None:
    """`cap`: max_tokens per answer (a real small model may never stop), 0 for none."""
    asked: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        asked.append(city)
        return f"sunny and 21 C in {city}"

    limit = {"max_tokens": int(cap)} if int(cap) else {}
    model = OpenAIServerModel(model_id=model_name, api_base=f"{url}/v1", api_key="corral", **limit)
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")
    steps = len(agent.memory.steps)
    print(json.dumps({"answer": str(answer)[:200], "tool_calls": len(asked), "steps": steps}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
