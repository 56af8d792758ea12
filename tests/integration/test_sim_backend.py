"""`corral sim-backend` as a real process, driven by the official `openai` client."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from corral.backends.process import free_port

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")


class Sim:
    def __init__(self, port: int, started_at: float, proc: subprocess.Popen[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.started_at = started_at
        self.proc = proc

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", _strict_response_validation=True
        )

    def wait_healthy(self, timeout_s: float = 20) -> float:
        """Seconds from process start until /health said 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise AssertionError("the sim backend never became healthy")


@contextlib.contextmanager
def start_sim(*args: str) -> Iterator[Sim]:
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [CORRAL, "sim-backend", "--model", "sim-a", "--port", str(port), *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield Sim(port, started, proc)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def sim() -> Iterator[Sim]:
    with start_sim("--load-s", "0.5", "--tokens-per-s", "200", "--parallel", "2") as s:
        yield s


def test_not_healthy_and_refusing_work_until_its_load_time_has_passed() -> None:
    with start_sim("--load-s", "1.5") as s:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # up, but still loading
            try:
                r = httpx.get(f"{s.url}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.02)
        if time.monotonic() - s.started_at < 1.4:  # start-up can be slow on a loaded machine
            assert r.status_code == 503
            early = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": []}, timeout=5)
            assert early.status_code == 503
            assert early.json()["error"]["message"] == "Loading model"
        # The sim counts its 1.5 s from its process's start time in /proc (10 ms ticks), which
        # can read a tick before this test's clock at spawn.
        assert s.wait_healthy() >= 1.48


def test_chat_plain_and_streaming_agree(sim: Sim) -> None:
    sim.wait_healthy()
    client = sim.client()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "write a haiku about swaps"}
    ]
    plain = client.chat.completions.create(model="sim-a", messages=messages, max_tokens=12)
    text = plain.choices[0].message.content or ""
    assert len(text.split()) == 12
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (5, 12)
    stream = client.chat.completions.create(
        model="sim-a",
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text  # deterministic in the prompt, chunk by chunk
    assert len([p for p in pieces if p]) == 12
    assert usage is not None
    assert usage.completion_tokens == 12


def test_completions_embeddings_and_models(sim: Sim) -> None:
    sim.wait_healthy()
    client = sim.client()
    done = client.completions.create(model="sim-a", prompt="once upon", max_tokens=5)
    assert len(done.choices[0].text.split()) == 5
    emb = client.embeddings.create(model="sim-a", input=["alpha", "beta", "alpha"])
    vectors = [d.embedding for d in emb.data]
    assert [len(v) for v in vectors] == [16, 16, 16]
    assert vectors[0] == vectors[2] != vectors[1]
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-9
    assert [m.id for m in client.models.list()] == ["sim-a"]


def test_token_rate_and_parallel_slots() -> None:
    """50 tokens at 100 tokens/s take at least 0.5 s; with one slot, two requests queue."""
    with start_sim("--load-s", "0", "--tokens-per-s", "100", "--parallel", "1") as s:
        s.wait_healthy()
        client = s.client()
        finished: list[float] = []

        def ask() -> None:
            client.completions.create(model="sim-a", prompt="x", max_tokens=50)
            finished.append(time.monotonic())

        begun = time.monotonic()
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert min(finished) - begun >= 0.5
        assert max(finished) - begun >= 1.0  # the second waited for the only slot


def test_bad_json_is_a_400_in_openai_error_shape(sim: Sim) -> None:
    sim.wait_healthy()
    r = httpx.post(f"{sim.url}/v1/chat/completions", content=b"{not json", timeout=5)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the request body is not valid JSON"


def test_vllm_sleep_api_levels_wake_times_and_memory() -> None:
    """vLLM's sleep endpoints: a level-1 sleeper holds its weights in host memory
    and wakes in `--wake-s`; a level-2 one holds nothing, and after its weights wake it must
    reload them (`collective_rpc reload_weights`, `--wake2-s`) before its KV cache wakes, as
    vLLM requires; asleep, it refuses work and says so at `/is_sleeping`. Wake times are
    asserted as lower bounds only (a busy machine only adds)."""
    with start_sim(
        "--load-s", "0", "--wake-s", "0.3", "--wake2-s", "0.8", "--memory-gb", "1.5"
    ) as s:
        s.wait_healthy()
        assert httpx.get(f"{s.url}/is_sleeping").json() == {"is_sleeping": False}
        health = httpx.get(f"{s.url}/health").json()
        assert (health["device_memory_gb"], health["host_memory_gb"]) == (1.5, 0.0)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for level, host_gb in ((1, 1.5), (2, 0.0)):
            assert httpx.post(f"{s.url}/sleep", params={"level": level}).status_code == 200
            assert httpx.get(f"{s.url}/is_sleeping").json() == {"is_sleeping": True}
            health = httpx.get(f"{s.url}/health").json()
            assert health["status"] == "sleeping"
            assert (health["level"], health["device_memory_gb"]) == (level, 0.0)
            assert health["host_memory_gb"] == host_gb
            refused = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=5)
            assert refused.status_code == 503
            started = time.monotonic()
            if level == 1:
                assert httpx.post(f"{s.url}/wake_up", timeout=30).status_code == 200
                assert time.monotonic() - started >= 0.3 - 0.01
            else:
                wake = f"{s.url}/wake_up"
                assert httpx.post(wake, params={"tags": "weights"}).status_code == 200
                rpc = httpx.post(
                    f"{s.url}/collective_rpc", json={"method": "reload_weights"}, timeout=30
                )
                assert rpc.status_code == 200
                assert time.monotonic() - started >= 0.8 - 0.01
                assert httpx.get(f"{s.url}/is_sleeping").json() == {"is_sleeping": True}
                assert httpx.post(wake, params={"tags": "kv_cache"}).status_code == 200
            assert httpx.get(f"{s.url}/is_sleeping").json() == {"is_sleeping": False}
            ok = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=10)
            assert ok.status_code == 200
        assert httpx.post(f"{s.url}/sleep", params={"level": 3}).status_code == 400
        health = httpx.get(f"{s.url}/health").json()
        assert (health["sleep"], health["wake_up"], health["reload_weights"]) == (2, 2, 1)
        assert httpx.post(f"{s.url}/reset_prefix_cache").status_code == 200


def test_a_level_2_sleeper_woken_without_reloading_its_weights_refuses_work() -> None:
    """vLLM answers with garbage then; the sim says what was missed, so a client that skips
    the reload fails a test."""
    with start_sim("--load-s", "0", "--wake2-s", "0") as s:
        s.wait_healthy()
        assert httpx.post(f"{s.url}/sleep", params={"level": 2}).status_code == 200
        assert httpx.post(f"{s.url}/wake_up").status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=5)
        assert r.status_code == 503
        assert "reload_weights" in r.json()["error"]["message"]
        rpc = httpx.post(f"{s.url}/collective_rpc", json={"method": "reload_weights"})
        assert rpc.status_code == 200
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=5).status_code == 200


def test_sglang_memory_release_and_resume() -> None:
    with start_sim("--load-s", "0", "--wake-s", "0.2", "--memory-gb", "2") as s:
        s.wait_healthy()
        assert httpx.post(f"{s.url}/release_memory_occupation", json={}).status_code == 200
        assert httpx.get(f"{s.url}/health").json()["host_memory_gb"] == 2.0
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat).status_code == 503
        started = time.monotonic()
        assert httpx.post(f"{s.url}/resume_memory_occupation", json={}).status_code == 200
        assert time.monotonic() - started >= 0.2 - 0.01
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=5).status_code == 200
