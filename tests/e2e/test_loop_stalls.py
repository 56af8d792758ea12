"""What the gateway does besides relaying never holds its event loop: a batch created, run and
its output read, a config reload, `/api/status` and `/ui` over 200 models, and 500 requests
queued behind a loading model. Each test reads the gateway's own loop watch (servers/
loopwatch.py), which logs every stall with the code the loop was running and Corral's frames
that called it: no stall may name the operation's code (`SHORT_S`, below). Read from what ran
on the loop, not from how long anything took, so it holds on a busy machine (a starved loop
may stall while it waits in its selector or relays; that names none of these)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from corral.backends.process import free_port
from corral.store.sql_batches import LINES_PER_TX
from tests.helpers import wait_http_ok
from tests.support.batches import chat_line
from tests.support.gateway import CORRAL, SIM

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
# Code that must never run on the loop is caught at any stall, however short: these tests log
# stalls from 30 ms. Code that runs on the loop by design (the scheduler, the status) is held
# to the default 250 ms, which a busy machine's own starvation does not reach.
SHORT_S = 0.03

FAST = (
    f"load_s: 0.2\n    concurrency: 4\n    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 4"
)
SLOW_LOAD = (
    f"load_s: 3\n    concurrency: 8\n    cmd: {SIM} --load-s 3 --tokens-per-s 2000 --parallel 8"
)


class Served:
    def __init__(self, url: str, config: Path, log: Path) -> None:
        self.url, self.config, self.log = url, config, log

    def stalls(self) -> list[str]:
        return [ln for ln in self.log.read_text().splitlines() if "event loop has not run" in ln]

    def blamed(self, *parts: str) -> list[str]:
        """The stalls whose stack names any of `parts` (paths under src/corral)."""
        return [s for s in self.stalls() if any(f"corral/{p}" in s for p in parts)]

    def watched(self) -> float:
        """How many lags the watch measured: it ran all along."""
        text = httpx.get(f"{self.url}/metrics").text
        line = next(
            ln for ln in text.splitlines() if ln.startswith("corral_event_loop_lag_seconds_count")
        )
        return float(line.split()[-1])


Start = Callable[..., Served]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Start]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(models: str, watch: bool = False, stall_s: float = 0.25) -> Served:
        config = tmp_path / "corral.yaml"
        config.write_text(f"models:\n{models}server:\n  log_dir: {tmp_path / 'logs'}\n")
        port = free_port()
        log = tmp_path / "serve.log"
        argv = [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"]
        with log.open("w") as err:
            procs.append(
                subprocess.Popen(
                    [*argv, *(["--watch"] if watch else [])],
                    stderr=err,
                    env={
                        **os.environ,
                        "XDG_DATA_HOME": str(tmp_path / "data"),
                        "CORRAL_LOOP_STALL_S": str(stall_s),
                    },
                )
            )
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", timeout_s=120)
        return Served(url, config, log)

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=60)


def test_a_batch_created_run_and_read_runs_its_store_and_file_work_off_the_loop(
    serve: Start,
) -> None:
    s = serve(f"  alpha:\n    {FAST}\n", stall_s=SHORT_S)
    n = 2 * LINES_PER_TX + 100  # stored in three transactions
    with httpx.Client(base_url=s.url, timeout=120) as c:
        body = ("\n".join(chat_line(i, "alpha", tokens=1) for i in range(n)) + "\n").encode()
        file_id = c.post(
            "/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}
        ).json()["id"]
        made = c.post("/v1/batches", json={"input_file_id": file_id,
                      "endpoint": "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
        assert made.status_code == 200, made.text
        batch_id = made.json()["id"]
        deadline = time.monotonic() + 600
        while (b := c.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
            assert b["status"] in ("validating", "in_progress", "finalizing"), b
            assert time.monotonic() < deadline
            time.sleep(0.5)
        out = c.get(f"/v1/files/{b['output_file_id']}/content")
        assert out.content.count(b"\n") == n
        assert s.watched() > 0
    # The store, the files and the batch's own logic (checking, storing, finalizing) are
    # synchronous: they run in threads, never on the loop.
    sync = ("store/", "batch/service.py", "batch/jsonl.py", "batch/files.py", "batch/finalize.py")
    assert s.blamed(*sync) == []


def test_a_config_reload_reads_and_checks_the_file_off_the_loop(serve: Start) -> None:
    # 200 models: a file whose reading and checking takes long enough to be seen if it ran on
    # the loop (about 0.1 s here).
    many = "".join(f"  m{i:03}:\n    {FAST}\n" for i in range(200))
    s = serve(many, watch=True, stall_s=SHORT_S)
    for i in range(5):
        s.config.write_text(
            s.config.read_text().replace("models:\n", f"models:\n  extra{i}:\n    {FAST}\n", 1)
        )
        deadline = time.monotonic() + 60
        while f"extra{i}" not in httpx.get(f"{s.url}/v1/models").text:
            assert time.monotonic() < deadline, f"extra{i} never served"
            time.sleep(0.1)
    assert s.watched() > 0
    # Reading and checking the file; applying it (config/ models, the scheduler) is the loop's.
    assert s.blamed("compose.py", "config/load.py", "modelfiles/") == []


def test_status_and_the_dashboard_over_200_models_leave_the_loop_free(serve: Start) -> None:
    s = serve("".join(f"  m{i:03}:\n    {FAST}\n" for i in range(200)))
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for _ in range(20):
            status = c.get("/api/status")
            assert status.status_code == 200
            assert len(status.json()["models"]) == 200
            assert c.get("/ui").status_code == 200
        assert s.watched() > 0
    assert s.blamed("gateway/servers/status.py", "gateway/doors/", "core/") == []


def test_500_requests_queued_behind_a_loading_model_are_admitted_without_holding_the_loop(
    serve: Start,
) -> None:
    s = serve(f"  slow:\n    {SLOW_LOAD}\n  other:\n    {FAST}\n")

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=600)
        async with httpx.AsyncClient(base_url=s.url, timeout=300, limits=limits) as c:
            body = {
                "model": "slow",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}],
            }
            answers = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(500))
            )
        return [a.status_code for a in answers]

    assert asyncio.run(burst()) == [200] * 500
    assert s.watched() > 0
    # Admitting, queueing and dispatching are the scheduler's decisions over the whole queue.
    assert s.blamed("core/", "gateway/pipeline/admission.py") == []
