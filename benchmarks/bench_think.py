"""Agents' think time, live on real llama-server: three agents in closed
loops, each on a model of its own, plus an orchestrator agent on a fourth, on one device (one
model at a time), 0.25-1.5 s of think time between steps and conversations of 300-1,200
tokens, replayed through `corral serve` (`corral replay --own-servers`).

Two live sides in the same run, on the same trace: Corral's default (`cost`, which holds an
idle model through its agent's learned think time when the next step is due sooner than a
swap away and back would take: `Cost.linger_s`), and the same with that hold switched off
(`scheduler.cost.linger: false`: the model is swapped out as soon as nothing is in flight, as
llama-swap's FIFO scheduler does, `internal/router/scheduler/fifo.go`). Then the simulator,
given the live run's measured loads and services (`corral.sim.parity`), over the same trace: both
sides and the `llama-swap` baseline (corral/sim/baselines.py). Per side: loads, mean latency
(arrival to the answer), the hold's verdicts.

The real llama-swap binary is not run: it needs Go 1.26 and its modules from
proxy.golang.org, which this machine cannot reach (docs/benchmarks.md).

    .venv/bin/python benchmarks/bench_think.py [--size-gb 2] [--steps 10] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_prepare import role_files
from corral.config import Config, parse_config
from corral.policy_names import SimPolicyName
from corral.sim.engine import Run, simulate
from corral.sim.metrics import summarize
from corral.sim.parity import at_engine_times, at_live_load_times
from corral.sim.replay import replay
from corral.sim.trace import Trace, TraceLine

ROLES = {
    "orchestrator": "qwen3",
    "explorer": "gemma3",
    "coder": "deepseek2",
    "reviewer": "qwen3moe",
}


def config_text(files: dict[str, Path], binary: str, linger: bool) -> str:
    lines = [
        "devices: [{name: cpu}]  # one model at a time",
        "scheduler: {policy: cost, max_wait_s: 120, cost: {linger: LINGER}}".replace(
            "LINGER", str(linger).lower()
        ),
        "models:",
    ]
    for role, path in files.items():
        cmd = shlex.join([binary, "-m", str(path), "--ctx-size", "4096", "--parallel", "1"])
        lines.append(f"  {role}: {{cmd: '{cmd} --port ${{PORT}}', load_s: 3, service_s: 1,")
        lines.append("         health_timeout_s: 900}")
    return "\n".join(lines) + "\n"


def agent_trace(steps: int, seed: int) -> Trace:
    """One closed loop per role, each on its own model: `steps` steps, 0.25-1.5 s of think
    time before each but the first, a conversation of 300-1,200 tokens growing 20-80 a step."""
    rng = random.Random(seed)
    out: list[TraceLine] = []
    for role in ROLES:
        held = rng.randint(300, 900)
        for k in range(steps):
            out.append(
                TraceLine(
                    line=len(out) + 1, model=role, service_s=1.0,
                    t=round(rng.uniform(0, 2), 2) if k == 0 else None, session=f"agent-{role}",
                    think_s=0.0 if k == 0 else round(rng.uniform(0.25, 1.5), 2),
                    context_tokens=held,
                )
            )  # fmt: skip
            held = min(1200, held + rng.randint(20, 80))
    return Trace(out, source="agents on their own models")


def side(config: Config, trace: Trace) -> dict[str, Any]:
    started = time.time()
    run, figures = replay(config, trace, speed=1.0, own_backends=True, answer_tokens=8)
    loads = figures["loads_live"]
    return {
        "wall_s": round(time.time() - started, 1),
        "loads": sum(run.loads.values()),
        "mean_load_s": statistics.mean(x["load_s"] for x in loads) if loads else 0.0,
        "latency_mean_s": figures["latency_mean_s"],
        "wait_mean_s": figures["wait_mean_s"],
        "run": run,
        "figures": figures,
    }


def simulated(config: Config, live: dict[str, Any], policy: SimPolicyName) -> dict[str, Any]:
    """The simulator over the live side's trace, at its measured loads and services."""
    cfg, sim_trace = at_engine_times(
        at_live_load_times(config, live["figures"]), live["run"], live["figures"]
    )
    run: Run = simulate(cfg, sim_trace, policy=policy)
    s = summarize(run)
    return {"loads": s["loads"], "latency_mean_s": s["latency_mean_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    binary, files = role_files(ROLES, args.size_gb)
    trace = agent_trace(args.steps, args.seed)
    configs = {linger: parse_config(config_text(files, binary, linger)) for linger in (True, False)}
    live: dict[bool, dict[str, Any]] = {}
    for linger in (False, True):
        print(f"live, hold {'on' if linger else 'off'} ...", file=sys.stderr, flush=True)
        live[linger] = side(configs[linger], trace)
    sims = {
        "hold on": simulated(configs[True], live[True], "cost"),
        "hold off": simulated(configs[False], live[False], "cost"),
        "llama-swap": simulated(configs[False], live[False], "llama-swap"),
    }
    on, off = live[True], live[False]
    print("| | live, hold on | live, hold off | sim, hold on | sim, hold off | sim, llama-swap |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| loads | {on['loads']} | {off['loads']} | {sims['hold on']['loads']} | "
        f"{sims['hold off']['loads']} | {sims['llama-swap']['loads']} |"
    )
    print(
        f"| mean latency | {on['latency_mean_s']:.2f} s | {off['latency_mean_s']:.2f} s | "
        + " | ".join(f"{sims[k]['latency_mean_s']:.2f} s" for k in sims)
        + " |"
    )
    print(f"| mean load | {on['mean_load_s']:.2f} s | {off['mean_load_s']:.2f} s | - | - | - |")
    print(
        f"loads on/off: {on['loads'] / max(1, off['loads']):.2f}; mean latency off/on: "
        f"{off['latency_mean_s'] / on['latency_mean_s']:.2f}x; "
        f"{len(trace.lines)} steps, files {args.size_gb:g} GB"
    )
    if args.json:
        keep = ("wall_s", "loads", "mean_load_s", "latency_mean_s", "wait_mean_s")
        out = {
            "live": {
                ("hold on" if k else "hold off"): {x: v[x] for x in keep} for k, v in live.items()
            },
            "simulated": sims,
            "size_gb": args.size_gb,
            "steps": args.steps,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
