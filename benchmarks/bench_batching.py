"""The static-batching lab's sweep, live: real all-MiniLM-L6-v2 embeddings
(`corral embed-backend`) behind `corral serve`, each `max_batch` x `max_wait_ms` point a model
with that `batch:` config, against the unbatched baseline (the same server, no `batch:`), loaded
by `corral bench`'s load generator at the lab's concurrency 50, 500 requests per point.

Every model is an `upstream:` to embed servers this script starts, so the sweep measures
batching, not swaps. The baseline runs on two servers: the default one (OpenMP threads sleep
between requests) and one with libgomp's own default (threads spin a moment first), which
serves one input at a time faster; the ratio is taken against the better of the two. Points run
in rounds, in turn, and each point's best round is kept (the machine is shared with the client and
the gateway, and noisy).

First, each process's CPU per request (server, gateway, client) unbatched and batched 32
(`--cpu-only` stops there: out/bench-batching/cpu.json). Writes out/bench-batching/:
batch_sweep.csv, lengths.csv, summary.json, and the plots
throughput_vs_batch.png, p95_vs_batch.png, latency_cdf_baseline_vs_batch.png.

Run: `make bench-batching` (`.venv/bin/python benchmarks/bench_batching.py [--rounds 2]`).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_gateway import wait_ok
from corral.backends.process import free_port
from corral.bench.loadgen import Point, Spec, run_point

CORRAL = str(Path(sys.executable).parent / "corral")
BATCHES = [1, 2, 4, 8, 16, 32, 64]
WAITS_MS = [0, 2, 5, 10, 20]
LENGTHS = [4, 8, 16, 32]  # words per input, for the length table


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def config(passive: str, spinning: str, log_dir: Path) -> str:
    lines = ["models:"]

    def model(name: str, upstream: str, batch: str = "") -> None:
        lines.extend(
            [
                f"  {name}:",
                f"    upstream: {upstream}",
                "    upstream_model: all-MiniLM-L6-v2",
                "    load_s: 0.01",
                "    max_queue: 4096",
            ]
        )
        if batch:
            lines.append(f"    batch: {batch}")

    model("unbatched", passive)
    model("unbatched-spin", spinning)
    for b in BATCHES:
        for w in WAITS_MS:
            model(f"b{b}-w{w}", passive, f"{{max_size: {b}, max_wait_ms: {w}}}")
    lines += ["server:", f"  log_dir: {log_dir}"]
    return "\n".join(lines) + "\n"


def measure(url: str, model: str, words: int, requests: int, concurrency: int) -> Point:
    spec = Spec(url, "embeddings", [model], requests, prompt_words=words)
    asyncio.run(run_point(Spec(url, "embeddings", [model], 60, prompt_words=words), 8))  # warm
    return asyncio.run(run_point(spec, concurrency=concurrency))


def best(points: list[Point]) -> Point:
    return max(points, key=lambda p: p.summary()["requests_per_s"])


def plots(
    out: Path, rows: list[dict[str, Any]], base: dict[str, Any], cdf: dict[str, Point]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric, name, label in (
        ("requests_per_s", "throughput_vs_batch.png", "throughput (requests/s)"),
        ("e2e_p95_ms", "p95_vs_batch.png", "end-to-end p95 (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for w in WAITS_MS:
            xs = [r["max_batch"] for r in rows if r["max_wait_ms"] == w]
            ys = [r[metric] for r in rows if r["max_wait_ms"] == w]
            ax.plot(xs, ys, marker="o", label=f"max_wait_ms {w}")
        ax.axhline(base[metric], color="k", linestyle="--", label="unbatched (best server)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
        ax.set_xlabel("max_batch (batch.max_size)")
        ax.set_ylabel(label)
        ax.set_title(f"MiniLM through corral serve, concurrency 50: {label}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, point in cdf.items():
        lat = sorted(s.e2e_s * 1000 for s in point.samples if s.e2e_s is not None)
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=label)
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF: unbatched vs batched, concurrency 50")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_cdf_baseline_vs_batch.png", dpi=110)
    plt.close(fig)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_request(url: str, model: str, pids: dict[str, int], args: Any) -> dict[str, Any]:
    """Each process's CPU milliseconds per request over one point (the client is this one):
    where two cores go, batched and not."""
    measure(url, model, args.words, 100, args.concurrency)  # warm, not counted
    before = {n: cpu_s(p) for n, p in pids.items()}
    client = time.process_time()
    spec = Spec(url, "embeddings", [model], args.requests, prompt_words=args.words)
    point = asyncio.run(run_point(spec, concurrency=args.concurrency))
    n = len(point.samples)
    row = {f"{k}_cpu_ms": round((cpu_s(p) - before[k]) * 1000 / n, 2) for k, p in pids.items()}
    row["client_cpu_ms"] = round((time.process_time() - client) * 1000 / n, 2)
    return {"model": model, "requests_per_s": point.summary()["requests_per_s"], **row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--words", type=int, default=8, help="words per input in the sweep")
    ap.add_argument("--out", type=Path, default=Path("out/bench-batching"))
    ap.add_argument(
        "--cpu-only", action="store_true", help="only the CPU-per-request pass (about a minute)"
    )
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ports = free_port(), free_port()
    servers = [
        start([CORRAL, "embed-backend", "--port", str(ports[0])]),
        # libgomp's default wait (an empty OMP_WAIT_POLICY: embed-backend keeps it): threads
        # spin a moment after each parallel region, then sleep. Never ACTIVE here: its threads
        # spin for many seconds after each request, taking a core from everything else.
        start([CORRAL, "embed-backend", "--port", str(ports[1])], {"OMP_WAIT_POLICY": ""}),
    ]
    gw_port = free_port()
    cfg = out / "corral.yaml"
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cfg.write_text(config(urls[0], urls[1], out / "logs"))
    gateway = start([CORRAL, "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{gw_port}"])
    url = f"http://127.0.0.1:{gw_port}"
    try:
        for u in [*urls, url]:
            wait_ok(f"{u}/health", 120)
        pids = {"server": servers[0].pid, "gateway": gateway.pid}
        cpu = [cpu_per_request(url, m, pids, args) for m in ("unbatched", "b32-w5")]
        print(json.dumps({"cpu_per_request": cpu}, indent=2), file=sys.stderr)
        if args.cpu_only:
            (out / "cpu.json").write_text(json.dumps(cpu, indent=2))
            return
        names = ["unbatched", "unbatched-spin"] + [f"b{b}-w{w}" for b in BATCHES for w in WAITS_MS]
        found: dict[str, list[Point]] = {n: [] for n in names}
        total = args.rounds * len(names) + 3 * args.rounds * len(LENGTHS)
        done = 0
        for _ in range(args.rounds):
            for name in names:
                found[name].append(measure(url, name, args.words, args.requests, args.concurrency))
                done += 1
                row = found[name][-1].summary()
                print(
                    f"[{done}/{total}] {name}: {row['requests_per_s']:.1f} req/s, "
                    f"p95 {row['e2e_p95_ms']} ms",
                    file=sys.stderr,
                )
        kept = {n: best(ps) for n, ps in found.items()}
        base_name = max(
            ("unbatched", "unbatched-spin"), key=lambda n: kept[n].summary()["requests_per_s"]
        )
        base = kept[base_name].summary()
        rows = []
        for b in BATCHES:
            for w in WAITS_MS:
                s = kept[f"b{b}-w{w}"].summary()
                rows.append(
                    {
                        "max_batch": b,
                        "max_wait_ms": w,
                        **{
                            k: s[k]
                            for k in (
                                "requests_per_s",
                                "e2e_p50_ms",
                                "e2e_p95_ms",
                                "e2e_p99_ms",
                                "errors",
                            )
                        },
                        "speedup": round(s["requests_per_s"] / base["requests_per_s"], 2),
                    }
                )
        with (out / "batch_sweep.csv").open("w", newline="") as f:
            sweep_csv = csv.DictWriter(f, fieldnames=list(rows[0]))
            sweep_csv.writeheader()
            sweep_csv.writerows(rows)
        # How the gain depends on the inputs' length (compute grows with tokens; the fixed cost
        # per request is what batching saves).
        lengths = []
        for words in LENGTHS:
            un = [
                measure(url, "unbatched-spin", words, args.requests, args.concurrency)
                for _ in range(args.rounds)
            ]
            un += [
                measure(url, "unbatched", words, args.requests, args.concurrency)
                for _ in range(args.rounds)
            ]
            bt = [
                measure(url, "b32-w5", words, args.requests, args.concurrency)
                for _ in range(args.rounds)
            ]
            done += 3 * args.rounds
            u_row, b_row = best(un).summary(), best(bt).summary()
            lengths.append(
                {
                    "words": words,
                    "unbatched_req_per_s": u_row["requests_per_s"],
                    "unbatched_p95_ms": u_row["e2e_p95_ms"],
                    "batched32_req_per_s": b_row["requests_per_s"],
                    "batched32_p95_ms": b_row["e2e_p95_ms"],
                    "speedup": round(b_row["requests_per_s"] / u_row["requests_per_s"], 2),
                }
            )
            print(f"[{done}/{total}] {words} words: {lengths[-1]}", file=sys.stderr)
        with (out / "lengths.csv").open("w", newline="") as f:
            lengths_csv = csv.DictWriter(f, fieldnames=list(lengths[0]))
            lengths_csv.writeheader()
            lengths_csv.writerows(lengths)
        cdf = {
            f"unbatched ({base_name})": kept[base_name],
            "max_batch 8, max_wait_ms 5": kept["b8-w5"],
            "max_batch 32, max_wait_ms 5": kept["b32-w5"],
        }
        plots(out, rows, base, cdf)
        summary = {
            "machine": f"{platform.platform()}, {os.cpu_count()} cores",
            "command": " ".join(sys.argv),
            "words_per_input": args.words,
            "concurrency": args.concurrency,
            "requests_per_point": args.requests,
            "rounds": args.rounds,
            "baseline": base_name,
            "unbatched": {n: kept[n].summary() for n in ("unbatched", "unbatched-spin")},
            "batched32_w5_speedup": next(
                r["speedup"] for r in rows if r["max_batch"] == 32 and r["max_wait_ms"] == 5
            ),
            "sweep": rows,
            "lengths": lengths,
            "cpu_per_request": cpu,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: summary[k] for k in ("baseline", "batched32_w5_speedup")}, indent=2))
    finally:
        for p in [gateway, *servers]:
            p.terminate()
        for p in [gateway, *servers]:
            p.wait(30)


if __name__ == "__main__":
    main()
