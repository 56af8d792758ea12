"""Is the event loop free while a large file comes in? ("/health answers within 100 ms
during a 200 MB upload").

Starts `corral serve`, then polls `/health` every 10 ms from one client while another uploads a
200 MB batch file (multipart, chunked, as fast as loopback takes it): the latency of each
`/health` during the upload, against the same polling with nothing else going on.

Run: `make bench-intake`, or `.venv/bin/python benchmarks/bench_intake.py [--mb 200]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from corral.backends.process import free_port

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
BOUNDARY = "benchboundary"


def upload(port: int, mb: int) -> float:
    """A chunked multipart upload of `mb` MB; returns its seconds."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n".encode()
    )

    def chunk(data: bytes) -> None:
        s.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    chunk(
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
    )
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
    block = line * (65536 // len(line))
    for _ in range((mb << 20) // len(block)):
        chunk(block)
    chunk(f"\r\n--{BOUNDARY}--\r\n".encode())
    s.sendall(b"0\r\n\r\n")
    answer = s.recv(4096)
    s.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.monotonic() - t0


def poll(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client() as c:
        while not stop.is_set():
            t0 = time.monotonic()
            c.get(url).raise_for_status()
            out.append((time.monotonic() - t0) * 1000)
            time.sleep(0.01)


def figures(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    p50 = statistics.median(xs)
    return f"{len(xs)} answers, p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {xs[-1]:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="corral-intake-"))
    (folder / "corral.yaml").write_text(
        "models:\n  m: {upstream: 'http://127.0.0.1:9'}\n"
        f"server:\n  log_dir: {folder / 'logs'}\nbatch:\n  max_file_mb: {args.mb + 10}\n"
    )
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(folder / "data")}
    proc = subprocess.Popen(
        [CORRAL, "serve", "--config", str(folder / "corral.yaml"), "--listen",
         f"127.0.0.1:{port}"], env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/health"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "corral serve did not start"
                time.sleep(0.1)
        idle: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(url, stop, idle))
        t.start()
        time.sleep(3)
        stop.set()
        t.join()
        during: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(url, stop, during))
        t.start()
        seconds = upload(port, args.mb)
        stop.set()
        t.join()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"machine: {platform.node()} ({os.cpu_count()} CPUs), python {platform.python_version()}")
    print(f"/health, nothing else going on: {figures(idle)}")
    print(f"/health during a {args.mb} MB upload ({seconds:.1f} s): {figures(during)}")


if __name__ == "__main__":
    main()
