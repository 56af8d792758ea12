"""llama-server's load modes on zoo files cold and warm: for each size and
each `--load-mode` the server takes (`mmap`, its default; `none`, a plain read into the
server's own buffers, what `--no-mmap` was; `dio`, direct I/O past the page cache), the time
from spawn to a 200 on `/health` with the file dropped from the page cache (`posix_fadvise`
after an fsync, checked with `mincore`) and with it read just before; how much of the file the
page cache holds once the server is up (what the next load finds), and the server's RSS. A
plain read of the file, cold and warm, tells the disk from the server's own work.

    .venv/bin/python benchmarks/bench_load_modes.py [--sizes 1 4 8] [--rounds 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench_page_cache import read_s
from corral.backends.process import free_port
from corral.modelfiles.folder import find_llama_server
from corral.modelfiles.mincore import cached, drop
from corral.zoo import file_name, make

MODES = ("mmap", "none", "dio")


def make_cold(path: Path) -> float:
    """Drop `path` from the page cache; the fraction left (a stopped server may hold it mapped
    for a moment: tried again for up to 5 s)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    left = 1.0
    for _ in range(100):
        drop([path])
        left = cached([path]) or 0.0
        if left < 0.01:
            break
        time.sleep(0.05)
    return left


def load(binary: str, path: Path, mode: str) -> dict[str, Any]:
    """Spawn to healthy with `--load-mode mode`; then the page cache's share of the file and
    the server's RSS; then stop it."""
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [binary, "-m", str(path), "--port", str(port), "--ctx-size", "4096", "--parallel", "1",
         "--load-mode", mode],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"llama-server --load-mode {mode} exited: {err[-2000:]}")
            time.sleep(0.01)
        load_s = time.perf_counter() - started
        rss = sum(p.memory_info().rss for p in [psutil.Process(proc.pid)])
        return {"load_s": load_s, "cached_after": cached([path]), "rss_gb": rss / 1e9}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    binary = find_llama_server()
    if binary is None:
        sys.exit("llama-server is not installed: `make .venv/.installed-embed`")
    rows: list[dict[str, Any]] = []
    print(
        "| file | mode | cold load | warm load | cached after cold | RSS | cold read | warm read |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        folder = Path("out") / f"zoo-{size:g}GB"
        path = folder / file_name(args.arch, size)
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            print(f"writing {path} ...", file=sys.stderr)
            make(args.arch, folder, size_gb=size)
        gb = path.stat().st_size / 1e9
        reads: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(args.rounds):
            make_cold(path)
            reads["cold"].append(read_s(path))
            reads["warm"].append(read_s(path))
        for mode in args.modes:
            got: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
            for _ in range(args.rounds):
                left = make_cold(path)
                got["cold"].append({**load(binary, path, mode), "cached_before": left})
                read_s(path)
                got["warm"].append({**load(binary, path, mode), "cached_before": cached([path])})
            row = {
                "file": path.name, "gb": round(gb, 3), "mode": mode,
                "cold_load_s": median([x["load_s"] for x in got["cold"]]),
                "warm_load_s": median([x["load_s"] for x in got["warm"]]),
                "cached_after_cold": median([x["cached_after"] or 0.0 for x in got["cold"]]),
                "rss_gb": median([x["rss_gb"] for x in got["warm"]]),
                "cold_read_s": median(reads["cold"]), "warm_read_s": median(reads["warm"]),
                "runs": got,
            }  # fmt: skip
            rows.append(row)
            print(
                f"| {path.name} ({gb:.2f} GB) | {mode} | {row['cold_load_s']:.2f} s | "
                f"{row['warm_load_s']:.2f} s | {row['cached_after_cold']:.0%} | "
                f"{row['rss_gb']:.2f} GB | {row['cold_read_s']:.2f} s | "
                f"{row['warm_read_s']:.2f} s |",
                flush=True,
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
