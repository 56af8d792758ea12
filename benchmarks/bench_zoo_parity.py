"""The simulator against real servers on the zoo's files: the conversations scenario
(`corral.zoo.scenario.conversations`: agent loops alternating over a kept and a not-kept
architecture on one device, or `--archs`; with `--parallel 2` the loops share each server)
run live through `corral serve` on the `llama` extra's llama-server, then simulated given the
figures the servers measured (`corral.sim.parity.simulated_beside`): loads, tokens prefilled,
waits and latencies side by side, each parity figure against the range of eight simulations
under the live run's noise.

    .venv/bin/python benchmarks/bench_zoo_parity.py [--size-gb 0.25] [--json out/x.json]
        [--archs qwen3 gpt-oss] [--loops 2] [--parallel 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from corral.sim.parity import simulated_beside
from corral.sim.replay import replay
from corral.zoo.scenario import KEPT, NOT_KEPT, conversations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=None, help="zoo files' size (tiny)")
    parser.add_argument("--steps", type=int, default=8, help="steps per agent loop")
    parser.add_argument("--words", type=int, nargs=2, default=(600, 1200))
    parser.add_argument("--grow", type=int, nargs=2, default=(150, 300))
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--archs", nargs="+", default=[KEPT, NOT_KEPT], help="the zoo's")
    parser.add_argument("--loops", type=int, default=2, help="agent loops")
    parser.add_argument("--parallel", type=int, default=1, help="slots per server")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    label = "tiny" if args.size_gb is None else f"{args.size_gb:g}GB"
    sc = conversations(
        Path("out") / f"zoo-{label}",
        size_gb=args.size_gb,
        steps=args.steps,
        words=tuple(args.words),
        grow=tuple(args.grow),
        seed=args.seed,
        archs=tuple(args.archs),
        loops=args.loops,
        parallel=args.parallel,
    )
    print(f"{sc.summary}: {len(sc.trace.lines)} requests, live ...", flush=True)
    began = time.monotonic()
    run, live = replay(sc.config, sc.trace, 1.0, own_backends=True)
    took_s = time.monotonic() - began
    simulated, diffs = simulated_beside(sc.config, run, live)
    for name in args.archs:
        r = live["restores"].get(name, {})
        causes = ", ".join(
            f"{k.removeprefix('not_honoured_')} {v}"
            for k, v in r.items()
            if k.startswith("not_honoured_") and v
        )
        print(f"- {name}: {live['prompt_cache'].get(name, '?')}; restores {r.get('restores', 0)}, "
              f"reused {r.get('honoured', 0)}, not {r.get('not_honoured', 0)}"
              f"{f' ({causes})' if causes else ''}")  # fmt: skip
    print(f"- live run: {took_s:.0f} s; loads {live['load_s_live']}, unloads "
          f"{live['unload_s_live']} (s)")  # fmt: skip
    print("\n| figure | live | simulated (range of 8) | tolerance | agree |")
    print("|---|---:|---:|---:|---|")
    for d in diffs:
        print(f"| {d.figure} | {d.live:,.2f} | {d.simulated:,.2f} ({d.low:,.2f} to "
              f"{d.high:,.2f}) | ±{d.tolerance:,.2f} | {'yes' if d.ok else 'NO'} |")  # fmt: skip
    live_i, sim_i = live["per_class"]["interactive"], simulated["per_class"]["interactive"]
    for key in ("wait_mean_s", "wait_max_s", "latency_mean_s", "latency_p95_s"):
        print(f"| interactive {key} | {live_i[key]:.2f} | {sim_i[key]:.2f} | - | - |")
    if NOT_KEPT in args.archs:
        believed = {**live, "prompt_cache": {}}
        _, wrong = simulated_beside(sc.config, run, believed)
        told = next(d for d in wrong if d.figure == "prefill tokens")
        print(f"\nThe simulator told {NOT_KEPT}'s caches are kept: prefill tokens "
              f"{told.simulated:,.0f} against live {told.live:,.0f} "
              f"(agree: {told.ok})")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "scenario": sc.summary,
            "live_s": took_s,
            "verdicts": live["prompt_cache"],
            "restores": live["restores"],
            "parity": [d.__dict__ | {"ok": d.ok} for d in diffs],
            "live": {k: v for k, v in live.items() if k != "engine"},
            "simulated": simulated,
        }
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0 if all(d.ok for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
