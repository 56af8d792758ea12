"""Simulated requests per second of wall time: 1,000,000 requests over 20 models.

Run: `make bench` (or `.venv/bin/python benchmarks/bench_simulator.py [--requests N] [--policy P]`).
Target: >= 100,000 simulated requests per second of wall time, so decisions must cost
O(log n) in the queue length, not a scan of the queue.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time

from corral.config import POLICY_NAMES, parse_config
from corral.sim.engine import simulate
from corral.sim.metrics import summarize
from corral.sim.trace import Trace, TraceLine


def make_workload(requests: int, models: int, seed: int = 7) -> tuple[str, Trace]:
    """Poisson arrivals at load 0.9 over `models` models with Zipf-like popularity."""
    rng = random.Random(seed)
    names = [f"model-{i:02d}" for i in range(models)]
    config = "models:\n" + "".join(
        f"  {n}: {{load_s: {rng.uniform(2, 20):.1f}, unload_s: 1, service_s: 1, "
        f"concurrency: {rng.choice([1, 2, 4])}}}\n"
        for n in names
    )
    config += "scheduler: {policy: cost, max_wait_s: 900}\n"
    popularity = [1 / (i + 1) for i in range(models)]
    # Mean service 0.5 s at concurrency ~2: a rate that keeps the device busy but stable.
    rate = 2.0
    t = 0.0
    lines = []
    chosen = rng.choices(names, weights=popularity, k=requests)
    for i, model in enumerate(chosen, start=1):
        t += rng.expovariate(rate)
        lines.append(TraceLine(i, model, rng.expovariate(2.0) + 0.01, 0, t))
    return config, Trace(lines, "<benchmark>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--policy", action="append", choices=POLICY_NAMES)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    config_text, trace = make_workload(args.requests, args.models)
    config = parse_config(config_text, "<benchmark>")
    results = []
    for policy in args.policy or ["cost"]:
        gc.collect()
        gc.disable()  # the run allocates millions of long-lived objects; the GC only slows it
        start = time.perf_counter()
        run = simulate(config.with_policy(policy), trace)
        wall_s = time.perf_counter() - start
        gc.enable()
        s = summarize(run)
        results.append(
            {
                "policy": policy,
                "requests": args.requests,
                "models": args.models,
                "wall_s": round(wall_s, 2),
                "requests_per_s": round(args.requests / wall_s),
                "loads": s["loads"],
                "wait_mean_s": round(s["wait_mean_s"], 2),
                "busy_frac": round(s["busy_frac"], 3),
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                    "results": results,
                }
            )
        )
        return
    print(f"python {platform.python_version()} on {platform.machine()}")
    for r in results:
        print(
            f"{r['policy']:10s} {r['requests']:>9,} requests over {r['models']} models in "
            f"{r['wall_s']:6.2f} s wall = {r['requests_per_s']:>9,} simulated requests/s "
            f"(loads {r['loads']:,}, mean wait {r['wait_mean_s']} s, busy {r['busy_frac']})"
        )


if __name__ == "__main__":
    main()
