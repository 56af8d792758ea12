"""Relay processes (`corral serve --workers N`) against a real `corral serve`: the relays carry
the answers, the scheduler's process counts every one of them exactly, and a relay killed with
`kill -9` mid-stream loses nothing else: the streams on the other relay finish whole, the killed
one's calls are counted as lost (502) and free their model's slots at once, and a new relay
takes its place."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import CORRAL, SIM, Gateway, serve, wait_for

pytestmark = pytest.mark.e2e

STREAMS = 8
CONFIG = f"""
devices: [{{name: gpu0, memory_gb: 24}}]
models:
  slow:
    load_s: 0.2
    memory_gb: 10
    concurrency: {STREAMS}
    cmd: {SIM} --load-s 0.2 --tokens-per-s 10 --parallel {STREAMS}
server:
  log_dir: LOG_DIR
  relay_processes: 2
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("relays"), CONFIG) as g:
        yield g


def counter(gw: Gateway, name: str, **labels: str) -> float:
    """The sum of counter `name`'s samples whose labels include `labels`."""
    text = httpx.get(f"{gw.url}/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == name
        for s in f.samples
        if s.name == f"{name}_total" and labels.items() <= s.labels.items()
    )


def relays_of(gw: Gateway) -> dict[str, int]:
    relays: dict[str, int] = gw.status()["relays"]["pids"]
    return relays


def test_the_relays_carry_the_answers_and_the_scheduler_counts_each(gw: Gateway) -> None:
    pids = relays_of(gw)
    assert len(pids) == 2
    assert all(psutil.pid_exists(p) for p in pids.values())
    serve_pid = gw.pid()
    assert {psutil.Process(p).ppid() for p in pids.values()} == {serve_pid}
    before = counter(gw, "corral_requests", model="slow", status="200")
    c = gw.client(max_retries=0, timeout=60)
    answers: list[str] = []

    def ask(i: int) -> None:
        stream = c.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=5,
            stream=True,
        )  # fmt: skip
        answers.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 12
    assert all(answers)
    # Counted once each, by the scheduler's process, whichever relay carried them.
    assert counter(gw, "corral_requests", model="slow", status="200") - before == 12
    status = gw.status()
    assert status["relays"]["grants_open"] == 0
    assert status["models"]["slow"]["in_flight"] == 0
    # Corral's headers ride on a carried answer, and the model server's own come through.
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "slow", "messages": [{"role": "user", "content": "h"}], "max_tokens": 2},
    )
    assert r.status_code == 200
    assert "x-corral-wait-ms" in r.headers
    assert r.headers.get("x-request-id")


def test_a_client_cannot_speak_for_a_relay(gw: Gateway) -> None:
    """The relays' own headers and routes are theirs: a client's are dropped or refused."""
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "slow", "messages": [{"role": "user", "content": "h"}], "max_tokens": 2},
        headers={"x-corral-relay": "r9", "x-corral-client": "10.0.0.1:1"},
    )
    assert r.status_code == 200
    assert "x-corral-grant" not in r.headers
    assert r.json()["choices"][0]["message"]["content"]
    forged = httpx.post(f"{gw.url}/internal/relay/end?grant=x", content=b'{"status": 200}')
    assert forged.status_code == 404


def test_a_relay_killed_mid_stream_loses_nothing_else(gw: Gateway) -> None:
    lost_before = counter(gw, "corral_relay_lost")
    bad_before = counter(gw, "corral_requests", model="slow", status="502")
    outcomes: dict[int, str] = {}
    started = threading.Barrier(STREAMS + 1)

    def stream(i: int) -> None:
        body = {"model": "slow", "messages": [{"role": "user", "content": f"s{i}"}],
                "max_tokens": 40, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as r:
                chunks = r.iter_bytes()
                first = next(chunks)
                started.wait(30)
                text = first + b"".join(chunks)
            outcomes[i] = "whole" if b"data: [DONE]" in text else "cut"
        except (httpx.TransportError, httpx.RemoteProtocolError):
            outcomes[i] = "failed"
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait(30)  # every stream has its first chunk: all are in flight (40 tokens: 4 s)
    pids = relays_of(gw)
    port = int(gw.url.rsplit(":", 1)[1])

    def clients(pid: int) -> int:  # connections the relay accepted from clients
        return sum(
            1
            for c in psutil.Process(pid).net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
        )

    victim_id, victim = max(pids.items(), key=lambda kv: clients(kv[1]))
    carried = clients(victim)
    assert carried > 0
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(60)
    failed = sum(1 for o in outcomes.values() if o != "whole")
    # The killed relay's calls failed; every other stream finished whole.
    assert failed == carried, outcomes
    # Counted: lost grants and their 502s, one each; the model's slots are free at once.
    wait_for(lambda: counter(gw, "corral_relay_lost") - lost_before == carried, 10)
    assert counter(gw, "corral_requests", model="slow", status="502") - bad_before == carried
    wait_for(lambda: gw.status()["models"]["slow"]["in_flight"] == 0, 2)
    # Replaced: a new relay under the same name, and every request answered again.
    wait_for(lambda: relays_of(gw).get(victim_id, victim) != victim, 10)
    assert gw.status()["relays"]["restarts"] >= 1
    assert counter(gw, "corral_relay_restarts") >= 1
    c = gw.client(max_retries=0, timeout=60)
    for i in range(6):
        out = c.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2
        )
        assert out.choices[0].message.content


def test_a_client_that_leaves_mid_stream_frees_its_slot_through_a_relay(gw: Gateway) -> None:
    body = {"model": "slow", "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 10_000, "stream": True}  # fmt: skip
    left_before = counter(gw, "corral_requests", model="slow", status="499")
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as r:
        chunks = r.iter_bytes()  # kept: a generator dropped closes the response
        next(chunks)
        assert gw.status()["models"]["slow"]["in_flight"] == 1
        assert gw.status()["relays"]["grants_open"] == 1
    wait_for(lambda: gw.status()["models"]["slow"]["in_flight"] == 0, 2)
    wait_for(lambda: counter(gw, "corral_requests", model="slow", status="499") > left_before, 5)
    assert gw.status()["relays"]["grants_open"] == 0


def test_a_port_in_use_is_said_once_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [CORRAL, "serve", "--listen", f"127.0.0.1:{port}", "--workers", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path)},
        )
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_workers_0_serves_in_one_process(tmp_path: Path) -> None:
    config = CONFIG.replace("relay_processes: 2", "relay_processes: 0")
    with serve(tmp_path, config) as g:
        assert "relays" not in g.status()
        assert not psutil.Process(g.pid()).children() or all(
            "relays.process" not in " ".join(p.cmdline())
            for p in psutil.Process(g.pid()).children()
        )
        out = g.client(max_retries=0, timeout=60).chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert out.choices[0].message.content
