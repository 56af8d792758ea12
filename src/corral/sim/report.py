"""Presenting simulation results: a rich table, results.csv and PNG plots."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from corral.sim.engine import Run
from corral.sim.metrics import RESULT_KEYS

_TABLE_COLUMNS = (
    ("loads", "loads", "{:,.0f}"),
    ("makespan_s", "makespan s", "{:,.1f}"),
    ("throughput_rps", "req/s", "{:.3f}"),
    ("wait_mean_s", "wait mean", "{:,.1f}"),
    ("wait_p95_s", "wait p95", "{:,.1f}"),
    ("wait_max_s", "wait max", "{:,.1f}"),
    ("latency_mean_s", "latency mean", "{:,.1f}"),
    ("latency_p95_s", "latency p95", "{:,.1f}"),
    ("busy_frac", "busy", "{:.0%}"),
    ("swap_frac", "swap", "{:.0%}"),
    ("jain_fairness", "fairness", "{:.2f}"),
)


def results_table(results: Sequence[dict[str, Any]], title: str) -> Table:
    """One row per policy; the best value of each column in bold."""
    table = Table(title=title, title_justify="left")
    table.add_column("policy", style="cyan")
    for _, header, _ in _TABLE_COLUMNS:
        table.add_column(header, justify="right")
    lower_is_better = {
        "loads",
        "makespan_s",
        "wait_mean_s",
        "wait_p95_s",
        "wait_max_s",
        "latency_mean_s",
        "latency_p95_s",
        "swap_frac",
    }
    best: dict[str, float] = {}
    for key, _, _ in _TABLE_COLUMNS:
        values = [float(r[key]) for r in results]
        best[key] = min(values) if key in lower_is_better else max(values)
    for r in results:
        cells = []
        for key, _, fmt in _TABLE_COLUMNS:
            text = fmt.format(r[key])
            cells.append(
                f"[bold]{text}[/bold]" if len(results) > 1 and r[key] == best[key] else text
            )
        table.add_row(r["policy"], *cells)
    lb = results[0].get("lower_bound_makespan_s") if results else None
    if lb is not None:
        table.caption = f"lower bound on makespan: {lb:,.1f} s"
    return table


def per_model_table(results: Sequence[dict[str, Any]]) -> Table:
    """Waits per policy and model: where each policy makes someone wait."""
    table = Table(title="per model", title_justify="left")
    for header in ("policy", "model"):
        table.add_column(header, style="cyan" if header == "policy" else None)
    for header in ("requests", "loads", "wait mean", "wait p95", "wait max", "latency mean"):
        table.add_column(header, justify="right")
    for r in results:
        for i, (model, m) in enumerate(r["per_model"].items()):
            table.add_row(
                r["policy"] if i == 0 else "",
                model,
                f"{m['requests']:,}",
                f"{m['loads']:,}",
                f"{m['wait_mean_s']:,.1f}",
                f"{m['wait_p95_s']:,.1f}",
                f"{m['wait_max_s']:,.1f}",
                f"{m['latency_mean_s']:,.1f}",
                end_section=i == len(r["per_model"]) - 1,
            )
    return table


def per_class_table(results: Sequence[dict[str, Any]]) -> Table | None:
    """Waits per policy and service class; None when every request is interactive."""
    if not any("batch" in r.get("per_class", {}) for r in results):
        return None
    table = Table(title="per class", title_justify="left")
    for header in ("policy", "class"):
        table.add_column(header, style="cyan" if header == "policy" else None)
    for header in ("requests", "wait mean", "wait p95", "wait max", "latency mean"):
        table.add_column(header, justify="right")
    for r in results:
        classes = r.get("per_class", {})
        for i, (name, c) in enumerate(classes.items()):
            table.add_row(
                r["policy"] if i == 0 else "",
                name,
                f"{c['requests']:,}",
                f"{c['wait_mean_s']:,.1f}",
                f"{c['wait_p95_s']:,.1f}",
                f"{c['wait_max_s']:,.1f}",
                f"{c['latency_mean_s']:,.1f}",
                end_section=i == len(classes) - 1,
            )
    return table


def per_principal_table(results: Sequence[dict[str, Any]]) -> Table | None:
    """Waits and charged device time per policy and principal; None when no request names a
    principal."""
    if not any(r.get("per_principal") for r in results):
        return None
    table = Table(title="per principal", title_justify="left")
    for header in ("policy", "principal"):
        table.add_column(header, style="cyan" if header == "policy" else None)
    for header in ("requests", "wait p50", "wait p95", "wait max", "service s", "loads s"):
        table.add_column(header, justify="right")
    for r in results:
        who = r.get("per_principal", {})
        for i, (name, p) in enumerate(who.items()):
            table.add_row(
                r["policy"] if i == 0 else "",
                name,
                f"{p['requests']:,}",
                f"{p['wait_p50_s']:,.1f}",
                f"{p['wait_p95_s']:,.1f}",
                f"{p['wait_max_s']:,.1f}",
                f"{p['service_s']:,.1f}",
                f"{p['load_s']:,.1f}",
                end_section=i == len(who) - 1,
            )
    return table


def tables(results: Sequence[dict[str, Any]], title: str, principals: bool = False) -> list[Table]:
    """The tables `corral simulate` and `corral replay` print: the results, per model, per
    class (where there is batch work) and, with `principals`, per principal (where named; a
    live run's charges are the scheduler's, which the replay does not read)."""
    out = [results_table(results, title), per_model_table(results)]
    out += [t for t in (per_class_table(results),) if t is not None]
    if principals and (who := per_principal_table(results)) is not None:
        out.append(who)
    return out


def write_csv(results: Sequence[dict[str, Any]], path: Path) -> None:
    """One row per policy (model = "*") and one per policy and model."""
    fields = ["policy", "model", *RESULT_KEYS, "lower_bound_makespan_s"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({**r, "model": "*"})
            for model, m in r["per_model"].items():
                w.writerow({"policy": r["policy"], "model": model, **m})


def write_plots(runs: Sequence[Run], results: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """loads.png, wait_cdf.png and timeline.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    written: list[Path] = []
    names = [r["policy"] for r in results]

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(names, [r["loads"] for r in results], color="#4c72b0")
    ax.bar_label(bars)
    ax.set_ylabel("model loads (swaps)")
    ax.set_title("Loads per policy")
    fig.tight_layout()
    written.append(out / "loads.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        waits = np.sort(
            np.array(
                [
                    r.dispatched_at - r.arrived_at
                    for r in run.requests
                    if r.dispatched_at is not None
                ]
            )
        )
        if waits.size:
            ax.step(
                waits, np.arange(1, waits.size + 1) / waits.size, where="post", label=run.policy
            )
    ax.set_xlabel("wait (s, dispatch - arrival)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Wait CDF per policy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(out / "wait_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    models = list(runs[0].config.models) if runs else []
    cmap = plt.get_cmap("tab20" if len(models) > 10 else "tab10")
    colors = {m: cmap(i % cmap.N) for i, m in enumerate(models)}
    lanes = [(run.policy, dev.name) for run in runs for dev in run.config.devices]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.45 * len(lanes)))
    for y, (policy, device) in enumerate(lanes):
        run = next(r for r in runs if r.policy == policy)
        for seg in run.segments:
            if seg.device != device or seg.end_s <= seg.start_s:
                continue
            ax.broken_barh(
                [(seg.start_s, seg.end_s - seg.start_s)],
                (y - 0.4, 0.8),
                facecolors=colors[seg.model],
                hatch="////" if seg.kind != "resident" else None,
                edgecolor="black" if seg.kind != "resident" else None,
                linewidth=0.2,
            )
    ax.set_yticks(range(len(lanes)))
    multi = len({d for _, d in lanes}) > 1
    ax.set_yticklabels([f"{p} · {d}" if multi else p for p, d in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (s); hatched = swapping to (or unloading) that model")
    ax.set_title("Resident model over time")
    handles = [Rectangle((0, 0), 1, 1, color=colors[m]) for m in models[:20]]
    ax.legend(handles, models[:20], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    written.append(out / "timeline.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
