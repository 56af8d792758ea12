"""Bounded intake on a real `corral serve`: a chunked upload refused the moment it
passes the limit, one huge batch line never read whole, the event loop free during a large
upload, and no `.part` file left by a kill -9."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.batches import finish
from tests.support.gateway import SIM, serve

pytestmark = pytest.mark.e2e

CONFIG = f"""
models:
  alpha:
    load_s: 0.1
    cmd: {SIM} --load-s 0.1 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
batch:
  max_file_mb: 60
  max_line_mb: 1
"""
BOUNDARY = "corralboundary"


def multipart_head(name: str = "in.jsonl") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


def chunked_upload(port: int, total: int, pace_s: float = 0.0) -> tuple[int, int]:
    """POST /v1/files with Transfer-Encoding: chunked and no Content-Length, `total` bytes of
    file in 64 KB chunks; returns (the answer's status, file bytes sent before it came)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n".encode()
    )

    def chunk(data: bytes) -> None:
        s.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    chunk(multipart_head())
    sent = 0
    block = b"x" * 65536
    try:
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # an answer came before the body ended
            chunk(block)
            sent += len(block)
            if pace_s:
                time.sleep(pace_s)
        else:
            chunk(f"\r\n--{BOUNDARY}--\r\n".encode())
            s.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server closed its side after answering
    s.settimeout(30)
    answer = b""
    while b"\r\n" not in answer:
        data = s.recv(4096)
        if not data:
            break
        answer += data
    s.close()
    return int(answer.split(b" ", 2)[1]), sent


def test_a_chunked_upload_is_refused_once_it_passes_the_limit(tmp_path: Path) -> None:
    with serve(tmp_path, CONFIG.replace("max_file_mb: 60", "max_file_mb: 2")) as g:
        port = int(g.url.rsplit(":", 1)[1])
        status, sent = chunked_upload(port, 100 << 20)
        assert status == 413
        # Refused at 2 MB and 64 KB, not after 100 MB (socket buffers hold a few MB more).
        assert sent < 12 << 20
        pid = g.pid()
        # Starlette spools file parts to anonymous files in the temp folder: none kept open.
        spooled = [
            f.path for f in psutil.Process(pid).open_files()
            if Path(f.path).parent == Path(tempfile.gettempdir())
            and Path(f.path).name.startswith("tmp")
        ]  # fmt: skip
        assert spooled == []
    assert g.folder is not None
    assert list((g.folder / "data").rglob("*.part")) == []


def test_one_huge_batch_line_is_never_read_whole(tmp_path: Path) -> None:
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    huge = b'{"custom_id": "b", "pad": "' + b"x" * (50 << 20) + b'"}\n'
    with serve(tmp_path, CONFIG) as g:
        client = g.client(max_retries=0)
        file_id = client.files.create(file=("in.jsonl", line + huge + line), purpose="batch").id
        rss = psutil.Process(g.pid())
        before = rss.memory_info().rss
        b = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        b = finish(client, b.id)
        grown = rss.memory_info().rss - before
        assert httpx.get(f"{g.url}/health").status_code == 200
    assert b.status == "failed"
    messages = [e.message for e in (b.errors.data or [])] if b.errors else []
    assert "line 2: is 50.0 MB; a line may hold 1 MB (batch.max_line_mb)" in messages
    assert grown < 30 << 20  # the line is 50 MB: it was never held whole


def test_health_answers_during_a_large_upload(tmp_path: Path) -> None:
    with serve(tmp_path, CONFIG) as g:
        port = int(g.url.rsplit(":", 1)[1])
        answered: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client() as c:
                while not done.is_set():
                    t0 = time.monotonic()
                    assert c.get(f"{g.url}/health").status_code == 200
                    answered.append(time.monotonic() - t0)
                    time.sleep(0.02)

        t = threading.Thread(target=poll)
        t.start()
        try:
            status, _ = chunked_upload(port, 50 << 20, pace_s=0.002)  # 800 chunks, about 2 s
        finally:
            done.set()
            t.join()
        assert status == 200
        # Decided, not timed: /health kept answering while the upload went on (a loop
        # blocked by the upload would have answered none until it ended).
        assert len(answered) >= 5


WRITER = """
import sys, time
from pathlib import Path
from corral.batch.files import FileStorage
files = FileStorage(Path(sys.argv[1]))
with files._atomic("file-" + sys.argv[2]) as f:  # the path every upload and output takes
    f.write(b"half a file")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
"""


def test_a_writer_killed_9_leaves_no_part_file_after_a_restart(tmp_path: Path) -> None:
    files = tmp_path / "data" / "corral" / "files"
    files.mkdir(parents=True)
    writers = {}
    for name in ("killed", "alive"):  # alive: another node of a cluster, writing right now
        w = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(files), name], stdout=subprocess.PIPE, text=True
        )
        assert w.stdout is not None
        assert w.stdout.readline().strip() == "writing"
        writers[name] = w
    writers["killed"].send_signal(signal.SIGKILL)
    writers["killed"].wait(timeout=10)
    parts = {p.name.split(".")[1]: p for p in files.glob(".*.part")}
    assert set(parts) == {"file-killed", "file-alive"}
    for p in parts.values():
        os.utime(p, (time.time() - 60, time.time() - 60))  # not just created
    try:
        with serve(tmp_path, CONFIG):
            left = {p.name.split(".")[1] for p in files.glob(".*.part")}
    finally:
        writers["alive"].kill()
        writers["alive"].wait(timeout=10)
    assert left == {"file-alive"}
