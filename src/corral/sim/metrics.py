"""Figures of a simulated run: waits, latencies, device time shares, fairness, lower bound.

Per model: requests, loads, makespan and throughput (its first arrival to its last finish),
waits, latencies and mean slowdown; device shares and fairness are whole-run figures.

Wait = dispatch - arrival; latency = finish - arrival; makespan = last finish - first arrival.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import numpy.typing as npt

from corral.config import Config
from corral.sim.engine import Run, SimRequest
from corral.sim.trace import Trace

Floats = npt.NDArray[np.float64]
RESULT_KEYS = (
    "requests",
    "rejected",
    "loads",
    "makespan_s",
    "throughput_rps",
    "wait_mean_s",
    "wait_p50_s",
    "wait_p95_s",
    "wait_p99_s",
    "wait_max_s",
    "latency_mean_s",
    "latency_p50_s",
    "latency_p95_s",
    "latency_p99_s",
    "latency_max_s",
    "busy_frac",
    "swap_frac",
    "idle_frac",
    "jain_fairness",
)


def _stats(prefix: str, x: Floats) -> dict[str, float]:
    if x.size == 0:
        return {f"{prefix}_{k}_s": 0.0 for k in ("mean", "p50", "p95", "p99", "max")}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {
        f"{prefix}_mean_s": float(x.mean()),
        f"{prefix}_p50_s": float(p50),
        f"{prefix}_p95_s": float(p95),
        f"{prefix}_p99_s": float(p99),
        f"{prefix}_max_s": float(x.max()),
    }


def jain(values: Floats) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes all."""
    if values.size == 0 or not np.any(values):
        return 1.0
    return float(values.sum() ** 2 / (values.size * np.square(values).sum()))


def lower_bound_makespan_s(config: Config, trace: Trace) -> float | None:
    """A makespan no schedule can beat (open-loop traces; None for closed loop).

    For each release time t: everything released at or after t still needs its work (divided by
    the model's concurrency) plus one load per model it involves, minus the loads of models that
    may already be resident at t (none at the first release; else the D largest for D devices),
    shared over the devices; no request finishes before its release plus its service either.
    Where a device can hold several models, loads overlap with serving, so only work counts,
    shared over every model that can be resident at once.
    """
    if not trace.open_loop:
        return None
    models = config.models
    lines = sorted(trace.lines, key=lambda x: x.t or 0.0)
    t0 = lines[0].t or 0.0
    slots = 0
    for d in config.devices:
        sizes = [m.memory_gb for m in models.values() if m.memory_gb is not None]
        fit = 1
        if d.memory_gb is not None and len(sizes) == len(models):
            fit = max(1, min(len(models), int(d.memory_gb // min(sizes))))
        slots += fit
    exclusive = slots == len(config.devices)  # every device holds one model at a time
    devices = slots
    best = max((x.t or 0.0) + x.service_s for x in lines)
    work = 0.0
    setups: dict[str, float] = {}
    setup_sum = 0.0
    largest = 0.0
    i = len(lines) - 1
    while i >= 0:
        t = lines[i].t or 0.0
        while i >= 0 and (lines[i].t or 0.0) == t:
            x = lines[i]
            work += x.service_s / models[x.model].concurrency
            if x.model not in setups:
                s = models[x.model].load_s
                setups[x.model] = s
                setup_sum += s
                largest = max(largest, s)
            i -= 1
        # Up to one model per device may already be resident at t (none at the first release).
        credit = (
            0.0
            if t == t0
            else (largest if devices == 1 else sum(heapq.nlargest(devices, setups.values())))
        )
        setup_s = (setup_sum - credit) if exclusive else 0.0
        best = max(best, t + (work + setup_s) / devices)
    return best - t0


def _arrays(reqs: list[SimRequest]) -> tuple[Floats, Floats, Floats, Floats]:
    n = len(reqs)
    arr = np.fromiter((r.arrived_at for r in reqs), float, n)
    dis = np.fromiter((r.dispatched_at for r in reqs), float, n)
    fin = np.fromiter((r.finished_at for r in reqs), float, n)
    svc = np.fromiter((r.service_s for r in reqs), float, n)
    return arr, dis, fin, svc


def summarize(run: Run) -> dict[str, Any]:
    """The figures `corral simulate --json` prints for one policy."""
    rejected = {id(r) for r, _ in run.rejected}
    done = [r for r in run.requests if id(r) not in rejected]
    arr, dis, fin, svc = _arrays(done)
    first = float(arr.min()) if done else 0.0
    last = float(fin.max()) if done else 0.0
    makespan = last - first
    wait, lat = dis - arr, fin - arr
    devices = [d.name for d in run.config.devices]
    span = makespan * len(devices)
    busy = sum(run.busy_s.values()) / span if span else 0.0
    swap = sum(run.swap_s.values()) / span if span else 0.0
    models = np.array([r.model for r in done]) if done else np.array([], dtype=str)
    per_model: dict[str, dict[str, float]] = {}
    slowdowns = []
    for name in run.config.models:
        mask = models == name
        if not mask.any():
            continue
        w, la = wait[mask], lat[mask]
        span = float(fin[mask].max() - arr[mask].min())
        entry: dict[str, float] = {
            "requests": int(mask.sum()),
            "loads": int(run.loads.get(name, 0)),
            "makespan_s": span,
            "throughput_rps": int(mask.sum()) / span if span else 0.0,
            **_stats("wait", w),
            **_stats("latency", la),
        }
        slowdown = float((la / svc[mask]).mean())
        entry["slowdown_mean"] = slowdown
        slowdowns.append(slowdown)
        per_model[name] = entry
    result: dict[str, Any] = {
        "policy": run.policy,
        "requests": len(done),
        "rejected": len(run.rejected),
        "loads": int(sum(run.loads.values())),
        "makespan_s": makespan,
        "throughput_rps": len(done) / makespan if makespan else 0.0,
        **_stats("wait", wait),
        **_stats("latency", lat),
        "busy_frac": busy,
        "swap_frac": swap,
        "idle_frac": max(0.0, round(1.0 - busy - swap, 12)),
        "jain_fairness": jain(np.array(slowdowns)),
        "lower_bound_makespan_s": lower_bound_makespan_s(run.config, run.trace),
        "per_model": per_model,
        "per_class": per_class(done, wait, lat),
    }
    if any(r.principal is not None for r in done):
        result["per_principal"] = per_principal(run, done, wait)
    return result


def per_principal(run: Run, done: list[SimRequest], wait: Floats) -> dict[str, dict[str, float]]:
    """Each principal's requests, waits, and the device-seconds of service and of loads the
    scheduler charged it (core/shares.py)."""
    who = np.array([r.principal or "" for r in done])
    out: dict[str, dict[str, float]] = {}
    for name in sorted(set(who.tolist())):
        mask = who == name
        service_s, load_s = run.charged.get(name or None, (0.0, 0.0))
        out[name or "(none)"] = {
            "requests": int(mask.sum()),
            **_stats("wait", wait[mask]),
            "service_s": service_s,
            "load_s": load_s,
        }
    return out


def per_class(done: list[SimRequest], wait: Floats, lat: Floats) -> dict[str, dict[str, float]]:
    """Requests, waits and latencies of each service class that has requests."""
    batch = np.fromiter((r.background for r in done), bool, len(done))
    out: dict[str, dict[str, float]] = {}
    for name, mask in (("interactive", ~batch), ("batch", batch)):
        if mask.any():
            out[name] = {
                "requests": int(mask.sum()),
                **_stats("wait", wait[mask]),
                **_stats("latency", lat[mask]),
            }
    return out
