"""Sleeping models and aborted loads, simulated and replayed live in the same run.

1. `sleepers` (four models that each fill the device, three fit asleep in host memory; an agent
   loop and Poisson chat): with `sleep:` (the default `predicted` sleepers), with the `lru`
   baseline (always sleep, stop the least recently used), and without `sleep:`. Target: mean
   latency at least 5x lower with sleep than without, and lower than `lru`'s.
2. `beside-batch` (a person chats beside a running batch on another model, one device): with
   `sleep:`, without (aborting batch loads for the person), and, simulated only, without aborts.
   Targets: the person's p95 wait at most one wake plus two answers with sleep; the max at most
   one load plus two answers without.
3. `sleepers` with each model's file in the host's page cache modelled (10 GB files,
   the configured loads as cold ones and warm loads at 40% of them, a 40 GB page cache, a
   0.5 GB/s disk), simulated: with and without `sleep:`, `scheduler.prepare` on and off.
4. A random family nobody tuned for: `corral.sim.families.random_sleep_scenario` (the
   robustness family with every model able to sleep: level 1, wakes 2-10% of the load, host
   memory for 20-100% of them asleep): `predicted` against `lru` and against no sleep, per
   metric, the median and worst ratio.

Live runs are `corral replay` (sim backends speaking vLLM's sleep API behind `corral serve`) at
`--speed`; each live figure sits beside its simulation, with the replay's parity check (loads
within max(2, 10%), each class's p95 wait within max(1 s, 15%)).

Run: `make bench-sleep` (or `.venv/bin/python benchmarks/bench_sleep.py [--speed 20]
[--seeds 100] [--no-live] [--json out/bench-sleep.json]`). About 25 minutes on the 2-core VM
with the live runs, 2 without.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
from pathlib import Path
from typing import Any

from rich.progress import track

from corral.config import Config, parse_config
from corral.core.aborts import Aborts
from corral.sim.engine import simulate
from corral.sim.families import random_sleep_scenario
from corral.sim.metrics import summarize
from corral.sim.parity import compare
from corral.sim.replay import replay
from corral.sim.scenarios import BESIDE_BATCH_CONFIG, SLEEP_CONFIG, Scenario, get_scenario
from corral.sim.trace import Trace

FIGURES = ("loads", "latency_mean_s", "wait_mean_s", "wait_p95_s", "wait_max_s")


def without_sleep_text(text: str) -> str:
    """A configuration's text with every model's `sleep:` taken out."""
    return re.sub(r",\s*sleep: \{[^}]*\}", "", text)


def without_sleep(text: str) -> Config:
    return parse_config(without_sleep_text(text), "<no sleep>")


def with_sleepers(config: Config, sleepers: str) -> Config:
    return config.model_copy(
        update={"scheduler": config.scheduler.model_copy(update={"sleepers": sleepers})}
    )


def simulated(config: Config, trace: Trace, aborts: bool = True) -> dict[str, Any]:
    if aborts:
        return summarize(simulate(config, trace, policy="cost"))
    # The counterfactual: the same scheduler with the interactive abort rule switched off.
    rule = Aborts.for_interactive
    Aborts.for_interactive = lambda *_: False  # type: ignore[method-assign]
    try:
        return summarize(simulate(config, trace, policy="cost"))
    finally:
        Aborts.for_interactive = rule  # type: ignore[method-assign]


def row(name: str, mode: str, s: dict[str, Any]) -> str:
    chat = s["per_class"].get("interactive", {})
    cells = [
        f"{s['loads']}",
        f"{s['latency_mean_s']:.1f}",
        f"{chat.get('wait_mean_s', float('nan')):.1f}",
        f"{chat.get('wait_p95_s', float('nan')):.1f}",
        f"{chat.get('wait_max_s', float('nan')):.1f}",
    ]
    return f"| {name} | {mode} | " + " | ".join(cells) + " |"


def scenario_runs(
    sc: Scenario, variants: list[tuple[str, Config, bool]], speed: float, live: bool
) -> dict[str, dict[str, Any]]:
    """Each variant simulated and, where `live` and the variant can be, replayed live."""
    out: dict[str, dict[str, Any]] = {}
    print(f"\n**{sc.name}**: {' '.join(sc.summary.split())}\n")
    print(
        "| variant | run | loads | latency mean s | interactive wait mean s | "
        "interactive wait p95 s | interactive wait max s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, cfg, aborts in variants:
        sim = simulated(cfg, sc.trace, aborts)
        out[name] = {"simulated": sim}
        print(row(name, "simulated", sim), flush=True)
        if live and aborts:
            _, got = replay(cfg, sc.trace, speed)
            diffs = compare(sim, got)
            out[name]["live"] = got
            out[name]["parity"] = [
                {"figure": d.figure, "simulated": d.simulated, "live": d.live, "ok": d.ok}
                for d in diffs
            ]
            agree = "agree" if all(d.ok for d in diffs) else "DIFFER"
            print(row(name, f"live ({agree})", got), flush=True)
    return out


def sleepy_family(seed: int) -> tuple[Config, Config, Config, Trace]:
    """A family scenario whose models all sleep: (predicted, lru, no sleep) and its trace."""
    sc = random_sleep_scenario(seed, max_requests=2000)
    raw = sc.config.model_dump(mode="json", by_alias=True, exclude_none=True)
    for m in raw["models"].values():
        del m["sleep"]
    nosleep = Config.model_validate(raw)
    return sc.config, with_sleepers(sc.config, "lru"), nosleep, sc.trace


def family(seeds: range) -> dict[str, Any]:
    ratios: dict[str, dict[str, list[float]]] = {
        "lru": {k: [] for k in FIGURES[1:]},
        "no sleep": {k: [] for k in FIGURES[1:]},
    }
    for seed in track(seeds, description="random sleep family"):
        predicted, lru, nosleep, trace = sleepy_family(seed)
        p = summarize(simulate(predicted, trace, policy="cost"))
        for name, cfg in (("lru", lru), ("no sleep", nosleep)):
            o = summarize(simulate(cfg, trace, policy="cost"))
            for k in FIGURES[1:]:
                ratios[name][k].append(p[k] / o[k] if o[k] > 0 else 1.0)
    print(
        f"\n**Random sleep family** ({len(seeds)} scenarios, seeds {seeds.start}-"
        f"{seeds.stop - 1}): `predicted`'s figure over the other's (below 1: `predicted` wins)\n"
    )
    print("| against | metric | median | p90 | worst |")
    print("|---|---|---:|---:|---:|")
    out: dict[str, Any] = {}
    for name, per in ratios.items():
        for k, xs in per.items():
            xs = sorted(xs)
            med, p90, worst = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))], xs[-1]
            out[f"{name} {k}"] = {"median": med, "p90": p90, "worst": worst}
            print(f"| {name} | {k} | {med:.2f} | {p90:.2f} | {worst:.2f} |")
    return out


def with_files(text: str, prepare: bool) -> Config:
    """`text` with each model's file modelled: its `load_s` the cold load, 40% of it warm."""

    def files(m: re.Match[str]) -> str:
        cold_s = float(m.group(1))
        return f"{{load_s: {0.4 * cold_s:.1f}, cold_load_s: {cold_s:g}, file_gb: 10"

    text = re.sub(r"\{load_s: ([0-9.]+)", files, text)
    text = text.replace(
        "host: {memory_gb: 60}", "host: {memory_gb: 60, page_cache_gb: 40, disk_read_gb_s: 0.5}"
    )
    on = str(prepare).lower()
    old = "scheduler: {policy: cost, max_wait_s: 120}"
    text = text.replace(old, f"scheduler: {{policy: cost, max_wait_s: 120, prepare: {on}}}")
    return parse_config(text, "<sleepers with files>")


def prepared(trace: Trace) -> dict[str, Any]:
    """Section 3: mean latency per (sleep, prepare)."""
    out: dict[str, Any] = {}
    for sleep in (True, False):
        text = SLEEP_CONFIG if sleep else without_sleep_text(SLEEP_CONFIG)
        for prepare in (True, False):
            s = simulated(with_files(text, prepare), trace)
            key = f"{'sleep' if sleep else 'no sleep'}, prepare {'on' if prepare else 'off'}"
            out[key] = {"loads": s["loads"], "latency_mean_s": s["latency_mean_s"]}
            print(f"  {key}: {s['loads']} loads, mean latency {s['latency_mean_s']:.2f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=2800)
    ap.add_argument("--no-live", action="store_true", help="Simulate only.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    live = not args.no_live
    print(f"machine: {platform.node()} ({platform.machine()}), python {platform.python_version()}")
    results: dict[str, Any] = {}

    sc = get_scenario("sleepers")
    results["sleepers"] = runs = scenario_runs(
        sc,
        [
            ("sleep (predicted)", sc.config, True),
            ("sleep (lru baseline)", with_sleepers(sc.config, "lru"), True),
            ("no sleep", without_sleep(SLEEP_CONFIG), True),
        ],
        args.speed,
        live,
    )
    for mode in ("simulated", "live") if live else ("simulated",):
        mean = {k: v[mode]["latency_mean_s"] for k, v in runs.items() if mode in v}
        ratio = mean["no sleep"] / mean["sleep (predicted)"]
        print(
            f"\n{mode}: mean latency without sleep / with: **{ratio:.2f}x** (target >= 5); "
            f"lru baseline {mean['sleep (lru baseline)']:.1f} s against "
            f"{mean['sleep (predicted)']:.1f} s"
        )

    print("\nsleepers with the page cache modelled (simulated):")
    results["sleepers_files"] = files = prepared(sc.trace)
    on = {k: v["latency_mean_s"] for k, v in files.items()}
    ratio = on["no sleep, prepare on"] / on["sleep, prepare on"]
    print(f"  without sleep / with, prepare on: {ratio:.2f}x")

    sc = get_scenario("beside-batch")
    cfg = sc.config
    chat, bulk = cfg.models["chat-8b"], cfg.models["bulk-14b"]
    answer_s = max(chat.service_s, bulk.service_s)
    assert chat.sleep is not None
    results["beside-batch"] = runs = scenario_runs(
        sc,
        [
            ("sleep", cfg, True),
            ("no sleep", without_sleep(BESIDE_BATCH_CONFIG), True),
            ("no sleep, no aborts", without_sleep(BESIDE_BATCH_CONFIG), False),
        ],
        args.speed,
        live,
    )
    wake_bound = chat.sleep.wake_s + 2 * answer_s
    load_bound = chat.load_s + 2 * answer_s
    for mode in ("simulated", "live") if live else ("simulated",):
        p95 = runs["sleep"][mode]["per_class"]["interactive"]["wait_p95_s"]
        worst = runs["no sleep"][mode]["per_class"]["interactive"]["wait_max_s"]
        print(
            f"\n{mode}: the person's wait p95 with sleep {p95:.1f} s (target <= one wake and "
            f"two answers, {wake_bound:g} s); max without sleep {worst:.1f} s (target <= one "
            f"load and two answers, {load_bound:g} s)"
        )

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    results["family"] = family(seeds)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
