"""Sleeping models and aborted loads live: `corral serve` on sim backends that speak
vLLM's sleep API (and SGLang's), driven by the official `openai` client. Each test asserts what
was decided and done (which server slept, woke, reloaded its weights, was warmed up, or was
stopped), not how long it took."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import alive
from tests.support.gateway import SIM, Gateway, external_sim, serve, wait_for

pytestmark = pytest.mark.e2e


def sleepy(level: int, api: str = "vllm") -> str:
    """Two models that each fill the device and both fit asleep in host memory."""
    server = f"{SIM} --load-s 1.0 --sleep-s 0.05 --wake-s 0.05 --wake2-s 0.1 --memory-gb 20"
    models = "".join(
        f"""
  {name}:
    load_s: 20
    memory_gb: 20
    sleep: {{level: {level}, wake_s: 0.5, sleep_s: 0.5, api: {api}}}
    cmd: {server}"""
        for name in ("a", "b")
    )
    return f"""
devices: [{{name: gpu0, memory_gb: 24}}]
host: {{memory_gb: 50}}
models:{models}
server:
  log_dir: LOG_DIR
"""


def health(gw: Gateway, model: str) -> dict[str, Any]:
    """The model's own server's /health (its sleep counts and where its weights are)."""
    proxy = gw.status()["models"][model]["proxy"]
    assert proxy, f"{model} has no server running"
    body: dict[str, Any] = httpx.get(f"{proxy}/health", timeout=5).json()
    return body


def ask(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return out.choices[0].message.content or ""


@pytest.mark.parametrize(("level", "api"), [(1, "vllm"), (2, "vllm"), (1, "sglang")])
def test_an_evicted_model_sleeps_and_its_next_request_wakes_the_same_server(
    tmp_path: Path, level: int, api: str
) -> None:
    with serve(tmp_path, sleepy(level, api)) as gw:
        client = gw.client(max_retries=0)
        ask(client, "a")
        ask(client, "a")  # two arrivals: a's next use can be predicted, so it sleeps
        a_pid = gw.status()["models"]["a"]["pid"]
        ask(client, "b")
        ask(client, "b")
        status = gw.status()
        assert status["models"]["a"]["state"] == "sleeping"
        assert status["models"]["a"]["pid"] == a_pid  # its server stays, asleep
        assert status["host"]["sleeping"] == ["a"]
        assert status["host"]["used_gb"] == (20 if level == 1 else 0)
        assert status["recent_swaps"][-1]["slept"] == ["a"]
        assert status["recent_decisions"][-1]["evict"] == []  # nothing was stopped
        ask(client, "a")  # woken, not started: the same process answers
        status = gw.status()
        assert status["models"]["a"]["pid"] == a_pid
        assert status["models"]["b"]["state"] == "sleeping"  # asked twice: expected back
        assert status["recent_swaps"][-1]["woke"] is True
        a = health(gw, "a")
        assert (a["sleep"], a["wake_up"]) == (1, 1)
        # Three answers and the warm-up after the wake reached the server.
        assert a["served"] == 4
        assert a["reload_weights"] == (1 if (level, api) == (2, "vllm") else 0)
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'corral_wakes_total{model="a"} 1.0' in metrics
        assert 'corral_model_sleeping{model="b"} 1.0' in metrics


def test_a_server_that_cannot_sleep_is_stopped_and_started_afresh(tmp_path: Path) -> None:
    """`sleep:` on a server without the API (an old vLLM, a typo): the swap still happens, the
    server is stopped instead, and its next request starts it again."""
    # The first model's server answers 404 at /sleep, as one started without sleep mode does.
    config = sleepy(1).replace("--memory-gb 20", "--memory-gb 20 --no-sleep-api", 1)
    with serve(tmp_path, config) as gw:
        client = gw.client(max_retries=0)
        ask(client, "a")
        ask(client, "a")
        a_pid = gw.status()["models"]["a"]["pid"]
        ask(client, "b")
        assert not alive(a_pid)  # it could not sleep: stopped, nothing holds the device
        assert ask(client, "a")  # started afresh
        assert gw.status()["models"]["a"]["pid"] != a_pid
        assert gw.status()["recent_swaps"][-1]["woke"] is False


def test_an_upstream_with_sleep_sleeps_at_its_level_and_stops_at_level_2(tmp_path: Path) -> None:
    with external_sim("vllm-x") as x_url, external_sim("vllm-y") as y_url:
        config = f"""
devices: [{{name: gpu0, memory_gb: 24}}]
host: {{memory_gb: 30}}
models:
  x: {{upstream: {x_url}, upstream_model: vllm-x, memory_gb: 20, sleep: {{level: 1}}}}
  y: {{upstream: {y_url}, upstream_model: vllm-y, memory_gb: 20, sleep: {{level: 1}}}}
scheduler: {{sleepers: lru}}
server:
  log_dir: LOG_DIR
"""
        with serve(tmp_path, config) as gw:
            client = gw.client(max_retries=0)
            ask(client, "x")
            ask(client, "y")
            x = httpx.get(f"{x_url}/health").json()
            assert (x["status"], x["level"], x["sleep"]) == ("sleeping", 1, 1)
            ask(client, "x")
            x = httpx.get(f"{x_url}/health").json()
            assert (x["status"], x["wake_up"], x["served"]) == ("ok", 1, 3)  # warmed up too
            # The operator unloads the sleeping y: an upstream cannot stop, so it sleeps at
            # level 2, which frees its host memory too.
            assert httpx.post(f"{gw.url}/api/models/y/unload").status_code == 200
            wait_for(lambda: httpx.get(f"{y_url}/health").json()["level"] == 2)
            y = httpx.get(f"{y_url}/health").json()
            assert (y["status"], y["host_memory_gb"]) == ("sleeping", 0.0)
            assert gw.status()["host"]["sleeping"] == []


SLOW = f"""
models:
  slow:
    load_s: 30
    cmd: {SIM} --load-s 30
  quick:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3
server:
  log_dir: LOG_DIR
"""


def test_a_load_whose_client_left_is_aborted_and_leaves_no_process(tmp_path: Path) -> None:
    with serve(tmp_path, SLOW) as gw:
        pids: list[int] = []

        def leave_early() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{gw.url}/v1/chat/completions",
                    json={"model": "slow", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=2.0,
                )

        caller = threading.Thread(target=leave_early)
        caller.start()
        wait_for(lambda: gw.status()["models"]["slow"]["pid"] is not None)
        pids.append(gw.status()["models"]["slow"]["pid"])
        caller.join(30)
        wait_for(lambda: gw.status()["models"]["slow"]["state"] == "unloaded")
        wait_for(lambda: not alive(pids[0]))  # the half-started server is gone
        status = gw.status()
        assert status["models"]["slow"]["pid"] is None
        reasons = [d["reason"] for d in status["recent_decisions"]]
        assert "load aborted: its waiting requests left" in reasons
        assert status["recent_swaps"][-1]["error"] == "aborted"
        # The device is free: the next model loads into it, evicting nothing.
        assert ask(gw.client(max_retries=0, timeout=60), "quick")
        decisions = gw.status()["recent_decisions"]
        assert (decisions[-1]["load"], decisions[-1]["evict"]) == ("quick", [])
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'corral_load_aborts_total{model="slow"} 1.0' in metrics
