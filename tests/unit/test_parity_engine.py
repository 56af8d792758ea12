"""`corral.sim.parity.at_engine_times`: what the simulator is given from a replay on real servers
(parity; a loaded clean-clone run found two loops' next steps
served in the other order than live, the simulator having thought as long as the trace said
while the busy client sent later)."""

from __future__ import annotations

import json

import pytest

from corral.config import parse_config
from corral.sim.engine import simulate
from corral.sim.parity import at_engine_times
from corral.sim.trace import parse_trace

pytestmark = pytest.mark.unit

CONFIG = parse_config(
    "models:\n  a: {load_s: 1, service_s: 1, prefill_tok_s: 1000}\n"
    "  b: {load_s: 1, service_s: 1, prefill_tok_s: 1000}\n"
)


def test_each_closed_loop_step_thinks_as_long_as_it_did_live() -> None:
    lines = [
        {"session": "s", "t": 0.0, "model": "a", "service_s": 1.0, "context_tokens": 500},
        {"session": "s", "think_s": 0.5, "model": "b", "service_s": 1.0, "context_tokens": 400},
        {"session": "s", "think_s": 0.8, "model": "a", "service_s": 1.0, "context_tokens": 900},
        {"t": 3.0, "model": "b", "service_s": 1.0},
    ]
    trace = parse_trace([json.dumps(x) for x in lines], {"a", "b"})
    run = simulate(CONFIG, trace)  # stands for the live run
    second, third = run.requests[1], run.requests[2]
    second.arrived_at += 0.7  # the busy client sent its second step 0.7 s late
    engine = {
        str(r.line): {"prompt_n": 400.0, "prompt_ms": 400.0, "cache_n": 0.0} for r in run.requests
    }
    _, given = at_engine_times(CONFIG, run, {"engine": engine, "prompt_cache": {}})
    first_done = run.requests[0].finished_at
    assert first_done is not None
    assert second.finished_at is not None
    assert given.lines[1].think_s == pytest.approx(second.arrived_at - first_done)
    assert given.lines[1].think_s == pytest.approx(0.5 + 0.7)
    assert given.lines[2].think_s == pytest.approx(third.arrived_at - second.finished_at)
    assert given.lines[0].t == 0.0  # a loop's first step
    assert given.lines[0].think_s == 0.0
    assert given.lines[3].t == 3.0  # an open-loop line keeps its arrival
