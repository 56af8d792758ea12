from __future__ import annotations

import numpy as np
import pytest

from corral.config import parse_config
from corral.sim.engine import simulate
from corral.sim.metrics import jain, lower_bound_makespan_s, summarize
from corral.sim.trace import parse_trace

CONFIG = parse_config(
    "models:\n  a: {load_s: 4, unload_s: 1}\n  b: {load_s: 12, unload_s: 2}\n"
    "scheduler: {policy: grouped}\n"
)


def test_jain() -> None:
    assert jain(np.array([2.0, 2.0, 2.0])) == pytest.approx(1.0)
    assert jain(np.array([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)


def test_lower_bound_all_at_zero_is_work_plus_every_load() -> None:
    tr = parse_trace([f'{{"t": 0, "model": "{m}", "service_s": 5}}' for m in "abab"], "ab")
    assert lower_bound_makespan_s(CONFIG, tr) == pytest.approx(20 + 4 + 12)


def test_lower_bound_late_release_credits_one_resident_model() -> None:
    tr = parse_trace(
        [
            '{"t": 0, "model": "a", "service_s": 1}',
            '{"t": 100, "model": "b", "service_s": 5}',
            '{"t": 100, "model": "a", "service_s": 5}',
        ],
        "ab",
    )
    # At t=100: 10 s of work + loads 4 + 12, minus the largest (b may already be resident).
    assert lower_bound_makespan_s(CONFIG, tr) == pytest.approx(100 + 10 + 4)


def test_summary_of_a_known_schedule() -> None:
    tr = parse_trace([f'{{"t": 0, "model": "{m}", "service_s": 5}}' for m in "abab"], "ab")
    s = summarize(simulate(CONFIG, tr, check=True))
    # grouped: load a (4), a, a (10), unload a + load b (13), b, b (10) = 37 s.
    assert s["loads"] == 2
    assert s["makespan_s"] == pytest.approx(37)
    assert s["swap_frac"] == pytest.approx(17 / 37)
    assert s["busy_frac"] == pytest.approx(20 / 37)
    assert s["wait_max_s"] == pytest.approx(32)  # b's second request
    assert s["per_model"]["a"]["wait_mean_s"] == pytest.approx((4 + 9) / 2)
    assert s["per_model"]["a"]["makespan_s"] == pytest.approx(14)
    assert s["per_model"]["b"]["makespan_s"] == pytest.approx(37)
    assert s["per_model"]["b"]["throughput_rps"] == pytest.approx(2 / 37)
    assert s["lower_bound_makespan_s"] == pytest.approx(36)
    assert s["lower_bound_makespan_s"] <= s["makespan_s"]
