"""The next model's file prepared in the page cache, live: three zoo models of a few
GB on one device (one at a time: every step a swap), agent loops cycling orchestrator, explorer,
coder with 0.25-1.5 s of think time and conversations of 300-1,200 tokens, short answers (the
loads dominate), replayed through `corral serve` on the real llama-server
(`corral replay --own-servers`), with `scheduler.prepare` on and off in the same run, the
files dropped from the page cache before each. Per side: loads, the mean swap time, the mean
latency, the share of loads that found their file cached, the predictor's hits and misses,
the scheduler's warm and cold load estimates against the loads measured; and the simulator's
prediction of the side with preparation (host.page_cache_gb, disk_read_gb_s measured here).

    .venv/bin/python benchmarks/bench_prepare.py [--size-gb 6] [--steps 12] [--json F]
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

import psutil

from bench_page_cache import read_s
from corral.config import parse_config
from corral.modelfiles.folder import find_llama_server
from corral.modelfiles.mincore import cached, drop
from corral.sim.engine import simulate
from corral.sim.metrics import summarize
from corral.sim.parity import at_engine_times, at_live_load_times
from corral.sim.replay import replay
from corral.sim.trace import Trace, TraceLine
from corral.zoo import file_name, make

ROLES = {"orchestrator": "qwen3", "explorer": "gemma3", "coder": "deepseek2"}


def config_text(files: dict[str, Path], binary: str, prepare: bool, extra: str = "") -> str:
    lines = [
        "devices: [{name: cpu}]  # one model at a time: every step a swap",
        f"scheduler: {{policy: cost, max_wait_s: 120, prepare: {str(prepare).lower()}}}",
        extra,
        "models:",
    ]
    for role, path in files.items():
        cmd = shlex.join([binary, "-m", str(path), "--ctx-size", "4096", "--parallel", "1"])
        lines.append(f"  {role}: {{cmd: '{cmd} --port ${{PORT}}', load_s: 10, service_s: 1,")
        lines.append("         health_timeout_s: 900}")
    return "\n".join(x for x in lines if x) + "\n"


def agent_trace(agents: int, steps: int, seed: int, words: tuple[int, int]) -> Trace:
    """Closed agent loops cycling the roles; each step's prompt `words` words long (0: a few
    words, so that the loads dominate), growing by 20-80 words a step up to 1,200."""
    rng = random.Random(seed)
    roles = list(ROLES)
    out: list[TraceLine] = []
    for a in range(agents):
        held = {r: rng.randint(*words) for r in roles}
        for k in range(steps):
            role = roles[k % len(roles)]
            out.append(
                TraceLine(
                    line=len(out) + 1, model=role, service_s=1.0,
                    t=round(rng.uniform(0, 2), 2) if k == 0 else None, session=f"agent-{a}",
                    think_s=0.0 if k == 0 else round(rng.uniform(0.25, 1.5), 2),
                    context_tokens=held[role],
                )
            )  # fmt: skip
            if held[role]:
                held[role] = min(1200, held[role] + rng.randint(20, 80))
    return Trace(out, source="agents o/e/c")


def side(files: dict[str, Path], binary: str, prepare: bool, trace: Trace) -> dict[str, Any]:
    drop(files.values())
    time.sleep(1)
    left = {r: cached([p]) for r, p in files.items()}
    config = parse_config(config_text(files, binary, prepare))
    started = time.time()
    run, figures = replay(config, trace, speed=1.0, own_backends=True, answer_tokens=4)
    loads = figures["loads_live"]
    warm = [x for x in loads if (x["file_cached"] or 0) >= 0.5]
    return {
        "prepare": prepare,
        "cached_at_start": left,
        "wall_s": round(time.time() - started, 1),
        "loads": sum(run.loads.values()),
        "mean_load_s": statistics.mean(x["load_s"] for x in loads),
        "warm_loads": len(warm),
        "mean_warm_load_s": statistics.mean(x["load_s"] for x in warm) if warm else None,
        "mean_cold_load_s": (
            statistics.mean(x["load_s"] for x in loads if x not in warm)
            if len(warm) < len(loads)
            else None
        ),
        "latency_mean_s": figures["latency_mean_s"],
        "wait_mean_s": figures["wait_mean_s"],
        "prepare_view": figures["prepare"],
        "loads_live": loads,
        "run": run,
        "figures": figures,
    }


def disk_read_gb_s(path: Path) -> float:
    drop([path])
    return path.stat().st_size / 1e9 / read_s(path)


def role_files(roles: dict[str, str], size_gb: float) -> tuple[str, dict[str, Path]]:
    """llama-server's path, and each role's zoo file (`roles`: role -> architecture) of
    `size_gb` under out/, written if missing; exits with the fix if llama-server is not
    installed."""
    binary = find_llama_server()
    if binary is None:
        sys.exit("llama-server is not installed: `make .venv/.installed-embed`")
    folder = Path("out") / f"zoo-{size_gb:g}GB"
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for role, arch in roles.items():
        path = folder / file_name(arch, size_gb)
        if not path.is_file():
            print(f"writing {path} ...", file=sys.stderr, flush=True)
            make(arch, folder, size_gb=size_gb)
        files[role] = path
    return binary, files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=6.0)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--words", type=int, nargs=2, default=(0, 0), help="prompt words")
    parser.add_argument(
        "--page-cache-gb", type=float, default=None,
        help="the simulator's page cache (default: the RAM less twice a file: a resident model)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    binary, files = role_files(ROLES, args.size_gb)
    trace = agent_trace(args.agents, args.steps, args.seed, tuple(args.words))
    sides = {}
    for prepare in (False, True):
        print(f"live, prepare {'on' if prepare else 'off'} ...", file=sys.stderr, flush=True)
        sides[prepare] = side(files, binary, prepare, trace)
    rate = disk_read_gb_s(files["coder"])
    off, on = sides[False], sides[True]
    # The simulator, given what the live run measured (corral.sim.parity: each line's service as
    # its server took it, each model's loads), with the page cache: each model's warm load,
    # the rate its cold loads read at (their extra time over the warm ones'), the files' sizes,
    # and the room the RAM leaves beside one resident model's own copy of its weights.
    measured = [x for s_ in (off, on) for x in s_["loads_live"]]
    warm = [x["load_s"] for x in measured if (x["file_cached"] or 0) >= 0.5]
    cold = [x["load_s"] for x in measured if (x["file_cached"] or 0) < 0.5]
    gb = statistics.mean(p.stat().st_size for p in files.values()) / 1e9
    warm_s = statistics.mean(warm) if warm else statistics.mean(cold)
    cold_rate = gb / max(0.1, statistics.mean(cold) - warm_s) if cold else rate
    room = args.page_cache_gb or psutil.virtual_memory().total / 1e9 - gb - 1.5
    extra = f"host: {{page_cache_gb: {room:.1f}, disk_read_gb_s: {cold_rate:.3f}}}"
    sims = {}
    for prepare, live in ((False, off), (True, on)):
        base = parse_config(config_text(files, binary, prepare, extra))
        cfg, sim_trace = at_engine_times(
            at_live_load_times(base, live["figures"]), live["run"], live["figures"]
        )
        models = {
            r: m.model_copy(update={"load_s": warm_s, "file_gb": files[r].stat().st_size / 1e9})
            for r, m in cfg.models.items()
        }
        sim_run = simulate(cfg.model_copy(update={"models": models}), sim_trace)
        sim = summarize(sim_run)
        assert sim_run.files is not None
        sims[prepare] = {
            "loads": sim["loads"],
            "mean_swap_s": sum(sim_run.swap_s.values()) / max(1, sim["loads"]),
            "latency_mean_s": sim["latency_mean_s"],
            "cold_loads": sim_run.files.cold_loads,
            "prepared_gb": sim_run.files.prepared_gb,
        }
    so, sn = sims[False], sims[True]
    pv_off, pv_on = off["prepare_view"], on["prepare_view"]
    rows = [
        ("loads", off["loads"], on["loads"], so["loads"], sn["loads"]),
        ("mean swap (live: the load)", f"{off['mean_load_s']:.2f} s", f"{on['mean_load_s']:.2f} s",
         f"{so['mean_swap_s']:.2f} s", f"{sn['mean_swap_s']:.2f} s"),
        ("loads finding their file cached", off["warm_loads"], on["warm_loads"],
         so["loads"] - so["cold_loads"], sn["loads"] - sn["cold_loads"]),
        ("mean latency", f"{off['latency_mean_s']:.2f} s", f"{on['latency_mean_s']:.2f} s",
         f"{so['latency_mean_s']:.2f} s", f"{sn['latency_mean_s']:.2f} s"),
        ("predictor hits / misses", f"{pv_off.get('hits')} / {pv_off.get('misses')}",
         f"{pv_on.get('hits')} / {pv_on.get('misses')}", "-", "-"),
        ("read ahead", f"{pv_off.get('prepared_gb')} GB", f"{pv_on.get('prepared_gb')} GB",
         f"{so['prepared_gb']:.1f} GB", f"{sn['prepared_gb']:.1f} GB"),
    ]  # fmt: skip
    print("| | live, prepare off | live, prepare on | simulated, off | simulated, on |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print(
        f"swap time on/off: {on['mean_load_s'] / off['mean_load_s']:.2f}; mean latency off/on: "
        f"{off['latency_mean_s'] / on['latency_mean_s']:.2f}x; the disk {rate:.2f} GB/s read "
        f"plainly, {cold_rate:.2f} GB/s by a cold load; the simulator's page cache {room:.1f} GB"
    )
    for s_ in (off, on):
        print(
            f"prepare {s_['prepare']}: the scheduler's estimates at the end "
            f"{s_['prepare_view'].get('estimates')}; measured warm {s_['mean_warm_load_s']}, "
            f"cold {s_['mean_cold_load_s']}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out: dict[str, Any] = {
            str(k): {kk: vv for kk, vv in v.items() if kk not in ("run", "figures")}
            for k, v in sides.items()
        }
        out["simulated"] = {str(k): v for k, v in sims.items()}
        out["disk"] = {"read_gb_s": rate, "cold_load_gb_s": cold_rate, "page_cache_gb": room}
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
