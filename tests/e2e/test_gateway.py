"""`corral serve` as a real process on sim backends, driven by the official `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from corral.backends.process import free_port
from tests.helpers import alive
from tests.support.gateway import (
    CORRAL,
    KEY,
    SIM,
    Gateway,
    external_sim,
    run_agents,
    serve,
    swaps_from_metrics,
    wait_for,
)

CONFIG = f"""
models:
  alpha:
    load_s: 5          # the estimate; the real server loads in 0.3 s and the gateway measures it
    aliases: [a]
    cmd: {SIM} --load-s 0.3 --tokens-per-s 100
  beta:
    load_s: 0.3
    max_queue: 1
    cmd: {SIM} --load-s 0.3 --tokens-per-s 100
  gamma:
    load_s: 0.3
    request_timeout_s: 0.5
    cmd: {SIM} --load-s 0.3 --tokens-per-s 100
  ghost:
    unlisted: true
    cmd: no-such-server --port ${{PORT}}
server:
  log_dir: LOG_DIR
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("gateway"), CONFIG) as gw:
        yield gw


def test_models_chat_streaming_completions_embeddings(gateway: Gateway) -> None:
    client = gateway.client()
    assert [m.id for m in client.models.list()] == ["alpha", "beta", "gamma"]
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    assert chat.model == "alpha"  # the alias reached the real model
    assert len((chat.choices[0].message.content or "").split()) == 6
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="alpha",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
        )
        if c.choices
    ]
    assert "".join(pieces) == chat.choices[0].message.content  # streamed through, chunk by chunk
    assert len([p for p in pieces if p]) == 6
    done = client.completions.create(model="alpha", prompt="once", max_tokens=3)
    assert len(done.choices[0].text.split()) == 3
    emb = client.embeddings.create(model="alpha", input="x")
    assert len(emb.data[0].embedding) == 16
    alpha = gateway.status()["models"]["alpha"]
    assert alpha["state"] == "ready"
    assert alpha["load_s_estimate"] < 5  # the measured load replaced the configured estimate


def test_errors_in_openai_shape(gateway: Gateway) -> None:
    client = gateway.client(max_retries=0)
    with pytest.raises(openai.NotFoundError, match="valid ids: alpha, beta, gamma"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{oops")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": []})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "model")
    r = httpx.get(f"{gateway.url}/v1/completions")
    assert (r.status_code, r.json()["error"]["message"]) == (405, "/v1/completions takes POST")


@pytest.mark.parametrize(
    ("body", "headers", "param", "says"),
    [
        (b'{"model": "alpha", "prompt": "x", "priority": 1e999}', {}, "priority", "-100 to 100"),
        (b'{"model": "alpha", "prompt": "x", "priority": 309}', {}, "priority", "got '309'"),
        (b'{"model": "alpha", "prompt": "x", "priority": 1.5}', {}, "priority", "integer"),
        (b'{"model": "alpha", "prompt": "x"}', {"X-Corral-Priority": "Infinity"}, "priority", ""),
        (b'{"model": "alpha", "prompt": "x"}', {"X-Corral-Priority": "9" * 400}, "priority", ""),
        (b'{"model": "alpha", "prompt": NaN}', {}, None, "NaN is not a JSON value"),
        (b'{"model": "alpha", "max_tokens": Infinity}', {}, None, "Infinity is not a JSON"),
        (b'{"model": "alpha", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, None, "deep"),
        (b'{"model": 123, "prompt": "x"}', {}, "model", "must be a string naming a model"),
    ],
)
def test_hostile_bodies_get_400_in_openai_shape_never_500(
    gateway: Gateway, body: bytes, headers: dict[str, str], param: str | None, says: str
) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json", **headers},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert says in err["message"]
    # and the gateway still answers
    ok = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1}
    )
    assert ok.status_code == 200


def busy(gateway: Gateway, model: str, seconds: float) -> threading.Thread:
    """Keep `model` busy for about `seconds` (100 tokens/s) in the background."""
    client = gateway.client()

    def run() -> None:
        client.completions.create(model=model, prompt="x", max_tokens=int(seconds * 100))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while gateway.status()["models"][model]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return t


def test_swaps_queue_limits_timeouts_and_clients_that_leave(gateway: Gateway) -> None:
    client = gateway.client(max_retries=0)
    # alpha is busy: a request for beta waits (a model with work in flight is never evicted)
    worker = busy(gateway, "alpha", 1.5)
    before = gateway.status()["swaps"]  # alpha is loaded by now
    waiting = threading.Thread(
        target=lambda: client.completions.create(model="beta", prompt="y", max_tokens=2)
    )
    waiting.start()
    time.sleep(0.2)
    # beta's queue is full (max_queue: 1): 429 with Retry-After
    r = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "beta", "prompt": "z", "max_tokens": 1}
    )
    assert r.status_code == 429
    assert r.headers["retry-after"]
    assert "max_queue" in r.json()["error"]["message"]
    (queued,) = gateway.status()["models"]["beta"]["queue"]  # its position, and how long so far
    assert queued["position"] == 1
    assert queued["waited_s"] > 0
    # gamma gives up after request_timeout_s: 0.5 -> 504, and never loads
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="gamma", prompt="z", max_tokens=1)
    assert err.value.status_code == 504
    # a client that leaves while queued for gamma: dropped without triggering a load
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "gamma", "prompt": "z", "max_tokens": 1},
            timeout=0.3,
        )
    worker.join(20)
    waiting.join(20)
    time.sleep(0.5)
    status = gateway.status()
    assert status["models"]["gamma"]["state"] == "unloaded"
    assert status["models"]["gamma"]["queued"] == 0
    loaded = [s["model"] for s in status["recent_swaps"]][-(status["swaps"] - before) :]
    assert loaded == ["beta"]  # alpha stayed until its request ended; gamma never loaded
    assert status["recent_swaps"][-1]["evicted"] == ["alpha"]


GUARDED = f"""
models:
  alpha:
    cmd: {SIM} --load-s 0.1
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  max_body_mb: 0.001
"""


def test_api_keys_body_limit_priority_and_upstream(tmp_path: Path) -> None:
    with serve(tmp_path, GUARDED) as gw:
        url = f"{gw.url}/v1/completions"
        body = {"model": "alpha", "prompt": "x", "max_tokens": 1}
        r = httpx.post(url, json=body)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, _strict_response_validation=True)
        assert ok.completions.create(model="alpha", prompt="x", max_tokens=2).choices[0].text
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(url, json={**body, "prompt": "x" * 2000}, headers=auth)
        assert r.status_code == 413
        assert "max_body_mb" in r.json()["error"]["message"]
        r = httpx.post(url, json=body, headers={**auth, "X-Corral-Priority": "high"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")
        r = httpx.post(url, json={**body, "priority": 5}, headers=auth)
        assert r.status_code == 200  # a body priority is an accepted extension field
        r = httpx.get(f"{gw.url}/upstream/alpha/v1/models", headers=auth)
        assert r.json()["data"][0]["id"] == "alpha"
        assert httpx.get(f"{gw.url}/health").status_code == 200  # health needs no key
        # The dashboard asks for the key and keeps it in a SameSite cookie, which the server
        # accepts too (an EventSource or a download link cannot send a header).
        assert 'id="login"' in httpx.get(f"{gw.url}/ui").text
        assert httpx.get(f"{gw.url}/api/status").status_code == 401
        cookie = {"corral_key": KEY}
        assert httpx.get(f"{gw.url}/api/status", cookies=cookie).status_code == 200
        assert httpx.get(f"{gw.url}/api/status", cookies={"corral_key": "no"}).status_code == 401
        assert httpx.post(url, json=body, cookies=cookie).status_code == 200


def test_a_command_that_does_not_exist_fails_its_requests_and_others_are_served(
    gateway: Gateway,
) -> None:
    client = gateway.client(max_retries=0)
    for _ in range(2):  # not stuck: each request tries again and gets the same clear error
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="ghost", prompt="x", max_tokens=1)
        assert err.value.status_code == 503
        assert "command not found: 'no-such-server'" in err.value.message
        assert client.completions.create(model="alpha", prompt="x", max_tokens=1).choices
    assert gateway.status()["models"]["ghost"]["state"] == "unloaded"


def test_a_server_that_dies_is_started_again_for_the_next_request(gateway: Gateway) -> None:
    client = gateway.client(max_retries=0)
    client.completions.create(model="alpha", prompt="x", max_tokens=1)
    pid = gateway.status()["models"]["alpha"]["pid"]
    os.kill(pid, signal.SIGKILL)  # the OOM killer, a segfault
    deadline = time.monotonic() + 10
    while gateway.status()["models"]["alpha"]["crashes"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    alpha = gateway.status()["models"]["alpha"]
    assert (alpha["crashes"], alpha["state"]) == (1, "unloaded")
    again = client.completions.create(model="alpha", prompt="x", max_tokens=2)
    assert len(again.choices[0].text.split()) == 2
    alpha = gateway.status()["models"]["alpha"]
    assert alpha["state"] == "ready"
    assert alpha["pid"] != pid


def test_a_second_gateway_on_the_same_folder_is_refused_and_stops_nothing(
    gateway: Gateway,
) -> None:
    client = gateway.client(max_retries=0)
    client.completions.create(model="alpha", prompt="x", max_tokens=1)
    pid = gateway.status()["models"]["alpha"]["pid"]
    assert gateway.folder is not None
    env = {**os.environ, "XDG_DATA_HOME": str(gateway.folder / "data")}
    for listen in (f"127.0.0.1:{free_port()}", gateway.url.removeprefix("http://")):
        second = subprocess.run(  # on a free port, and on the first one's (cannot bind)
            [CORRAL, "serve", "--config", str(gateway.folder / "corral.yaml"), "--listen", listen],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert second.returncode == 2, second.stderr
        assert "another corral serve (pid " in second.stderr
        assert str(gateway.folder / "logs") in second.stderr
        assert "left behind" not in second.stderr
        assert "Traceback" not in second.stderr
    assert alive(pid)  # the first gateway's server was not touched ...
    assert gateway.status()["models"]["alpha"]["pid"] == pid
    # ... and it still serves
    assert client.completions.create(model="alpha", prompt="y", max_tokens=1).choices


def test_a_crash_mid_request_is_a_502_and_the_next_request_works(gateway: Gateway) -> None:
    client = gateway.client(max_retries=0)
    client.completions.create(model="alpha", prompt="x", max_tokens=1)
    errors: list[openai.APIStatusError] = []

    def long_request() -> None:
        try:
            client.completions.create(model="alpha", prompt="x", max_tokens=300)
        except openai.APIStatusError as exc:
            errors.append(exc)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while gateway.status()["models"]["alpha"]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(gateway.status()["models"]["alpha"]["pid"], signal.SIGKILL)
    t.join(20)
    assert [e.status_code for e in errors] == [502]
    assert "model alpha: its server did not answer" in errors[0].message
    assert client.completions.create(model="alpha", prompt="y", max_tokens=1).choices[0].text


def test_a_crash_mid_stream_ends_with_an_error_event_the_official_client_raises(
    gateway: Gateway,
) -> None:
    client = gateway.client(max_retries=0)
    client.completions.create(model="alpha", prompt="x", max_tokens=1)
    stream = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=300, stream=True
    )
    got: list[str] = []

    def read() -> None:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if len(got) == 3:
                os.kill(gateway.status()["models"]["alpha"]["pid"], signal.SIGKILL)

    with pytest.raises(openai.APIError) as info:  # before: the stream just ended, as if done
        read()
    assert len(got) >= 3
    assert "model alpha: the answer was cut short (its server exited)" in info.value.message
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'corral_stream_errors_total{model="alpha"} 1.0' in metrics
    # The wait bound is shown where it is kept: not stretched for one idle client.
    assert "corral_wait_bound_seconds 120.0" in metrics
    assert "corral_wait_bound_stretched 0.0" in metrics
    assert gateway.status()["wait_bound"] == {
        "configured_s": 120.0,
        "effective_s": None,
        "stretched_since": None,
    }
    assert client.completions.create(model="alpha", prompt="y", max_tokens=1).choices[0].text


AGENTS = f"""
models:
  orchestrator:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3 --tokens-per-s 1000
  explorer:
    load_s: 0.3
    concurrency: 2
    cmd: {SIM} --load-s 0.3 --tokens-per-s 1000 --parallel 2
  coder:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3 --tokens-per-s 1000
scheduler:
  policy: POLICY
  max_wait_s: 30
server:
  log_dir: LOG_DIR
"""


# fifo's 36 or more whole swaps take 45-100 s beside the rest of the suite: over the default limit.
@pytest.mark.timeout(480)
def test_agent_pattern_cost_swaps_at_most_a_third_of_fifo(tmp_path: Path) -> None:
    swaps = {}
    for policy in ("fifo", "cost"):
        with serve(tmp_path / policy, AGENTS.replace("POLICY", policy)) as gw:
            assert run_agents(gw, rounds=12) == 48  # every request answered
            swaps[policy] = swaps_from_metrics(gw.url)
            assert swaps[policy] == gw.status()["swaps"]
    assert swaps["cost"] <= swaps["fifo"] / 3, swaps


def test_a_client_that_leaves_mid_stream_frees_the_slot_and_stops_the_server(
    gateway: Gateway,
) -> None:
    """alpha's server has one slot: a new request is answered at once only if the abandoned
    3-second stream was cancelled upstream too."""
    client = gateway.client(max_retries=0)
    client.completions.create(model="alpha", prompt="x", max_tokens=1)
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": "alpha", "prompt": "x", "max_tokens": 300, "stream": True},
    ) as r:
        next(r.iter_raw())  # the first token arrived; now the client goes away
    deadline = time.monotonic() + 5
    while gateway.status()["models"]["alpha"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway.status()["models"]["alpha"]["in_flight"] == 0
    began = time.monotonic()
    client.completions.create(model="alpha", prompt="y", max_tokens=2)
    assert time.monotonic() - began < 2.0  # not behind the abandoned 3-second answer
    logs = httpx.get(f"{gateway.url}/api/models/a/logs").text
    assert "corral: starting" in logs


def test_sigterm_stops_the_server_while_a_dashboard_listens_to_its_events(tmp_path: Path) -> None:
    opened, ended = threading.Event(), threading.Event()

    def listen(url: str) -> None:
        with httpx.stream("GET", f"{url}/api/events", timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("event: status"):
                    opened.set()
        ended.set()  # the server ended the stream (a read timeout would raise instead)

    with serve(tmp_path, CONFIG) as gw:  # its exit stops the server and waits for it (30 s)
        t = threading.Thread(target=listen, args=(gw.url,), daemon=True)
        t.start()
        assert opened.wait(30)
    t.join(30)
    assert ended.is_set()


def test_events_stream_state_changes_and_the_status_page_uses_them(gateway: Gateway) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    got_loaded = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", f"{gateway.url}/api/events", timeout=30) as r:
            kind = ""
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    seen.append((kind, json.loads(line[6:])))
                    if kind == "loaded" and seen[-1][1]["model"] == model:
                        got_loaded.set()
                        return

    # a model not loaded now (gamma's 0.5 s request timeout is shorter than a load on a busy
    # machine); one device, so alpha and beta are never both loaded
    states = {m: gateway.status()["models"][m]["state"] for m in ("alpha", "beta")}
    model = min(states, key=lambda m: states[m] != "unloaded")
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    gateway.client().completions.create(model=model, prompt="x", max_tokens=1)
    assert got_loaded.wait(10)
    kinds = [k for k, _ in seen]
    assert kinds[0] == "status"
    assert "models" in seen[0][1]
    assert kinds.index("load_started") < kinds.index("loaded")
    assert seen[-1][1]["load_s"] > 0
    page = httpx.get(f"{gateway.url}/ui")
    assert page.headers["content-type"].startswith("text/html")
    assert 'new EventSource("/api/events")' in page.text


LLAMA_SWAP = f"""
healthCheckTimeout: 30
startPort: 10001
macros:
  sim: {CORRAL} sim-backend --port ${{PORT}} --load-s 0.2
models:
  "qwen-coder":
    cmd: ${{sim}} --model ${{MODEL_ID}}
    aliases: [coder]
    ttl: 300
  "llama-chat":
    cmd: ${{sim}} --model ${{MODEL_ID}}
    checkEndpoint: /health
  "embed":
    cmd: ${{sim}} --model ${{MODEL_ID}}
    unlisted: true
groups:
  chat:
    swap: true
    members: [qwen-coder, llama-chat]
  always-on:
    persistent: true
    members: [embed]
hooks:
  on_startup:
    preload: [embed]
"""


def test_a_llama_swap_config_serves_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # where its logs go
    (tmp_path / "ls.yaml").write_text(LLAMA_SWAP)
    check = subprocess.run(
        [CORRAL, "config", "check", str(tmp_path / "ls.yaml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    assert "in llama-swap's format" in check.stderr
    assert "mapped   models.qwen-coder.ttl -> ttl_s" in check.stderr
    assert "mapped   hooks.on_startup.preload -> server.preload" in check.stderr
    with serve(tmp_path, LLAMA_SWAP) as gw:
        wait_for(lambda: gw.status()["models"]["embed"]["state"] == "ready")  # preloaded
        embed_pid = gw.status()["models"]["embed"]["pid"]
        client = gw.client(max_retries=0)
        assert [m.id for m in client.models.list()] == ["qwen-coder", "llama-chat"]  # unlisted
        out = client.chat.completions.create(
            model="coder", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert out.model == "qwen-coder"
        client.chat.completions.create(
            model="llama-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert client.embeddings.create(model="embed", input="x").data
        status = gw.status()
        swapped = [(s["model"], s["evicted"]) for s in status["recent_swaps"]]
        # The chat group swaps on its device; the persistent group's model is never evicted.
        assert swapped == [("embed", []), ("qwen-coder", []), ("llama-chat", ["qwen-coder"])]
        assert status["models"]["embed"]["pid"] == embed_pid
        assert {d["name"]: d["resident"] for d in status["devices"]} == {
            "shared": ["llama-chat"],
            "group-always-on": ["embed"],
        }
        assert status["models"]["qwen-coder"]["ttl_s"] == 300
        assert (tmp_path / "data" / "corral" / "logs" / "qwen-coder.log").exists()


def test_a_llama_swap_file_keeps_its_in_flight_limit_and_its_keys_from_the_environment(
    tmp_path: Path,
) -> None:
    config = f"""
apiKeys: ["${{env.CORRAL_E2E_KEY}}"]
models:
  four:
    cmd: |
      # four at once, 200 tokens/s: 100 tokens take 0.5 s
      {SIM} --load-s 0.2 --tokens-per-s 200 --parallel 4
"""
    with serve(tmp_path, config, env={"CORRAL_E2E_KEY": KEY}) as gw:
        literal = openai.OpenAI(
            base_url=f"{gw.url}/v1", api_key="${env.CORRAL_E2E_KEY}", max_retries=0
        )
        with pytest.raises(openai.AuthenticationError):  # before: the literal was a key
            literal.models.list()
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
        client.completions.create(model="four", prompt="x", max_tokens=1)  # loaded
        began = time.monotonic()
        threads = [
            threading.Thread(
                target=client.completions.create,
                kwargs={"model": "four", "prompt": "x", "max_tokens": 100},
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # llama-swap's default in-flight limit (10) lets all 8 reach the 4-slot server: two
        # rounds of 0.5 s (before: one at a time, 4 s)
        assert time.monotonic() - began < 2.5


OPERATED = f"""
models:
  alpha:
    load_s: 0.3
    ttl_s: 2
    cmd: {SIM} --load-s 0.3 --tokens-per-s 100
  beta:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3 --tokens-per-s 100
  hidden:
    unlisted: true
    cmd: {SIM} --load-s 0.1
server:
  log_dir: LOG_DIR
  preload: [beta]
"""


def test_preload_ttl_unlisted_and_the_load_and_unload_api(tmp_path: Path) -> None:
    with serve(tmp_path, OPERATED) as gw:

        def models() -> dict[str, Any]:
            return gw.status()["models"]  # type: ignore[no-any-return]

        wait_for(lambda: models()["beta"]["state"] == "ready")  # preloaded, no request needed
        assert gw.status()["recent_decisions"][0]["reason"] == "requested"
        client = gw.client(max_retries=0)
        assert [m.id for m in client.models.list()] == ["alpha", "beta"]
        assert client.completions.create(model="hidden", prompt="x", max_tokens=1).choices

        # ttl_s: alpha unloads 2 s after its last request, its server stopped.
        client.completions.create(model="alpha", prompt="x", max_tokens=1)
        alpha = models()["alpha"]
        assert 0 < alpha["unloads_in_s"] <= 2
        wait_for(lambda: models()["alpha"]["state"] == "unloaded")
        wait_for(lambda: not alive(alpha["pid"]))
        last = gw.status()["recent_decisions"][-1]
        assert (last["load"], last["evict"], last["reason"]) == (None, ["alpha"], "ttl_s")
        assert 'corral_unloads_total{model="alpha"} 1.0' in httpx.get(f"{gw.url}/metrics").text

        # The load and unload API.
        api = f"{gw.url}/api/models"
        r = httpx.post(f"{api}/nope/load", params={"wait": "true"}, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
        r = httpx.post(f"{api}/beta/load", params={"wait": "true"}, timeout=30)
        assert r.json() == {"model": "beta", "state": "ready"}
        assert r.status_code == 200
        t = busy(gw, "beta", 1.5)
        r = httpx.post(f"{api}/alpha/load")
        assert r.status_code == 409
        assert r.json()["error"]["message"] == (
            "cannot load alpha now: it would evict beta (0 queued, 1 in flight)"
        )
        r = httpx.post(f"{api}/beta/unload")
        assert r.status_code == 409
        assert "has 0 queued and 1 in flight requests" in r.json()["error"]["message"]
        t.join(30)
        pid = models()["beta"]["pid"]
        r = httpx.post(f"{api}/beta/unload", params={"wait": "true"}, timeout=30)
        assert (r.status_code, r.json()["state"]) == (200, "unloaded")
        assert not alive(pid)
        r = httpx.post(f"{api}/alpha/load")  # without wait: accepted, loading
        assert (r.status_code, r.json()["state"]) == (202, "loading")
        wait_for(lambda: models()["alpha"]["state"] == "ready")


def test_upstream_servers_swap_through_their_sleep_and_wake_hooks(tmp_path: Path) -> None:
    with external_sim("vllm-x") as x_url, external_sim("vllm-y") as y_url:
        hooks = "load_hook: {path: /wake_up}\n    unload_hook: {path: /sleep}"
        config = f"""
models:
  x:
    upstream: {x_url}
    upstream_model: vllm-x
    {hooks}
  y:
    upstream: {y_url}
    upstream_model: vllm-y
    {hooks}
server:
  log_dir: LOG_DIR
"""
        with serve(tmp_path, config) as gw:
            client = gw.client(max_retries=0)

            def ask(model: str) -> str:
                out = client.completions.create(model=model, prompt="hi", max_tokens=2)
                return out.model

            assert ask("x") == "vllm-x"  # the upstream's own name went upstream
            assert ask("y") == "vllm-y"
            x = httpx.get(f"{x_url}/health").json()
            assert (x["status"], x["sleep"]) == ("sleeping", 1)  # evicted: put to sleep
            assert ask("x") == "vllm-x"
            x, y = httpx.get(f"{x_url}/health").json(), httpx.get(f"{y_url}/health").json()
            assert (x["status"], x["wake_up"]) == ("ok", 1)  # woken for its request
            assert (y["status"], y["sleep"]) == ("sleeping", 1)
            assert gw.status()["swaps"] == 3
            assert "unload hook POST" in httpx.get(f"{gw.url}/api/models/y/logs").text
