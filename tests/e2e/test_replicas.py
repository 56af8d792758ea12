"""A second copy of a hot model inside one `corral serve`: with two devices and the
default policy, a model whose clients keep one server saturated gets a second server on the
other device, started with that device's environment; both answer (the official openai client,
plain and streamed); once its traffic stops, another model takes the replica's device and the
first copy serves on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import alive
from tests.support.gateway import SIM, Gateway, serve, wait_for

pytestmark = pytest.mark.e2e

CONFIG = f"""
models:
  hot:
    load_s: 0.3
    unload_s: 0.1
    service_s: 0.5
    max_queue: 100
    cmd: {SIM} --load-s 0.3 --unload-s 0.1 --tokens-per-s 20
  cold:
    load_s: 0.3
    unload_s: 0.1
    cmd: {SIM} --load-s 0.3 --unload-s 0.1 --tokens-per-s 50
devices:
  - {{name: gpu0, env: {{CORRAL_TEST_DEVICE: "0"}}}}
  - {{name: gpu1, env: {{CORRAL_TEST_DEVICE: "1"}}}}
server:
  log_dir: LOG_DIR
"""
# Closed-loop clients: enough that the backlog outweighs two loads (`REPLICA_LOADS`) on a loaded
# machine. The measured load is the sim server's start, a Python process: 1.1 s on a quiet
# 2-core machine, 1.4-1.8 s with a build on both cores, where sixteen clients' backlog of
# fifteen 0.2 s answers (3 s) falls short. Twenty clients of 0.5 s answers queue 9.5 s.
CLIENTS = 20


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("replicas"), CONFIG) as g:
        yield g


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def served(copy: dict[str, Any]) -> int:
    n: int = httpx.get(f"{copy['proxy']}/health").json()["served"]
    return n


def test_a_saturated_model_gets_a_second_server_and_gives_it_back(gw: Gateway) -> None:
    stop = threading.Event()
    answers: list[str] = []
    devices: list[str] = []  # each plain answer's x-corral-device: the copy that served it
    errors: list[BaseException] = []

    def client(i: int) -> None:
        c = gw.client(max_retries=0)
        k = 0
        while not stop.is_set():
            k += 1
            try:
                if k % 4:
                    raw = c.chat.completions.with_raw_response.create(
                        model="hot", messages=[{"role": "user", "content": f"c{i}"}], max_tokens=10
                    )
                    devices.append(raw.headers["x-corral-device"])
                    answers.append(raw.parse().choices[0].message.content or "")
                else:
                    parts = c.chat.completions.create(
                        model="hot",
                        messages=[{"role": "user", "content": f"c{i}"}],
                        max_tokens=10,
                        stream=True,
                    )
                    answers.append("".join(p.choices[0].delta.content or "" for p in parts))
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        # One server answers 2 requests a second; the clients keep it saturated, so the
        # scheduler starts a second one on the free device.
        wait_for(lambda: bool(gw.status()["models"]["hot"]["replicas"]), timeout_s=30)
        wait_for(lambda: gw.status()["models"]["hot"]["replicas"][0]["state"] == "ready")
        time.sleep(2.0)  # both copies serve for a while
        hot = gw.status(auth=True)["models"]["hot"]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors[:3]
    assert answers
    assert all(len(a.split()) == 10 for a in answers)

    (replica,) = hot["replicas"]
    assert {hot["device"], replica["device"]} == {"gpu0", "gpu1"}
    assert replica["pid"] != hot["pid"]
    assert alive(replica["pid"])
    # Each server runs with its own device's environment.
    assert environ(hot["pid"])["CORRAL_TEST_DEVICE"] == hot["device"][-1]
    assert environ(replica["pid"])["CORRAL_TEST_DEVICE"] == replica["device"][-1]
    # Both servers answered: what the gateway dispatched to the replica reached its server.
    primary = {"proxy": hot["proxy"]}
    assert served(replica) >= replica["dispatched"] > 0
    assert served(primary) > 0
    assert served(primary) + served(replica) == len(answers)
    assert set(devices) == {"gpu0", "gpu1"}  # each answer names the device that served it
    assert gw.status()["swaps"] == 2  # hot, then its replica: no other load

    # The traffic stopped: a request for another model takes the replica's device (the
    # replica goes first), and hot's first copy stays for its next request.
    time.sleep(1.0)
    c = gw.client(max_retries=0)
    cold = c.chat.completions.create(
        model="cold", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert cold.choices[0].message.content
    status = gw.status()
    assert status["models"]["hot"]["replicas"] == []
    assert status["models"]["hot"]["device"] == hot["device"]
    assert status["models"]["cold"]["device"] == replica["device"]
    wait_for(lambda: not alive(replica["pid"]))  # its server was stopped
    again = c.chat.completions.create(
        model="hot", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert again.choices[0].message.content
    assert gw.status()["swaps"] == 3  # cold's load only: hot never left
