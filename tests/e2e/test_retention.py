"""What a long-running gateway keeps: an ended batch's lines leave the store after
`batch.line_retention_days`; the batch, its counts and its output stay (the store's contract
tests hold that a running batch's lines are never deleted)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.batches import chat_line, finish, upload
from tests.support.gateway import SIM, serve

pytestmark = pytest.mark.e2e


def test_an_ended_batchs_lines_are_deleted_after_the_retention(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    config = f"""
models:
  alpha:
    load_s: 0.1
    concurrency: 4
    cmd: {SIM} --load-s 0.1 --tokens-per-s 5000 --parallel 4
server:
  log_dir: LOG_DIR
  store: sqlite:///{db}
batch:
  line_retention_days: 0.00003   # 2.6 s
"""
    with serve(tmp_path, config) as gw:
        client = gw.client(max_retries=0)
        file_id = upload(client, [chat_line(i, "alpha") for i in range(5)])
        b = finish(
            client,
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id,
        )
        assert b.status == "completed"

        def lines() -> int:
            with sqlite3.connect(db) as c:
                (n,) = c.execute(
                    "SELECT count(*) FROM corral_tasks WHERE batch_id = ?", (b.id,)
                ).fetchone()
            return int(n)

        deadline = time.monotonic() + 60  # the worker looks every lease_s / 2 (5 s)
        while lines() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert lines() == 0
        again = client.batches.retrieve(b.id)
        assert again.status == "completed"
        assert again.request_counts is not None
        assert (again.request_counts.total, again.request_counts.completed) == (5, 5)
        assert client.files.content(again.output_file_id or "").text.count("\n") == 5


def test_usage_outlives_a_restart(tmp_path: Path) -> None:
    """What `/api/usage` counted is in the store when the gateway stops, and read back when it
    starts: a restart adds to it, loses nothing."""
    config = f"""
models:
  alpha:
    load_s: 0.1
    cmd: {SIM} --load-s 0.1
server:
  log_dir: LOG_DIR
  store: sqlite:///{tmp_path / "store.db"}
"""

    def calls(n: int) -> list[dict[str, object]]:
        with serve(tmp_path, config) as gw:
            client = gw.client(max_retries=0)
            for _ in range(n):
                client.chat.completions.create(
                    model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            r = httpx.get(f"{gw.url}/api/usage", params={"by": "total"}, timeout=30)
            assert r.status_code == 200, r.text
            rows: list[dict[str, object]] = r.json()["data"]
            return rows

    first = calls(2)
    assert [row["requests"] for row in first] == [2]
    again = calls(1)
    assert [row["requests"] for row in again] == [3]
    assert again[0]["output_tokens"] == 3 * int(first[0]["output_tokens"]) // 2  # type: ignore[call-overload]


def test_a_stream_that_never_ends_does_not_hold_a_stopping_server(tmp_path: Path) -> None:
    """On SIGTERM an answer still streaming gets `server.shutdown_grace_s`, then it is cut and
    the server stops (`serve` waits 30 s for it, and for its model servers to be gone)."""
    config = f"""
models:
  slow:
    cmd: {SIM} --load-s 0.1 --tokens-per-s 2
server:
  log_dir: LOG_DIR
  shutdown_grace_s: 1
"""
    ended: list[str] = []
    reading = threading.Event()

    def stream(url: str) -> None:
        body = {
            "model": "slow",
            "stream": True,
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": "go on"}],
        }
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    reading.set()
            ended.append("ended")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)

    with serve(tmp_path, config) as gw:
        t = threading.Thread(target=stream, args=(gw.url,), daemon=True)
        t.start()
        assert reading.wait(60)
        stopping = time.monotonic()
    t.join(timeout=30)
    assert ended  # the client saw its stream end, cut
    assert time.monotonic() - stopping < 30
