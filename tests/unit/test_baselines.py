"""The peers' schedulers as simulator baselines (corral/sim/baselines.py): `llama-swap` serves the
ready model's requests ahead of older ones for other models, swaps only once it has nothing in
flight, takes every queued request for the incoming model into that swap, and bounds no wait;
`fifo` (Ollama's) keeps arrival order."""

from __future__ import annotations

import json

import pytest

from corral.config import parse_config
from corral.policy_names import SimPolicyName
from corral.sim.engine import simulate
from corral.sim.metrics import summarize
from corral.sim.trace import Trace, parse_trace

pytestmark = pytest.mark.unit

CONFIG = parse_config(
    "models:\n  a: {load_s: 10, service_s: 1}\n  b: {load_s: 10, service_s: 1}\n"
    "scheduler: {max_wait_s: 30}\n"
)


def trace(lines: list[dict[str, object]]) -> Trace:
    return parse_trace([json.dumps(x) for x in lines], {"a", "b"})


def test_a_burst_alternating_two_models_loads_each_once_and_serves_them_in_blocks() -> None:
    t = trace([{"t": i * 0.01, "model": "ab"[i % 2], "service_s": 1} for i in range(8)])
    swap, ollama = (simulate(CONFIG, t, policy=p, check=True) for p in ("llama-swap", "fifo"))
    assert summarize(swap)["loads"] == 2
    order = [r.model for r in sorted(swap.requests, key=lambda r: r.dispatched_at or 0)]
    assert order == ["a"] * 4 + ["b"] * 4  # b's queued requests all joined its one swap
    assert summarize(ollama)["loads"] == 8  # arrival order: a swap a request


def test_a_stream_for_the_ready_model_keeps_another_waiting_without_bound() -> None:
    # a is ready and busy with a request a second for 120 s; one request for b arrives at 5 s.
    lines: list[dict[str, object]] = [
        {"t": float(i), "model": "a", "service_s": 1.2} for i in range(120)
    ]
    lines.append({"t": 5.0, "model": "b", "service_s": 1})
    t = trace(lines)

    def b_wait(policy: SimPolicyName) -> float:
        run = simulate(CONFIG, t, policy=policy, check=True)
        (r,) = [r for r in run.requests if r.model == "b"]
        assert r.dispatched_at is not None
        return r.dispatched_at - r.arrived_at

    assert b_wait("llama-swap") > 100  # served when a's stream ends: a never ran dry
    assert b_wait("cost") < 30 + 2 * 10  # Corral bounds it: max_wait_s, then the swaps


def test_agents_on_their_own_models_are_held_through_their_think_time_where_llama_swap_swaps() -> (
    None
):
    """Four agents in closed loops, each on a model of its own, 0.25-1.5 s of think time and
    swaps of 3 s (item 4; benchmarks/bench_think.py live): llama-swap swaps as soon
    as nothing is in flight, so nearly every step is a swap; `cost` holds a model through its
    agent's learned think time (`Cost.linger_s`), at least 30% fewer loads and a lower mean
    latency. With the hold switched off it is llama-swap's schedule."""
    models = "abcd"
    config = parse_config(
        "models:\n"
        + "".join(f"  {m}: {{load_s: 3, unload_s: 0.3, service_s: 1}}\n" for m in models)
        + "scheduler: {max_wait_s: 120}\n"
    )
    lines: list[dict[str, object]] = []
    for i, m in enumerate(models):
        for k in range(10):
            line: dict[str, object] = {"session": m, "model": m, "service_s": 1 + 0.1 * (k % 3)}
            if k == 0:
                line["t"] = 0.5 * i
            else:
                line["think_s"] = 0.25 + 1.25 * ((7 * k + 3 * i) % 10) / 10
            lines.append(line)
    t = parse_trace([json.dumps(x) for x in lines], set(models))
    held, swap = (
        summarize(simulate(config, t, policy=p, check=True)) for p in ("cost", "llama-swap")
    )
    assert swap["loads"] >= 36, swap  # a swap at nearly every one of the 40 steps
    assert held["loads"] <= 0.7 * swap["loads"]
    assert held["latency_mean_s"] < swap["latency_mean_s"]
    cost = config.scheduler.cost.model_copy(update={"linger": False})
    off = config.model_copy(
        update={"scheduler": config.scheduler.model_copy(update={"cost": cost})}
    )
    assert summarize(simulate(off, t, policy="cost", check=True))["loads"] == swap["loads"]
