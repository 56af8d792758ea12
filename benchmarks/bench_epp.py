"""Three `corral serve` hosts behind llm-d's endpoint picker, as the recipe configures it, against
round-robin: loads and latency, in the same run.

Each host (a network namespace of its own, tests/e2e/netns.py: needs root) runs `corral serve`
alone, its own SQLite store, one device that holds one of the three models at a time (sim
backends with `--load-s` and `--tokens-per-s`). The requests, Poisson arrivals over the three
models at random, go through a router of the tests' own (tests/support/epp_router.py) that
picks the host as the EPP does with deploy/epp/epp-config.yaml: the documented scorers
(lora-affinity, queue, KV use) at the config's weights, on figures scraped from each host's
/metrics at most 50 ms old. Then the same requests, on three fresh hosts, round-robin.

Run: `make bench-epp`, or `.venv/bin/python benchmarks/bench_epp.py [--requests 120] [--rate 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.epp_router import run, trace

MODELS = ["orchestrator", "explorer", "coder"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=2.0, help="requests a second, in all")
    ap.add_argument("--load-s", type=float, default=2.0, help="a model's load on a host")
    ap.add_argument("--tokens-per-s", type=float, default=200.0)
    ap.add_argument("--max-tokens", type=int, default=60, help="each answer's tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_epp needs root: each host is a network namespace (ip netns)")
    lines = trace(MODELS, args.requests, args.rate, args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="corral-bench-epp-") as folder:
        for mode in ("epp", "round-robin"):
            r = run(
                Path(folder), mode, lines, load_s=args.load_s, tokens_per_s=args.tokens_per_s,
                max_tokens=args.max_tokens, seed=args.seed,
            )  # fmt: skip
            r.pop("routed")
            results.append(r)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{args.requests} requests at {args.rate:g}/s over {len(MODELS)} models, 3 hosts, "
        f"load {args.load_s:g} s, answer {args.max_tokens / args.tokens_per_s:.2f} s"
    )
    print(f"{'routing':<12} {'loads':>6} {'per host':>12} {'mean s':>8} {'p95 s':>8} errors")
    for r in results:
        print(
            f"{r['mode']:<12} {r['loads']:>6} {r['loads_per_host']!s:>12} "
            f"{r['mean_latency_s']:>8.2f} {r['p95_latency_s']:>8.2f} {len(r['errors'])}"
        )
    epp, rr = results
    print(
        f"the EPP's routing: {rr['loads'] / max(1, epp['loads']):.1f}x fewer loads, "
        f"{rr['mean_latency_s'] / epp['mean_latency_s']:.2f}x lower mean latency"
    )
    for r in results:
        print(f"{r['mode']}: hosts each model was served on: {r['hosts_per_model']}")


if __name__ == "__main__":
    main()
