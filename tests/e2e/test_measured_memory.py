"""What a real llama-server reports its load allocated is what its model is packed by from then
on: two gemma servers written with a figure far under their real one on a device
that holds one of them; the second load's report overfills the device, and the first, idle,
leaves at once instead of the two being left to fail together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessageParam

from corral.modelfiles.engine_memory import EngineMemory, allocated, device_bytes
from corral.modelfiles.folder import find_llama_server
from tests.support.gateway import serve
from tests.support.gemma import gemma_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_load_that_reports_more_than_its_figure_sends_its_idle_neighbour_away(
    tmp_path: Path,
) -> None:
    gguf = gemma_gguf(tmp_path / "gemma.gguf")
    server = find_llama_server(None)
    assert server is not None
    cmd = f"{server} -m {gguf} --port ${{PORT}} -c 2048 -np 1"
    # Each is written at 0.1 GB: about a third of what llama-server allocates for it.
    config = f"""
devices: [{{name: small, memory_gb: 0.6}}]
models:
  a: {{cmd: "{cmd}", memory_gb: 0.1, memory_from_server: true}}
  b: {{cmd: "{cmd}", memory_gb: 0.1, memory_from_server: true}}
server: {{log_dir: LOG_DIR}}
"""
    with serve(tmp_path / "gw", config) as g:
        client = g.client(max_retries=0, timeout=120)
        ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
        client.chat.completions.create(model="a", messages=ask, max_tokens=2)
        status = g.status()["models"]
        log_a = (tmp_path / "gw" / "logs" / "a.log").read_text()
        reported = device_bytes(allocated(log_a.splitlines()) or EngineMemory())
        assert reported > 200e6  # the weights alone are 235 MiB
        assert status["a"]["memory_gb"] == round(reported / 1e9, 3)
        # b fits beside a by its written figure (0.33 + 0.1 <= 0.6), then reports 0.33: a goes.
        client.chat.completions.create(model="b", messages=ask, max_tokens=2)
        status = g.status()
        states = {n: m["state"] for n, m in status["models"].items()}
        assert states == {"a": "unloaded", "b": "ready"}
        assert status["recent_decisions"][-1]["evict"] == ["a"]
        assert status["recent_decisions"][-1]["reason"].startswith("memory: b takes 0.3")
        assert status["devices"][0]["used_gb"] <= 0.6
        # a comes back in b's place: each alone fits, both never again.
        client.chat.completions.create(model="a", messages=ask, max_tokens=2)
        states = {n: m["state"] for n, m in g.status()["models"].items()}
        assert states == {"a": "ready", "b": "unloaded"}
    kept = json.loads((tmp_path / "gw" / "data" / "corral" / "engine-memory.json").read_text())
    assert [v["measured_bytes"] for v in kept.values()] == [reported]  # one file, one set of flags
