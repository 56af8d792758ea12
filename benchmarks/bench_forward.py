"""What a hop between `corral serve` nodes costs (several hosts): node B holds the
model, node A does not, both on one PostgreSQL schema. The same 1-token request goes straight to
B and through A (which forwards it to B), targets taking turns in blocks so drifts hit both;
p50/p95 of each and the difference, non-streamed and streamed (time to the first chunk), then
throughput with 32 concurrent clients for a few seconds each way.

Run: `make bench-forward` (or `.venv/bin/python benchmarks/bench_forward.py [--requests 500]`).
Needs PostgreSQL at 127.0.0.1:5432 (database `test`, trust auth).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
PG = "postgresql://postgres@127.0.0.1:5432/test"
CONFIG = """
models:
  m:
    load_s: 0.5
    concurrency: 64
    cmd: >-
      {corral} sim-backend --model ${{MODEL_ID}} --port ${{PORT}} --load-s 0.5 --parallel 64
      --tokens-per-s 1000 --max-tokens 1
server:
  listen: 127.0.0.1:{port}
  log_dir: {home}/logs
  data_dir: {data}
  store: {store}
"""
BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nodes(n: int) -> Iterator[list[str]]:
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-forward-"))
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    store = f"{PG}?schema={schema}"
    procs, urls = [], []
    try:
        for i in range(n):
            port = free_port()
            home = folder / f"node{i}"
            home.mkdir()
            config = home / "corral.yaml"
            text = CONFIG.format(
                corral=CORRAL, port=port, home=home, data=folder / "data", store=store
            )
            config.write_text(text)
            log = (home / "stderr.log").open("w")
            procs.append(subprocess.Popen([CORRAL, "serve", "--config", str(config)], stderr=log))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait(lambda url=url: ok(f"{url}/health"), 60)
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        shutil.rmtree(folder, ignore_errors=True)


def ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait(what: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def one(client: httpx.Client, url: str, stream: bool) -> tuple[float, str]:
    """Seconds to the whole answer (or to its first chunk when streamed), and the node that
    answered."""
    started = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/v1/chat/completions", json=BODY)
        r.raise_for_status()
        return time.perf_counter() - started, r.headers["x-corral-node"]
    with client.stream("POST", f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as r:
        r.raise_for_status()
        chunks = r.iter_raw()
        assert next(chunks)
        took = time.perf_counter() - started
        for _ in chunks:
            pass
        return took, r.headers["x-corral-node"]


def latencies(
    targets: dict[str, str], requests: int, stream: bool, holder: str
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in targets}
    with httpx.Client(timeout=30) as client:
        for url in targets.values():  # warm the connections and the pools
            for _ in range(20):
                one(client, url, stream)
        block = 25
        for _ in range(requests // block):
            for name, url in targets.items():
                for _ in range(block):
                    took, node = one(client, url, stream)
                    assert node == holder, (name, node)  # the hop really went to B
                    out[name].append(took)
    return out


def throughput(url: str, seconds: float = 4.0, clients: int = 32) -> float:
    done = [0] * clients
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < stop:
                client.post(f"{url}/v1/chat/completions", json=BODY).raise_for_status()
                done[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - started)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--json", type=Path, default=Path("out/bench_forward.json"))
    args = ap.parse_args()
    with nodes(2) as (a, b):
        r = httpx.post(f"{b}/api/models/m/load?wait=true", timeout=60)
        r.raise_for_status()
        holder = httpx.get(f"{b}/api/status").json()["cluster"]["node"]

        def a_sees_b() -> bool:
            for n in httpx.get(f"{a}/api/status").json()["cluster"]["nodes"]:
                if n["id"] == holder and any(m["state"] == "ready" for m in n["models"]):
                    return True
            return False

        wait(a_sees_b, 30)
        targets = {"straight to B": b, "through A (forwarded)": a}
        result: dict[str, Any] = {"machine": platform.platform(), "requests": args.requests}
        rows = []
        for stream in (False, True):
            lat = latencies(targets, args.requests, stream, holder)
            kind = "streamed, first chunk" if stream else "whole answer"
            p50 = {k: pct(v, 0.5) for k, v in lat.items()}
            p95 = {k: pct(v, 0.95) for k, v in lat.items()}
            for k in targets:
                rows.append((kind, k, p50[k], p95[k]))
            result[kind] = {
                "p50_ms": p50,
                "p95_ms": p95,
                "added_p50_ms": p50["through A (forwarded)"] - p50["straight to B"],
                "mean_ms": {k: statistics.fmean(v) * 1000 for k, v in lat.items()},
            }
        rps = {k: throughput(url) for k, url in targets.items()}
        result["throughput_rps"] = rps
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("| request | path | p50 ms | p95 ms |")
    print("|---|---|---:|---:|")
    for kind, k, p50_ms, p95_ms in rows:
        print(f"| {kind} | {k} | {p50_ms:.2f} | {p95_ms:.2f} |")
    for kind in ("whole answer", "streamed, first chunk"):
        print(f"added by the hop ({kind}), p50: {result[kind]['added_p50_ms']:.2f} ms")
    print("throughput, 32 clients: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in rps.items()))


if __name__ == "__main__":
    main()
