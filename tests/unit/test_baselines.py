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
