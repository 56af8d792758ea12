"""The multi-device scenarios over many seeds: `devices-4` (4 devices, 16 models)
and `devices-8` (8 devices, 20 models) are one seed each; this runs the same generator with ten
seeds per family and every Corral policy, so a claim about them is not one trace's luck.

Prints, per family, each policy's mean over the seeds of loads and wait mean / p95 / max, and on
how many seeds each policy had the lowest mean and the lowest p95 (ties count for both).
`lru-route` is left out: it is ten times behind on every seed of the built-in scenarios.

Run: `make bench-devices` (or `.venv/bin/python benchmarks/bench_devices.py [--seeds 10]`).
Deterministic; about 2 minutes on the 2-core VM.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from typing import Any

from rich.progress import track

from corral.policy_names import SimPolicyName
from corral.sim.engine import simulate
from corral.sim.metrics import summarize
from corral.sim.scenarios import _devices

POLICIES: list[SimPolicyName] = ["cost", "grouped", "fifo-plus", "fifo"]
FAMILIES = {"devices-4": (4, 16, 10), "devices-8": (8, 20, 11)}  # devices, models, first seed


def run(n_devices: int, n_models: int, seed: int) -> dict[str, dict[str, Any]]:
    sc = _devices(n_devices, n_models, seed)
    return {p: summarize(simulate(sc.config, sc.trace, policy=p)) for p in POLICIES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    print(f"machine: {platform.node()} ({platform.machine()}), python {platform.python_version()}")
    for family, (n_dev, n_mod, first) in FAMILIES.items():
        seeds = range(first, first + args.seeds)
        runs = [run(n_dev, n_mod, s) for s in track(seeds, description=family)]
        print(
            f"\n**{family} family** (seeds {first}-{first + args.seeds - 1}; seed {first} is "
            f"the built-in `{family}`)\n"
        )
        print(
            "| policy | loads | wait mean s | wait p95 s | wait max s | lowest mean | lowest p95 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for p in POLICIES:
            avg = {
                k: statistics.fmean(r[p][k] for r in runs)
                for k in ("loads", "wait_mean_s", "wait_p95_s", "wait_max_s")
            }
            best_mean = sum(
                r[p]["wait_mean_s"] <= min(r[q]["wait_mean_s"] for q in POLICIES) for r in runs
            )
            best_p95 = sum(
                r[p]["wait_p95_s"] <= min(r[q]["wait_p95_s"] for q in POLICIES) for r in runs
            )
            print(
                f"| {p} | {avg['loads']:,.0f} | {avg['wait_mean_s']:,.1f} | "
                f"{avg['wait_p95_s']:,.1f} | {avg['wait_max_s']:,.1f} | "
                f"{best_mean}/{len(runs)} | {best_p95}/{len(runs)} |"
            )


if __name__ == "__main__":
    main()
