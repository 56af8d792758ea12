"""Residency tiers over random configurations and traces (hypothesis): with models
that sleep, pins and minimum residency, every request still finishes, and the simulator's own
books (`check=True`) never see host memory overcommitted, a device over capacity, a wake of a
model not asleep there, or an eviction of a model with work in flight."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.config import Config
from corral.core import Lifecycle
from corral.sim.engine import Simulation
from corral.sim.trace import Trace
from tests.support.properties import SETTINGS, configs, traces

pytestmark = pytest.mark.property


@st.composite
def sleepy(draw: st.DrawFn) -> tuple[Config, Trace]:
    base = draw(configs())
    models = {}
    for name, m in base.models.items():
        update: dict[str, object] = {}
        if draw(st.booleans()):
            sleep = {
                "level": draw(st.sampled_from([1, 2])),
                "wake_s": draw(st.floats(0, 3)),
                "sleep_s": draw(st.floats(0, 2)),
            }
            update["sleep"] = m.model_validate({**m.model_dump(), "sleep": sleep}).sleep
        update["min_resident_s"] = draw(st.sampled_from([0.0, 0.0, 5.0, 40.0]))
        models[name] = m.model_copy(update=update)
    host = draw(st.sampled_from([None, 0.0, 4.0, 8.0, 16.0]))
    config = base.model_copy(
        update={
            "models": models,
            "host": base.host.model_copy(update={"memory_gb": host or None}),
            "scheduler": base.scheduler.model_copy(
                update={"sleepers": draw(st.sampled_from(["predicted", "lru"]))}
            ),
        }
    )
    return config, draw(traces(config))


@SETTINGS
@given(sleepy())
def test_sleeping_models_never_break_the_books_and_every_request_finishes(
    case: tuple[Config, Trace],
) -> None:
    config, trace = case
    sim = Simulation(config, trace, check=True)
    run = sim.run()  # check=True: fails on any broken invariant and on a request left behind
    assert len(run.requests) == len(trace.lines)
    limit = config.host.memory_gb
    asleep = [m for m in sim.scheduler.models.values() if m.state is Lifecycle.SLEEPING]
    if limit is not None:
        assert sum(m.held_gb for m in asleep) <= limit + 1e-9  # none at level 2 (deep)
    assert all(m.spec.sleep is not None for m in asleep)
    woken = sum(run.wakes.values())
    assert woken <= sum(run.loads.values())
