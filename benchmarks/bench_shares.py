"""Fair shares on a shared box (the `shared-box` scenario, drawn on several seeds): with fair
shares, with them off (`scheduler.fair_shares: false`), and without the heavy user's flood.

Figures, per seed, then the worst over seeds:
- light users' interactive p95 wait with the flood, divided by the same user's without it (the
  target: at most 1.5x, each of alice, bob and carol);
- total loads with fair shares divided by the same run without them (target: at most 1.10);
- Jain's fairness index over weighted device time in the flood window: each interactive
  principal's device-seconds served there over its max-min fair share of what the window
  offered (demand: the service of its requests that were there to serve in the window, so a
  light user wants little), capped at 1, so 1 is every principal given its fair share (target:
  at least 0.9), with fair shares and without;
- the heavy user's share of what is left: its device-seconds served in the flood window over
  the window's device time less the swaps and the other principals' service there (target: at
  least 0.9: fairness never idles the device while the heavy user waits).

Run: `make bench-shares` (or `.venv/bin/python benchmarks/bench_shares.py [--seeds 6301 ...]
[--json out/bench-shares.json]`). Deterministic; under a second per seed on the 2-core VM.

`--live [--hours H] [--speed X]`: the first seed's three runs replayed live through `corral
serve` (H hours of the scenario, default a quarter; sim backends X times faster, default 10),
the same figures from what the gateway did, in trace seconds (about 14 minutes for the default:
the heavy user's backlog drains after the trace ends), and beside them the simulator's for the
same traces.

`--write-live DIR [--hours H]`: instead, write the three runs' configurations and traces of the
first seed (`fair`, `off`, `alone`: DIR/NAME.yaml and DIR/NAME.jsonl), H hours of the scenario,
for `corral replay --config DIR/NAME.yaml --trace DIR/NAME.jsonl --speed 10 --json` to run
live through `corral serve`.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from corral.config import Config, parse_config
from corral.sim.engine import Run, Simulation
from corral.sim.metrics import jain, summarize
from corral.sim.scenarios import SharedBox, _trace

ANSWER_S = 3.0  # the chat model's mean answer (service_s; the trace draws 2-4 s)
FLOOD = (900.0, 2700.0)  # the heavy user's flood, seconds into the hour (shared_box_lines)


def _flood(hours: float) -> tuple[float, float]:
    """The flood's window in a run of `hours` (the middle half, as `SharedBox.lines` draws it)."""
    return FLOOD[0] * hours, FLOOD[1] * hours


def _config_text(fair: bool, shape: SharedBox = SharedBox()) -> str:
    return shape.config_text().replace(
        "scheduler: {policy: cost, max_wait_s: 120}",
        f"scheduler: {{policy: cost, max_wait_s: 120, fair_shares: {str(fair).lower()}}}",
    )


def _config(fair: bool, shape: SharedBox) -> Config:
    return parse_config(_config_text(fair, shape), "<bench shares>")


def write_live(folder: Path, seed: int, hours: float) -> None:
    """The three runs of `seed` as files for `corral replay`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, fair, heavy in (("fair", True, True), ("off", False, True), ("alone", True, False)):
        (folder / f"{name}.yaml").write_text(_config_text(fair))
        lines = SharedBox().lines(seed, heavy, hours)
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _run(seed: int, fair: bool, heavy: bool, shape: SharedBox, hours: float = 1.0) -> Run:
    trace = _trace("shared-box", shape.lines(seed, heavy, hours))
    return Simulation(_config(fair, shape), trace, check=True).run()


def _served(run: Run, start_s: float, end_s: float) -> dict[str, float]:
    """Device-seconds of interactive service per principal between `start_s` and `end_s`."""
    out: dict[str, float] = {}
    conc = {n: m.concurrency for n, m in run.config.models.items()}
    for r in run.requests:
        if r.background or r.dispatched_at is None or r.finished_at is None:
            continue
        overlap = min(r.finished_at, end_s) - max(r.dispatched_at, start_s)
        if overlap > 0:
            who = r.principal or ""
            out[who] = out.get(who, 0.0) + overlap / conc[r.model]
    return out


def _demand(run: Run, start_s: float, end_s: float) -> dict[str, float]:
    """Device-seconds of interactive work each principal had for the window: its requests that
    arrived before its end and had not finished by its start (their service, whole)."""
    out: dict[str, float] = {}
    conc = {n: m.concurrency for n, m in run.config.models.items()}
    for r in run.requests:
        if r.background or r.finished_at is None or r.arrived_at >= end_s:
            continue
        if r.finished_at > start_s:
            who = r.principal or ""
            out[who] = out.get(who, 0.0) + r.service_s / conc[r.model]
    return out


def _jain(run: Run, flood: tuple[float, float] = FLOOD) -> float:
    """Jain's index over each interactive principal's service in the flood window divided by
    its max-min fair share of the window (its demand capped)."""
    start_s, end_s = flood
    served = _served(run, start_s, end_s)
    share = _max_min(_demand(run, start_s, end_s), end_s - start_s - _swap_s(run, start_s, end_s))
    return jain(np.array([min(served.get(p, 0.0) / f, 1.0) for p, f in share.items() if f > 0]))


def _swap_s(run: Run, start_s: float, end_s: float) -> float:
    return sum(
        max(0.0, min(s.end_s, end_s) - max(s.start_s, start_s))
        for s in run.segments
        if s.kind != "resident"
    )


def _max_min(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of `capacity` under `demand` (the scenario's weights are all 1)."""
    share: dict[str, float] = {}
    left = dict(demand)
    cap = capacity
    while left:
        each = cap / len(left)
        small = {p: d for p, d in left.items() if d <= each}
        if not small:
            share.update(dict.fromkeys(left, each))
            break
        for p, d in small.items():
            share[p] = d
            cap -= d
            del left[p]
    return share


def measure(seed: int, shape: SharedBox = SharedBox(), hours: float = 1.0) -> dict[str, Any]:
    """The figures from the simulator's three runs of `hours` of the scenario."""
    runs = ((True, True), (False, True), (True, False))  # fair, off, alone
    fair, unfair, alone = (_run(seed, on, heavy, shape, hours) for on, heavy in runs)
    return figures(seed, shape, fair, unfair, alone, flood=_flood(hours))


def measure_live(seed: int, hours: float, speed: float) -> dict[str, Any]:
    """`measure`'s figures from the three runs replayed live through `corral serve`
    (`corral.sim.replay`: sim backends at `speed` times, each line sent with its principal's
    key), `hours` of the scenario, the default shape."""
    from corral.sim.replay import replay

    shape = SharedBox()
    runs = []
    for on, heavy in ((True, True), (False, True), (True, False)):
        trace = _trace("shared-box", shape.lines(seed, heavy, hours))
        print(f"live: fair shares {'on' if on else 'off'}, flood {'on' if heavy else 'off'}")
        runs.append(replay(_config(on, shape), trace, speed=speed, progress=print)[0])
    fair, unfair, alone = runs
    return figures(seed, shape, fair, unfair, alone, flood=_flood(hours))


def figures(
    seed: int,
    shape: SharedBox,
    fair: Run,
    unfair: Run,
    alone: Run,
    flood: tuple[float, float] = FLOOD,
) -> dict[str, Any]:
    """The light users' p95 ratios, the loads, Jain's index and the heavy user's share of what
    is left in the `flood` window, from the runs with fair shares, without, and without the
    flood."""
    s_fair, s_unfair, s_alone = summarize(fair), summarize(unfair), summarize(alone)
    light = {
        who: {
            "p95_flood_s": s_fair["per_principal"][who]["wait_p95_s"],
            "p95_flood_unfair_s": s_unfair["per_principal"][who]["wait_p95_s"],
            "p95_alone_s": s_alone["per_principal"][who]["wait_p95_s"],
        }
        for who in shape.light_users
    }
    for v in light.values():
        v["ratio"] = v["p95_flood_s"] / max(v["p95_alone_s"], 1e-9)
        v["ratio_unfair"] = v["p95_flood_unfair_s"] / max(v["p95_alone_s"], 1e-9)
    start_s, end_s = flood
    served = _served(fair, start_s, end_s)
    window_s = end_s - start_s - _swap_s(fair, start_s, end_s)
    others_s = sum(v for p, v in served.items() if p != "heavy")
    return {
        "seed": seed,
        "shape": describe(shape),
        "light": light,
        "light_ratio_worst": max(v["ratio"] for v in light.values()),
        "light_ratio_worst_unfair": max(v["ratio_unfair"] for v in light.values()),
        "loads": s_fair["loads"],
        "loads_unfair": s_unfair["loads"],
        "loads_ratio": s_fair["loads"] / max(s_unfair["loads"], 1),
        "jain": _jain(fair, flood),
        "jain_unfair": _jain(unfair, flood),
        "heavy_share_of_left": served.get("heavy", 0.0) / max(window_s - others_s, 1e-9),
        "served_in_flood_s": served,
    }


def explain(seed: int, shape: SharedBox) -> list[dict[str, Any]]:
    """Where the loads of `seed`'s runs with and without fair shares fall: while the heavy
    user's flood backlog lasts and after it, and how many of the agent's coder steps (each a
    swap from the chat model unless several loops' steps are served together) ran in each."""
    out = []
    for fair in (True, False):
        run = _run(seed, fair, True, shape)
        heavy_done_s = max((r.finished_at or 0.0) for r in run.requests if r.principal == "heavy")
        swaps = [s.start_s for s in run.segments if s.kind == "swap"]
        steps = [
            r.dispatched_at or 0.0
            for r in run.requests
            if r.principal == "agent" and r.model == "coder-14b"
        ]
        row: dict[str, Any] = {"fair_shares": fair, "heavy_done_s": round(heavy_done_s)}
        for part, inside in (("during", True), ("after", False)):
            n_swaps = sum((t < heavy_done_s) is inside for t in swaps)
            n_steps = sum((t < heavy_done_s) is inside for t in steps)
            row[part] = {"loads": n_swaps, "agent_coder_steps": n_steps}
        out.append(row)
    return out


def _print_explained(seed: int, rows: list[dict[str, Any]]) -> None:
    t = Table(title=f"seed {seed}: loads while the heavy user's backlog lasts, and after")
    for col in ("fair shares", "backlog until", "loads", "agent coder steps", "loads / step"):
        t.add_column(col, justify="right")
    for r in rows:
        for part in ("during", "after"):
            x = r[part]
            t.add_row(
                "on" if r["fair_shares"] else "off",
                f"{part}: {r['heavy_done_s']} s",
                str(x["loads"]),
                str(x["agent_coder_steps"]),
                f"{x['loads'] / max(x['agent_coder_steps'], 1):.2f}",
            )
    Console().print(t)


def shape_of(seed: int) -> SharedBox:
    """The family's shape for `seed` (its own stream: the traffic draws from `seed` itself)."""
    return SharedBox.drawn(random.Random(f"shape-{seed}"))


def describe(shape: SharedBox) -> str:
    """A shape in a table cell: users, agent loops, batch lines, flood strength, chat slots,
    loads (chat/coder) and think time."""
    lo, hi = shape.think_s
    return (
        f"{len(shape.light_users)}u a{shape.agent_loops} b{shape.batch_lines} "
        f"x{shape.flood_x:g} c{shape.chat_concurrency} "
        f"L{shape.chat_load_s:g}/{shape.coder_load_s:g} t{lo:g}-{hi:g}"
    )


def _targets(r: dict[str, Any]) -> dict[str, bool]:
    """The issue's four targets, met or not, for one seed's row."""
    return {
        "light p95 within 1.5x": r["light_ratio_worst"] <= 1.5,
        # Where a light user alone never waits (one model, slots free), under the flood its
        # request waits for a busy slot to free: up to one answer, which no scheduler that does
        # not preempt avoids.
        "light p95 within 1.5x or one answer": all(
            v["p95_flood_s"] <= max(1.5 * v["p95_alone_s"], v["p95_alone_s"] + ANSWER_S)
            for v in r["light"].values()
        ),
        "loads at most 1.10x": r["loads_ratio"] <= 1.10,
        "Jain at least 0.9": r["jain"] >= 0.9,
        "heavy share at least 0.9": r["heavy_share_of_left"] >= 0.9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[6301, 6302, 6303, 6304, 6305])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write-live", type=Path, metavar="DIR")
    ap.add_argument("--hours", type=float, default=0.25)
    ap.add_argument(
        "--live",
        action="store_true",
        help="run the first seed's three runs live through corral serve (--hours of it)",
    )
    ap.add_argument("--speed", type=float, default=10.0, help="with --live: the sim's speed-up")
    ap.add_argument(
        "--family",
        action="store_true",
        help="each seed draws its own shape of the shared box (SharedBox.drawn): users, "
        "agent loops, batch lines, the flood's strength, the chat model's slots and loads",
    )
    ap.add_argument(
        "--explain",
        action="store_true",
        help="with --family: for each seed, where the loads fall (while the heavy user's "
        "backlog lasts, and after) with fair shares and without",
    )
    args = ap.parse_args()
    if args.explain:
        for seed in args.seeds:
            shape = shape_of(seed) if args.family else SharedBox()
            print(describe(shape))
            _print_explained(seed, explain(seed, shape))
        return 0
    if args.write_live is not None:
        write_live(args.write_live, args.seeds[0], args.hours)
        print(f"wrote fair, off and alone (.yaml, .jsonl) to {args.write_live}")
        return 0
    if args.live:
        live = measure_live(args.seeds[0], args.hours, args.speed)
        sim = measure(args.seeds[0], hours=args.hours)
        rows = [{**live, "seed": f"{live['seed']} live"}, {**sim, "seed": f"{sim['seed']} sim"}]
    else:
        rows = [measure(s, shape_of(s) if args.family else SharedBox()) for s in args.seeds]
    t = Table(title="fair shares on the shared box (flood vs without it; fair vs off)")
    for col in (
        "seed",
        *(("shape",) if args.family else ()),
        "light p95 ratio (fair)",
        "(off)",
        "loads fair / off",
        "Jain (fair)",
        "(off)",
        "heavy share of left",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["seed"]),
            *((r["shape"],) if args.family else ()),
            f"{r['light_ratio_worst']:.2f}",
            f"{r['light_ratio_worst_unfair']:.2f}",
            f"{r['loads']} / {r['loads_unfair']} ({r['loads_ratio']:.2f})",
            f"{r['jain']:.3f}",
            f"{r['jain_unfair']:.3f}",
            f"{r['heavy_share_of_left']:.3f}",
        )
    Console().print(t)
    worst = {
        "light_ratio_worst": max(r["light_ratio_worst"] for r in rows),
        "loads_ratio_worst": max(r["loads_ratio"] for r in rows),
        "jain_worst": min(r["jain"] for r in rows),
        "heavy_share_of_left_worst": min(r["heavy_share_of_left"] for r in rows),
        "seeds_meeting_all": sum(all(_targets(r).values()) for r in rows),
        "seeds": len(rows),
    }
    for target in _targets(rows[0]):
        missed = [r["seed"] for r in rows if not _targets(r)[target]]
        print(
            f"{target}: {len(rows) - len(missed)}/{len(rows)} seeds"
            + (f" (missed: {', '.join(map(str, missed))})" if missed else "")
        )
    print(json.dumps(worst))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"machine": platform.platform(), "seeds": rows, "worst": worst}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
