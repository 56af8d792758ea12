"""`GET /metrics` as llm-d's endpoint picker reads it, on a real `corral serve` with
sim model servers: the protocol's gauges under Corral's names and vLLM's, parsed by
prometheus-client's parser, and the residency lists equal to what `/api/status` says through a
load, a swap, a model that fails to start, a sleep and a wake."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import SIM, Gateway, serve, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CONFIG = f"""
devices: [{{name: g, memory_gb: 10}}]
models:
  a: {{cmd: "{SIM} --load-s 0.2", memory_gb: 6, aliases: [a-latest]}}
  b: {{cmd: "{SIM} --load-s 1.5", memory_gb: 6}}
  broken: {{cmd: "false", memory_gb: 1}}
server: {{vllm_metric_names: true, log_dir: LOG_DIR}}
"""


def scrape(g: Gateway) -> dict[str, Any]:
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(f"{g.url}/metrics").text)
    }
    out: dict[str, Any] = {}
    for prefix in ("corral_", "vllm:"):
        (info,) = families[f"{prefix}lora_requests_info"].samples
        lists = {k: [x.strip() for x in v.split(",") if x.strip()] for k, v in info.labels.items()
                 if k != "max_lora"}  # fmt: skip
        out[prefix] = (lists, int(info.labels["max_lora"]))
    assert out["corral_"] == out["vllm:"]  # the same figures under both names
    waiting = families["vllm:num_requests_waiting"].samples[0].value
    assert waiting == families["corral_requests_waiting"].samples[0].value
    lists, max_models = out["corral_"]
    return {"running": lists["running_lora_adapters"], "waiting": lists["waiting_lora_adapters"],
            "max": max_models, "queued": waiting}  # fmt: skip


def says(g: Gateway) -> list[str]:
    """The ready models and their aliases, as /api/status has them."""
    models = g.status()["models"]
    return [n for name, m in models.items() if m["state"] == "ready"
            for n in [name, *m["aliases"]]]  # fmt: skip


def waits_while_it_comes(g: Gateway, client: openai.OpenAI, model: str) -> str:
    """Ask `model` in the background; once the gauge lists it as waiting, the state
    `/api/status` gives it then; returns after the answer."""
    done = threading.Thread(
        target=client.completions.create, kwargs={"model": model, "prompt": "hi", "max_tokens": 2}
    )
    done.start()
    wait_for(lambda: model in scrape(g)["waiting"], timeout_s=20)
    state = str(g.status()["models"][model]["state"])
    done.join(30)
    return state


def test_the_residency_gauge_follows_loads_swaps_and_failures(tmp_path: Path) -> None:
    with serve(tmp_path, CONFIG) as g:
        client = g.client(max_retries=0, timeout=30)
        seen = scrape(g)
        assert seen["running"] == seen["waiting"] == []
        assert seen["max"] == 2  # broken (1 GB) and one of a, b (6 GB) fit 10 GB together
        client.completions.create(model="a-latest", prompt="hi", max_tokens=2)
        seen = scrape(g)
        assert seen["running"] == says(g) == ["a", "a-latest"]
        assert seen["max"] == 2  # a, and broken in the 4 GB left; b would evict a
        # b loads in a's place (1.5 s): meanwhile it is waiting, a no longer running.
        assert waits_while_it_comes(g, client, "b") in ("loading", "unloaded")
        seen = scrape(g)
        assert seen["running"] == says(g) == ["b"]
        assert seen["waiting"] == []
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="broken", prompt="hi", max_tokens=2)
        seen = scrape(g)
        assert seen["running"] == says(g) == ["b"]  # the failed start is in neither list
        assert seen["waiting"] == []
        assert seen["queued"] == 0


SLEEPY = f"""
devices: [{{name: g, memory_gb: 24}}]
host: {{memory_gb: 50}}
models:
  a: {{cmd: "{SIM} --load-s 0.5 --sleep-s 0.05 --wake-s 1.5 --memory-gb 20", memory_gb: 20,
      load_s: 20, sleep: {{level: 1, wake_s: 1.5, sleep_s: 0.5}}}}
  b: {{cmd: "{SIM} --load-s 0.5 --sleep-s 0.05 --wake-s 1.5 --memory-gb 20", memory_gb: 20,
      load_s: 20, sleep: {{level: 1, wake_s: 1.5, sleep_s: 0.5}}}}
server: {{vllm_metric_names: true, log_dir: LOG_DIR}}
"""


def test_a_sleeping_model_is_in_neither_list_and_waits_while_it_wakes(tmp_path: Path) -> None:
    with serve(tmp_path, SLEEPY) as g:
        client = g.client(max_retries=0, timeout=30)
        client.completions.create(model="a", prompt="hi", max_tokens=2)
        client.completions.create(model="b", prompt="hi", max_tokens=2)  # a goes to sleep
        wait_for(lambda: g.status()["models"]["a"]["state"] == "sleeping", timeout_s=20)
        seen = scrape(g)
        assert seen["running"] == says(g) == ["b"]  # sleeping: off the device, not running
        assert seen["waiting"] == []
        assert seen["max"] == 1  # a's 20 GB do not fit beside b: waking it evicts b
        # a wakes in b's place (1.5 s): meanwhile it is waiting.
        assert waits_while_it_comes(g, client, "a") in ("waking", "sleeping")
        seen = scrape(g)
        assert seen["running"] == says(g) == ["a"]
        assert seen["waiting"] == []
        assert g.status()["models"]["b"]["state"] == "sleeping"
