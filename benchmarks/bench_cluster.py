"""Several `corral worker` processes on one PostgreSQL: loads and throughput, with model affinity
(the default) and without (`--no-affinity`: each worker schedules its device alone), in the same
run.

Each run: a fresh schema, `--models` models (a load hook of `--load-s`), tasks spread evenly
over them, then N workers started together with `--until-idle`. Reported: total loads (and per
worker), and the steady drain rate (from 10% of the tasks done to the last, as bench_queue.py)
against the ideal (N workers all busy: N / task time), for no-op tasks and for 50 ms tasks;
then 16 models with Zipf popularity on the most workers: loads per task and mean wait (a task's
start after the workers were started).

Run: `make bench-cluster`, or `.venv/bin/python benchmarks/bench_cluster.py [--workers 1 2 4 8]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from corral.store import NewTask, open_store

PG = "postgresql://postgres@127.0.0.1:5432/test"
CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
APP = """
import os, time
import corral

MODELS = int(os.environ["BENCH_MODELS"])
LOAD_S = float(os.environ["BENCH_LOAD_S"])
TASK_S = float(os.environ["BENCH_TASK_S"])
LOG = os.environ["BENCH_LOG"]
q = corral.Queue(os.environ["BENCH_DB"], config=corral.parse_config(
    "models: {" + ", ".join(f"m{i}: {{load_s: {LOAD_S}, service_s: {max(TASK_S, 0.001)}}}"
                            for i in range(MODELS)) + "}"))

def loader(name):
    def load():
        time.sleep(LOAD_S)
        with open(LOG, "a") as f:
            f.write(f"load {name} {os.getpid()} {time.time()}\\n")
    return load

def work(p):
    t0 = time.time()
    if TASK_S:
        time.sleep(TASK_S)
    with open(LOG, "a") as f:
        f.write(f"task {t0} {time.time()} {os.getpid()}\\n")

for i in range(MODELS):
    q.model(f"m{i}", load=loader(f"m{i}"))
    q.handler(f"k{i}", model=f"m{i}")(work)
"""


def run_once(
    workers: int,
    affinity: bool,
    task_s: float,
    args: argparse.Namespace,
    models: int | None = None,
    skewed: bool = False,
) -> dict[str, Any]:
    """One drain; `skewed`: tasks spread over the models by Zipf popularity (s = 1)."""
    models = models or args.models
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    url = f"{PG}?schema={schema}"
    folder = Path(tempfile.mkdtemp(prefix="corral-cluster-"))
    (folder / "app.py").write_text(APP)
    log = folder / "log.txt"
    log.write_text("")
    n = args.tasks_per_worker * workers if task_s else args.noop_tasks
    store = open_store(url)
    rng = random.Random(7)
    weights = [1 / (k + 1) if skewed else 1.0 for k in range(models)]
    picks = rng.choices(range(models), weights, k=n) if skewed else [i % models for i in range(n)]
    store.enqueue_many([NewTask(f"k{m}", f"m{m}", {}) for m in picks])
    store.close()
    env = {
        **os.environ,
        "BENCH_DB": url,
        "BENCH_MODELS": str(models),
        "BENCH_LOAD_S": str(args.load_s),
        "BENCH_TASK_S": str(task_s),
        "BENCH_LOG": str(log),
        "PYTHONPATH": str(folder),
    }
    cmd = [CORRAL, "worker", "--app", "app:q", "--until-idle"]
    if not affinity:
        cmd.append("--no-affinity")
    started_at = time.time()
    procs = [
        subprocess.Popen(cmd, cwd=folder, env=env, stderr=subprocess.DEVNULL)
        for _ in range(workers)
    ]
    for p in procs:
        p.wait(timeout=900)
    lines = [x.split() for x in log.read_text().splitlines()]
    loads = [x for x in lines if x[0] == "load"]
    starts = [float(x[1]) for x in lines if x[0] == "task"]
    ends = [float(x[2]) for x in lines if x[0] == "task"]
    # Steady state, as bench_queue.py: from 10% done to 100% done, so that process start-up
    # (eight Python processes importing on two cores take seconds) is left out alike.
    ends.sort()
    tenth = ends[len(ends) // 10]
    span = ends[-1] - tenth
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
    shutil.rmtree(folder, ignore_errors=True)
    rate = (len(ends) - len(ends) // 10 - 1) / span
    per_worker = {pid: sum(1 for x in loads if x[2] == pid) for pid in {x[2] for x in loads}}
    out: dict[str, Any] = {
        "workers": workers,
        "affinity": affinity,
        "task_s": task_s,
        "tasks": len(starts),
        "loads": len(loads),
        "max_loads_per_worker": max(per_worker.values(), default=0),
        "rate_per_s": rate,
        "models": models,
        "skewed": skewed,
        "loads_per_task": len(loads) / len(starts),
        "wait_mean_s": sum(starts) / len(starts) - started_at,
        # The whole drain, from the workers' start (process start-up included) to the last task.
        "first_task_s": min(starts) - started_at,
        "whole_rate_per_s": len(ends) / (ends[-1] - started_at),
    }
    if task_s:
        out["ideal_per_s"] = workers / task_s
        out["of_ideal"] = rate / out["ideal_per_s"]
        out["whole_of_ideal"] = out["whole_rate_per_s"] / out["ideal_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--load-s", type=float, default=0.2)
    ap.add_argument("--noop-tasks", type=int, default=4000)
    ap.add_argument("--tasks-per-worker", type=int, default=200)
    ap.add_argument("--json", type=Path, default=Path("out/bench_cluster.json"))
    args = ap.parse_args()
    rows = []
    for task_s in (0.0, 0.05):
        for workers in args.workers:
            for affinity in (False, True):
                row = run_once(workers, affinity, task_s, args)
                rows.append(row)
                ideal = (
                    f", {row['of_ideal']:.0%} of ideal (whole drain from start: "
                    f"{row['whole_of_ideal']:.0%}, first task at {row['first_task_s']:.1f} s)"
                    if task_s
                    else ""
                )
                print(
                    f"{'50 ms' if task_s else 'no-op':5s} {workers} worker(s) "
                    f"{'affinity   ' if affinity else 'independent'}: {row['loads']:3d} loads "
                    f"(max {row['max_loads_per_worker']} per worker), "
                    f"{row['rate_per_s']:,.0f} tasks/s{ideal}",
                    flush=True,
                )
    big = max(args.workers)
    for affinity in (False, True):
        row = run_once(big, affinity, 0.05, args, models=16, skewed=True)
        rows.append(row)
        print(
            f"skewed {big} worker(s) x 16 models {'affinity' if affinity else 'independent'}: "
            f"{row['loads']} loads ({row['loads_per_task']:.3f} per task), mean wait "
            f"{row['wait_mean_s']:.1f} s, {row['rate_per_s']:,.0f} tasks/s",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.node(), "rows": rows}, indent=2))
    print()
    print(f"{args.models} models, load hook {args.load_s} s; {os.cpu_count()} CPUs")
    print()
    print(
        "| tasks | workers | loads: independent | loads: affinity | tasks/s: independent "
        "| tasks/s: affinity | of ideal: independent | of ideal: affinity |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for task_s in (0.0, 0.05):
        for workers in args.workers:
            a, b = (
                next(r for r in rows if r["task_s"] == task_s and r["workers"] == workers
                     and r["affinity"] is aff)
                for aff in (False, True)
            )  # fmt: skip
            ia = f"{a['of_ideal']:.0%}" if task_s else "n/a"
            ib = f"{b['of_ideal']:.0%}" if task_s else "n/a"
            print(
                f"| {'50 ms' if task_s else 'no-op'} | {workers} | {a['loads']} | {b['loads']} "
                f"| {a['rate_per_s']:,.0f} | {b['rate_per_s']:,.0f} | {ia} | {ib} |"
            )
    a, b = (next(r for r in rows if r["skewed"] and r["affinity"] is aff) for aff in (False, True))
    print(f"\n{big} workers x 16 models, Zipf popularity, 50 ms tasks:\n")
    print("| | loads | loads per task | mean wait s | tasks/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("independent", a), ("affinity", b)):
        print(
            f"| {name} | {r['loads']} | {r['loads_per_task']:.3f} | {r['wait_mean_s']:.1f} "
            f"| {r['rate_per_s']:,.0f} |"
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
