"""The soak's report (benchmarks/bench_soak.py): its checks, `report.json`, `report.md` and
`soak.png` (memory, files, threads and tasks over time; waits over time; disk; faults marked)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

GROWTH_MAX = 0.05  # over the last 80% of the run
FLAT = ("rss_mb", "fds", "threads_own", "tasks")
FAULT_AFTER_S = 10.0  # a fault's moment: from its start to this long after its end


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def growth(samples: list[dict[str, Any]], key: str, t0: float, t1: float) -> dict[str, Any]:
    """`key` after warm-up (the median of the run's 20-30% mark) against its end (the median
    of its last 10%)."""
    span = t1 - t0

    def between(a: float, b: float) -> list[float]:
        return [s[key] for s in samples if s.get(key) is not None and a <= s["t"] - t0 <= b]

    first = _median(between(0.2 * span, 0.3 * span))
    last = _median(between(0.9 * span, span))
    if not first or last is None:
        return {"first": first, "last": last, "growth": None, "ok": False}
    g = last / first - 1
    return {
        "first": round(first, 1),
        "last": round(last, 1),
        "growth": round(g, 4),
        "ok": g < GROWTH_MAX,
    }


def in_fault(t: float, width_s: float, faults: list[dict[str, Any]]) -> bool:
    return any(t - width_s <= f.get("t1", f["t0"]) + FAULT_AFTER_S and t >= f["t0"] for f in faults)


def checks(run: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    fates = run["fates"]
    by = Counter(f["outcome"] for f in fates)
    samples = run["samples"]
    t0 = run["started"]
    t1 = max([s["t"] for s in samples] or [t0])
    ended = [b for b in run["batches"] if b.get("status") and b["status"] != "unfinished"]
    tasks = run["tasks"]
    stalls = [(s["t"], s["stalls_over_100ms"]) for s in samples if s.get("stalls_over_100ms")]
    outside = sum(n for t, n in stalls if not in_fault(t, args["sample_s"], run["faults"]))
    servers = max([s.get("log_servers") or 1 for s in samples] or [1])
    out: dict[str, Any] = {
        "requests": {"total": len(fates), **dict(by)},
        "requests_ok": by["hang"] == 0 and by["lost"] == 0,
        "batches": {
            "ended": len(ended),
            "unfinished": sum(b.get("status") == "unfinished" for b in run["batches"]),
            "lines": sum(b["lines"] for b in ended),
            "missing": sum(b["missing"] for b in ended),
            "twice": sum(b["twice"] for b in ended),
        },
        "tasks": tasks,
        "growth": {k: growth(samples, k, t0, t1) for k in FLAT},
        "disk": {
            k: round(max([s.get(k) or 0.0 for s in samples] or [0.0]), 1)
            for k in ("db_mb", "logs_mb", "files_mb")
        },
        "stalls_over_100ms": {
            "in_faults": sum(n for _, n in stalls) - outside,
            "outside": outside,
        },
    }
    out["batches_ok"] = (
        out["batches"]["missing"] == 0
        and out["batches"]["twice"] == 0
        and (out["batches"]["unfinished"] == 0)
    )
    status = tasks.get("status", {})
    out["tasks_ok"] = (
        status.get("succeeded", 0) == tasks.get("submitted", -1)
        and tasks.get("ran_twice", 1) == 0
        and tasks.get("wrong_results", 1) == 0
    )
    out["stopped_clean_ok"] = not tasks.get("servers_left")
    out["flat_ok"] = all(g["ok"] for g in out["growth"].values())
    each_mb = args.get("log_max_mb", 4.0) * args.get("log_files", 3)  # per model server
    out["disk"]["logs_bound_mb"] = round(each_mb * servers + 1, 1)  # and the folder's small files
    out["disk"]["log_files_rotated"] = max([s.get("log_rotated") or 0 for s in samples] or [0])
    out["disk_ok"] = out["disk"]["logs_mb"] <= out["disk"]["logs_bound_mb"]
    out["stalls_ok"] = outside == 0
    return out


def report(run: dict[str, Any], args: dict[str, Any], machine: str, out: Path) -> bool:
    """Writes the report to `out`; True when every check holds."""
    c = checks(run, args)
    (out / "report.json").write_text(
        json.dumps({"checks": c, "args": args, "machine": machine, **run}, indent=1)
    )
    plot(run, out / "soak.png")
    verdicts = [k for k in c if k.endswith("_ok")]
    lines = [
        f"# Soak: {args['minutes']:g} minutes, seed {args['seed']}, on {machine}",
        "",
        "| check | holds |",
        "|---|---|",
        *(f"| {k[:-3]} | {'yes' if c[k] else '**no**'} |" for k in verdicts),
        "",
        f"Requests: {json.dumps(c['requests'])}",
        "",
        f"Batches: {json.dumps(c['batches'])}",
        "",
        f"Tasks: {json.dumps(c['tasks'])}",
        "",
        "| figure | after warm-up | at the end | growth |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {g['first']} | {g['last']} | {g['growth']} |" for k, g in c["growth"].items()),
        "",
        f"Disk, largest seen (MiB): {json.dumps(c['disk'])}",
        "",
        f"Loop lags over 100 ms: {json.dumps(c['stalls_over_100ms'])}",
        "",
        "Faults: " + json.dumps(Counter(f["kind"] for f in run["faults"])),
        "",
        *(f"- {n}" for n in run["notes"]),
        "",
        "![soak](soak.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return all(c[k] for k in verdicts)


def plot(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run["started"]
    samples = run["samples"]
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)

    def series(ax: Any, keys: list[str], title: str) -> None:
        for k in keys:
            pts = [((s["t"] - t0) / 60, s[k]) for s in samples if s.get(k) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=k)
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)

    series(axes[0][0], ["rss_mb"], "corral serve RSS (MiB)")
    own = ["fds", "threads", "threads_own", "tasks"]
    series(axes[0][1], own, "open files, threads (own: less the log copiers), asyncio tasks")
    series(axes[1][1], ["db_mb", "logs_mb", "files_mb"], "disk (MiB)")
    series(axes[2][1], ["health_ms"], "/health latency (ms)")
    ax = axes[1][0]
    for kind in sorted({f["kind"] for f in run["fates"]}):
        pts = [
            ((f["t0"] - t0) / 60, f["t1"] - f["t0"])
            for f in run["fates"]
            if f["kind"] == kind and f["outcome"] == "ok"
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=3, label=kind)
    ax.set_yscale("log")
    ax.set_title("request time, answered (s)")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[2][0]
    bad = [((f["t0"] - t0) / 60, f["outcome"]) for f in run["fates"] if f["outcome"] != "ok"]
    kinds = sorted({o for _, o in bad})
    for o in kinds:
        ax.scatter(
            [t for t, x in bad if x == o],
            [kinds.index(o)] * sum(x == o for _, x in bad),
            s=8,
            label=o,
        )
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_title("requests not answered (by outcome)")
    for row in axes:
        for a in row:
            for f in run["faults"]:
                a.axvline((f["t0"] - t0) / 60, color="red", alpha=0.25, lw=0.8)
    for a in axes[-1]:
        a.set_xlabel("minutes (red: a fault)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
