"""The Batch API at scale.

1. Intake: upload a 200,000-line JSONL file (about 100 MB) to `corral serve`, create the batch
   (check every line, store the batch and its lines as tasks); wall time of each step and the
   server's peak RSS (VmHWM) afterwards. Targets: <= 10 s together, <= 300 MB.
2. Throughput: a 10,000-line batch on a sim server, lines per second over its run time
   (`corral.run_s`: from in progress to the last line ended, to the millisecond), against the
   same server's own capacity measured straight, in the same run, with as many concurrent
   clients as its slots. Target: >= 95%.

Run: `make bench-batch` (or `.venv/bin/python benchmarks/bench_batch.py [--lines 200000]`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_gateway import free_port, wait_ok

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
SLOTS = 16
TOKENS = 20
TOKENS_PER_S = 200  # per slot: 0.1 s per line, like a short real answer
SIM = (
    f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}} --load-s 0.5 "
    f"--tokens-per-s {TOKENS_PER_S} --parallel {SLOTS}"
)
CONFIG = f"""
models:
  writer:
    load_s: 0.5
    concurrency: {SLOTS}
    cmd: {SIM}
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: FOLDER/logs
  data_dir: FOLDER/data
batch:
  max_lines: 250000
  max_file_mb: 200
"""
PAD = "lorem ipsum dolor sit amet " * 14  # ~380 bytes: lines of about 500 bytes


def write_file(path: Path, n: int, tokens: int) -> int:
    with path.open("w") as f:
        for i in range(n):
            body = {
                "model": "writer",
                "messages": [{"role": "user", "content": f"{i} {PAD}"}],
                "max_tokens": tokens,
            }
            item = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps({**item, "body": body}) + "\n")
    return path.stat().st_size


def rss_peak_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def wait_batch(client: httpx.Client, url: str, batch_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b: dict[str, Any] = client.get(f"{url}/v1/batches/{batch_id}").json()
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.5)
    raise SystemExit(f"batch {batch_id} did not end within {timeout_s:g} s")


def upload_and_create(client: httpx.Client, url: str, path: Path) -> tuple[Any, float, float]:
    """Upload `path`, create a batch from it; returns the batch and the seconds of each step."""
    t = time.perf_counter()
    with path.open("rb") as f:
        up = client.post(
            f"{url}/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}
        )
    upload_s = time.perf_counter() - t
    up.raise_for_status()
    t = time.perf_counter()
    created = client.post(
        f"{url}/v1/batches",
        json={
            "input_file_id": up.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    create_s = time.perf_counter() - t
    created.raise_for_status()
    return created.json(), upload_s, create_s


def intake(url: str, pid: int, folder: Path, n: int) -> dict[str, Any]:
    path = folder / "big.jsonl"
    size = write_file(path, n, TOKENS)
    with httpx.Client(timeout=600) as client:
        batch, upload_s, create_s = upload_and_create(client, url, path)
        assert batch["status"] == "in_progress", batch
        assert batch["request_counts"]["total"] == n
        client.post(f"{url}/v1/batches/{batch['id']}/cancel").raise_for_status()
        wait_batch(client, url, batch["id"], 600)
    return {
        "lines": n,
        "file_mb": round(size / 2**20, 1),
        "upload_s": round(upload_s, 2),
        "validate_and_enqueue_s": round(create_s, 2),
        "total_s": round(upload_s + create_s, 2),
        "peak_rss_mb": round(rss_peak_mb(pid), 1),
    }


async def _direct(proxy: str, n: int) -> float:
    body = {"model": "writer", "messages": [{"role": "user", "content": PAD}], "max_tokens": TOKENS}
    left = n
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=SLOTS)) as c:

        async def one() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                r = await c.post(f"{proxy}/v1/chat/completions", json=body)
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(SLOTS)))
        return n / (time.perf_counter() - t)


def throughput(url: str, folder: Path, n: int) -> dict[str, Any]:
    path = folder / "ten.jsonl"
    write_file(path, n, TOKENS)
    with httpx.Client(timeout=600) as client:
        batch, _, _ = upload_and_create(client, url, path)
        done = wait_batch(client, url, batch["id"], 3600)
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}, done
        took_s = done["corral"]["run_s"]
        proxy = client.get(f"{url}/api/status").json()["models"]["writer"]["proxy"]
    # The server's own capacity, straight to it with one client per slot (in the same run).
    direct_rps = asyncio.run(_direct(proxy, n))
    batch_rps = n / max(took_s, 1)
    return {
        "lines": n,
        "batch_s": took_s,
        "batch_lines_per_s": round(batch_rps, 1),
        "direct_lines_per_s": round(direct_rps, 1),
        "ratio": round(batch_rps / direct_rps, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--throughput-lines", type=int, default=10_000)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-batch-"))
    port = free_port()
    (folder / "c.yaml").write_text(
        CONFIG.replace("LISTEN_PORT", str(port)).replace("FOLDER", str(folder))
    )
    env = {**os.environ, "XDG_DATA_HOME": str(folder / "xdg")}
    argv = [CORRAL, "serve", "--config", str(folder / "c.yaml")]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ok(f"{url}/health", 60)
        big = intake(url, proc.pid, folder, args.lines)
        tput = throughput(url, folder, args.throughput_lines)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{platform.node()}, {os.cpu_count()} CPUs")
    print(json.dumps({"intake": big, "throughput": tput}, indent=2))


if __name__ == "__main__":
    main()
