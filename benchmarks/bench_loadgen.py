"""`corral bench`'s own overhead: against one sim backend, the rate `corral bench`
measures at a concurrency against the rate a bare client sustains on the same server in the same
run (aiohttp, the same streamed requests, no timing or bookkeeping), alternating the two.

Run: `.venv/bin/python benchmarks/bench_loadgen.py [--requests 800] [--concurrency 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench_gateway import wait_ok
from corral.backends.process import free_port
from corral.bench.loadgen import Spec, body, run_point

CORRAL = str(Path(sys.executable).parent / "corral")


async def bare(url: str, spec: Spec, concurrency: int) -> float:
    """Requests per second of a client that only sends and drains: the server's rate."""
    counter = itertools.count()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def loop() -> None:
            while (i := next(counter)) < spec.requests:
                async with session.post(url, json=body(spec, spec.models[0], i)) as resp:
                    async for _ in resp.content.iter_any():
                        pass

        began = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return spec.requests / (time.monotonic() - began)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [CORRAL, "sim-backend", "--model", "sim", "--port", str(port), "--load-s", "0",
         "--tokens-per-s", "500", "--parallel", str(args.concurrency)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ok(f"{base}/health", 30)
        spec = Spec(base, "chat", ["sim"], args.requests, max_tokens=25)
        bench_rates, bare_rates = [], []
        for _ in range(args.rounds):
            point = asyncio.run(run_point(spec, concurrency=args.concurrency))
            bench_rates.append(point.summary()["requests_per_s"])
            bare_rates.append(
                asyncio.run(bare(f"{base}/v1/chat/completions", spec, args.concurrency))
            )
        best_bench, best_bare = max(bench_rates), max(bare_rates)
        print(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "concurrency": args.concurrency,
                    "requests": args.requests,
                    "corral_bench_req_per_s": bench_rates,
                    "bare_client_req_per_s": [round(x, 2) for x in bare_rates],
                    "ratio_best": round(best_bench / best_bare, 3),
                },
                indent=2,
            )
        )
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
