"""`corral serve` as a real process for the tests: `serve` starts one on a configuration (its
model servers the sim backend, `SIM`, or any command), `Gateway` is its URL with the official
client; and the helpers the gateway tests share."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from corral.backends.process import free_port
from tests.helpers import alive, wait_http_ok

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")


SIM = f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}}"


KEY = "sekret"


class Gateway:
    def __init__(self, url: str, folder: Path | None = None) -> None:
        self.url = url
        self.folder = folder  # its config, logs and data, when `serve` started it
        self.stderr = ""  # what it logged, once `serve` has stopped it
        self.lines: list[str] = []  # what it has logged so far, while `serve` runs it

    def logged(self) -> str:
        """What it has logged so far."""
        return "".join(self.lines)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", _strict_response_validation=True, **kw
        )

    def pid(self) -> int:
        """The `corral serve` process `serve` started (a child of this test process)."""
        assert self.folder is not None
        config = str(self.folder / "corral.yaml")
        (proc,) = [p for p in psutil.Process().children() if config in " ".join(p.cmdline())]
        return int(proc.pid)

    def status(self, auth: bool = False) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
        body: dict[str, Any] = httpx.get(f"{self.url}/api/status", headers=headers).json()
        return body


@contextlib.contextmanager
def serve(folder: Path, config_text: str, env: dict[str, str] | None = None) -> Iterator[Gateway]:
    """`corral serve` on `config_text` (LOG_DIR replaced), its data in `folder` (unless the
    caller's environment sets XDG_DATA_HOME)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "corral.yaml"
    config.write_text(config_text.replace("LOG_DIR", str(folder / "logs")))
    port = free_port()
    env = {"XDG_DATA_HOME": str(folder / "data"), **os.environ, **(env or {})}
    argv = [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"]
    if os.environ.get("CORRAL_TEST_WORKERS"):  # run a suite through relay processes
        argv += ["--workers", os.environ["CORRAL_TEST_WORKERS"]]
    proc = subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    gw = Gateway(url, folder)
    assert proc.stderr is not None
    reader = threading.Thread(target=gw.lines.extend, args=(proc.stderr,), daemon=True)
    reader.start()  # read as it logs, so a test can wait for a line
    wait_http_ok(f"{url}/health")
    try:
        yield gw
    finally:
        pids = [m["pid"] for m in gw.status(auth=True)["models"].values() if m["pid"]]
        proc.terminate()  # uvicorn shuts down gracefully, then re-raises SIGTERM
        proc.wait(timeout=30)
        reader.join(timeout=30)
        err = gw.stderr = gw.logged()
        assert proc.returncode in (0, -signal.SIGTERM), err
        assert not [pid for pid in pids if alive(pid)]  # it stopped its model servers


def wait_for(what: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def swaps_from_metrics(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "corral_swaps"]
    return sum(s.value for s in family.samples if s.name == "corral_swaps_total")


def run_agents(gw: Gateway, rounds: int) -> int:
    """An orchestrator, two explorers (one model) and a coder, each a closed loop."""
    client = gw.client(max_retries=0)
    answered: list[str] = []

    def agent(model: str) -> None:
        for i in range(rounds):
            out = client.completions.create(model=model, prompt=f"step {i}", max_tokens=5)
            answered.append(out.choices[0].text)

    threads = [
        threading.Thread(target=agent, args=(m,))
        for m in ("orchestrator", "explorer", "explorer", "coder")
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 400
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return len(answered)


@contextlib.contextmanager
def external_sim(model: str) -> Iterator[str]:
    """A server Corral does not start, like a vLLM already running with sleep mode."""
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "sim-backend", "--model", model, "--port", str(port), "--load-s", "0.3"],
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
