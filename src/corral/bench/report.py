"""What `corral bench` leaves behind: `results.csv` (a row per load point), `manifest.json` (the
command, versions, machine, and what the server said of itself), `throughput_latency.png` and
`latency_cdf.png`."""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from corral import __version__
from corral.bench.loadgen import Point, Spec


def write_csv(points: list[Point], path: Path) -> None:
    rows = [p.summary() for p in points]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def server_facts(spec: Spec) -> dict[str, Any]:
    """The server's own account, where it gives one: /v1/models, and Corral's /api/status."""
    base = spec.url.rstrip("/")
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    facts: dict[str, Any] = {"url": base}
    for key, path in (("models", "/v1/models"), ("corral_status", "/api/status")):
        try:
            r = httpx.get(base + path, headers=headers, timeout=5)
        except httpx.HTTPError:
            continue
        if r.status_code == 200 and "json" in r.headers.get("content-type", ""):
            facts[key] = r.json()
    return facts


def write_manifest(spec: Spec, points: list[Point], path: Path, argv: list[str]) -> None:
    manifest = {
        "command": " ".join(argv),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "spec": {
            "endpoint": spec.endpoint,
            "models": spec.models,
            "requests": spec.requests,
            "prompt_words": spec.prompt_words,
            "max_tokens": spec.max_tokens,
        },
        "versions": {"corral": __version__, "python": sys.version.split()[0]},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "server": server_facts(spec),
        "points": [p.summary() for p in points],
    }
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def write_plots(points: list[Point], out: Path) -> list[Path]:
    """Throughput against p95 latency (one marker per point), and the latency CDF per point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p.summary() for p in points]
    written = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r["requests_per_s"] for r in rows]
    ys = [r["e2e_p95_ms"] or 0 for r in rows]
    ax.plot(xs, ys, marker="o", color="#4c72b0")
    for r, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("requests per second")
    ax.set_ylabel("end-to-end p95 (ms)")
    ax.set_title("Throughput against tail latency")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "throughput_latency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in points:
        e2e = sorted(s.e2e_s * 1000 for s in p.samples if s.e2e_s is not None and not s.error)
        if e2e:
            ax.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=p.label)
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF per load point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written
