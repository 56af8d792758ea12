"""A full disk under a real `corral serve`, on a small tmpfs holding its files: an
upload gets a JSON 507 and leaves nothing, a batch whose output does not fit says why and ends
on its own once space returns, and the log says so once, not every tick."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral.backends.process import free_port
from tests.helpers import wait_http_ok
from tests.support.batches import chat_line, lines_of, upload
from tests.support.disks import tmpfs
from tests.support.gateway import CORRAL, SIM, Gateway

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI has it)"),
]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs."""
    with tmpfs(tmp_path / "disk", "16m") as mount:
        yield mount


@contextlib.contextmanager
def serving(tmp_path: Path, small_disk: Path) -> Iterator[tuple[Gateway, list[str]]]:
    """`corral serve` with its files on the small disk (its store beside, on a roomy one);
    yields it and a list that holds the lines it logged once it has stopped."""
    config = tmp_path / "corral.yaml"
    config.write_text(
        f"""
models:
  alpha:
    load_s: 0.1
    concurrency: 4
    cmd: {SIM} --load-s 0.1 --tokens-per-s 100000 --parallel 4
server:
  log_dir: {tmp_path / "logs"}
  data_dir: {small_disk}
  store: sqlite:///{tmp_path / "corral.db"}
batch:
  max_file_mb: 64
"""
    )
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    logged: list[str] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health")
        yield Gateway(f"http://127.0.0.1:{port}", tmp_path), logged
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        logged += err.splitlines()


@pytest.fixture
def gw(tmp_path: Path, small_disk: Path) -> Iterator[tuple[Gateway, list[str]]]:
    with serving(tmp_path, small_disk) as g:
        yield g


def used(disk: Path) -> int:
    return shutil.disk_usage(disk).used


def test_an_upload_on_a_full_disk_gets_507_and_leaves_nothing(
    gw: tuple[Gateway, list[str]], small_disk: Path
) -> None:
    g, _ = gw
    before = used(small_disk)
    r = httpx.post(
        f"{g.url}/v1/files",
        files={"file": ("big.jsonl", b"x" * (20 << 20))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "insufficient_storage"
    assert "no space left" in r.json()["error"]["message"]
    assert list(small_disk.rglob("*.part")) == []
    assert used(small_disk) - before < 1 << 20


def test_a_batch_whose_output_does_not_fit_says_so_and_ends_when_space_returns(
    gw: tuple[Gateway, list[str]], small_disk: Path
) -> None:
    g, _ = gw
    client = g.client(max_retries=0)
    file_id = upload(client, [chat_line(i, "alpha", tokens=40) for i in range(300)])
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * (free - 16 * 1024))  # 16 KB left; the output needs more
    b = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def extension() -> dict[str, object]:
        extra = client.batches.retrieve(b.id).model_extra or {}
        return dict(extra["corral"])

    deadline = time.monotonic() + 120
    while not extension().get("problem"):
        assert time.monotonic() < deadline, client.batches.retrieve(b.id).status
        time.sleep(0.2)
    problem = extension()["problem"]
    assert isinstance(problem, dict)
    assert "no space left" in str(problem["message"])
    assert client.batches.retrieve(b.id).status == "finalizing"
    assert httpx.get(f"{g.url}/health").status_code == 200
    time.sleep(6)  # a retry or two on the full disk
    filler.unlink()  # space returns
    deadline = time.monotonic() + 60
    while (done := client.batches.retrieve(b.id)).status != "completed":
        assert time.monotonic() < deadline, done.status
        time.sleep(0.2)
    assert len(lines_of(client, done.output_file_id)) == 300
    assert (done.model_extra or {})["corral"]["problem"] is None
    assert list(small_disk.rglob("*.part")) == []


def test_the_log_says_it_once_per_cause(tmp_path: Path, small_disk: Path) -> None:
    with serving(tmp_path, small_disk) as (g, logged):
        client = g.client(max_retries=0)
        file_id = upload(client, [chat_line(i, "alpha", tokens=40) for i in range(300)])
        filler = small_disk / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 16 * 1024))
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        time.sleep(12)  # about 50 ticks and two retries on the full disk
        for _ in range(20):
            r = httpx.post(
                f"{g.url}/v1/files",
                files={"file": ("f.jsonl", b"x" * 65536)},
                data={"purpose": "batch"},
            )
            assert r.status_code == 507
    lines = [x for x in logged if "no space" in x]
    assert 1 <= len(lines) <= 3, lines
    assert not [x for x in logged if "Traceback" in x]
