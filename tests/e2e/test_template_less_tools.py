"""Tools on GGUFs that carry no chat template, on the real llama-server through
`corral serve` with a models folder: Corral's template for the architecture (gemma3 here, the
packaged gemma; qwen3 and deepseek2, zoo files written without one, get ChatML's) takes `tools`
and the server answers with a parsed tool call. A configured llama-server started with
`--no-jinja` takes none: both doors refuse `tools` at once with the same 400 naming the model
and why, not a retryable 500, and nothing is loaded for it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from corral.modelfiles.folder import find_llama_server
from corral.zoo import make
from tests.e2e.test_models_folder import serving
from tests.support.gateway import Gateway
from tests.support.gemma import gemma_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("template-less")
    gemma_gguf(folder / "gemma.gguf")
    make("qwen3", folder, template=False)
    make("deepseek2", folder, template=False)
    config = folder.parent / f"{folder.name}.yaml"
    server, gguf = find_llama_server(None), folder / "gemma.gguf"
    config.write_text(
        f"models_dir: [{folder}]\nmodels:\n  plain:\n"
        f"    cmd: {server} -m {gguf} --port ${{PORT}} --no-jinja --chat-template gemma\n"
    )
    gen = serving(["--config", str(config)], tmp_path_factory.mktemp("home"))
    g, _ = next(gen)
    try:
        yield g
    finally:
        next(gen, None)


def test_corrals_template_takes_tools_where_the_gguf_carries_none(gw: Gateway) -> None:
    """The packaged gemma (a real model) calls the tool, parsed back into `tool_calls`; the
    random-weight qwen3 and deepseek2 answer with the tools in their prompts (more tokens than
    without)."""
    client = gw.client(max_retries=0, timeout=240)
    listed = {m["id"]: m for m in httpx.get(f"{gw.url}/v1/models").json()["data"]}
    for name in ("gemma", "qwen3-tiny", "deepseek2-tiny"):
        assert listed[name]["capabilities"].get("function_calling") is True
        bare = client.chat.completions.create(model=name, messages=ASK, max_tokens=1)
        out = client.chat.completions.create(
            model=name,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80 if name == "gemma" else 1,  # its call comes within 60 tokens
            temperature=0,
        )
        assert out.usage is not None
        assert bare.usage is not None
        assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 50  # the tools, rendered
        if name == "gemma":
            calls = out.choices[0].message.tool_calls or []
            called = [c.function.name for c in calls if c.type == "function"]
            assert called
            assert set(called) == {"weather"}  # parsed back from the <tool_call> JSON it wrote
    shown = ollama.Client(host=gw.url, timeout=240).show("gemma")
    assert "tools" in (shown.capabilities or [])


def test_a_model_that_takes_no_tools_is_refused_alike_at_both_doors(gw: Gateway) -> None:
    name = "plain"
    listed = {m["id"]: m for m in httpx.get(f"{gw.url}/v1/models").json()["data"]}
    assert not listed[name].get("capabilities", {}).get("function_calling")
    client = gw.client(max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER])
    said = str(refused.value)
    assert f"model {name} does not support tools" in said
    with pytest.raises(ollama.ResponseError) as ollama_refused:
        ollama.Client(host=gw.url, timeout=60).chat(model=name, messages=ASK, tools=[WEATHER])
    assert ollama_refused.value.status_code == 400
    assert f"model {name} does not support tools" in ollama_refused.value.error
    assert gw.status()["models"][name]["state"] != "ready"  # nothing was loaded for them
    plain = client.chat.completions.create(model=name, messages=ASK, max_tokens=2)
    assert plain.choices[0].message.content is not None  # without tools it answers
