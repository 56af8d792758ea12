"""The issue's acceptance figures on the built-in scenarios (pure simulation, deterministic).

Reproduce with `corral simulate --scenario NAME --policy all`.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import numpy as np
import pytest

from corral.config import PolicyName
from corral.sim.engine import Run, simulate
from corral.sim.metrics import summarize
from corral.sim.scenarios import get_scenario

pytestmark = pytest.mark.scenario


@cache
def run(name: str, policy: PolicyName) -> tuple[Run, dict[str, Any]]:
    sc = get_scenario(name)
    r = simulate(sc.config.with_policy(policy), sc.trace, check=True)
    return r, summarize(r)


def test_approvals_load_each_model_once_except_fifo() -> None:
    assert run("approvals", "fifo")[1]["loads"] == 20  # once per task
    for policy in ("grouped", "fifo-plus", "cost"):
        assert run("approvals", policy)[1]["loads"] == 2, policy


def test_two_batches_per_model_load_each_model_once() -> None:
    assert run("two-batches", "fifo")[1]["loads"] == 4
    for policy in ("grouped", "fifo-plus", "cost"):
        assert run("two-batches", policy)[1]["loads"] == 2, policy


def test_agents_cost_beats_fifo_and_bounds_every_wait() -> None:
    fifo, cost = run("agents", "fifo")[1], run("agents", "cost")[1]
    assert cost["loads"] <= fifo["loads"] / 3
    assert cost["makespan_s"] <= 2 / 3 * fifo["makespan_s"]
    assert cost["latency_mean_s"] <= 2 / 3 * fifo["latency_mean_s"]
    sc = get_scenario("agents")
    max_wait = sc.config.scheduler.max_wait_s
    assert max_wait is not None
    # Bound for M models (docs/design/scheduler.md): up to M-1 other turns, then our own swap.
    s = max(x.service_s for x in sc.trace.lines)
    u = max(m.unload_s for m in sc.config.models.values())
    lo = max(m.load_s for m in sc.config.models.values())
    k = sc.config.scheduler.min_visit_swaps
    m = len(sc.config.models)
    assert cost["wait_max_s"] <= max_wait + (m - 1) * (s + (1 + k) * (u + lo)) + s + u + lo


def test_poisson_fifo_plus_and_cost_cut_mean_wait_tenfold() -> None:
    fifo = run("poisson", "fifo")[1]["wait_mean_s"]
    for policy in ("fifo-plus", "cost"):
        assert run("poisson", policy)[1]["wait_mean_s"] <= fifo / 10, policy


def test_chat_beside_batch_cost_keeps_chat_fast_and_batch_nearly_unharmed() -> None:
    sc = get_scenario("chat-batch")
    r, s = run("chat-batch", "cost")
    models = sc.config.models
    chat_service = [x.service_s for x in sc.trace.lines if x.model == "chat-3b"]
    bound = (
        models["batch-8b"].unload_s + models["chat-3b"].load_s + 2 * float(np.mean(chat_service))
    )
    assert s["per_model"]["chat-3b"]["wait_p95_s"] <= bound

    batch_only = dataclasses.replace(
        sc.trace, lines=[x for x in sc.trace.lines if x.model == "batch-8b"]
    )
    exhaustive = simulate(sc.config.with_policy("fifo-plus"), batch_only, check=True)
    end_alone = max(q.finished_at or 0.0 for q in exhaustive.requests)
    end_cost = max(q.finished_at or 0.0 for q in r.requests if q.model == "batch-8b")
    two_swaps = (
        models["batch-8b"].unload_s
        + models["chat-3b"].load_s
        + models["chat-3b"].unload_s
        + models["batch-8b"].load_s
    )
    # The chat work itself must run on the same device; beyond it, at most two swaps per message.
    assert end_cost - end_alone <= len(chat_service) * two_swaps + sum(chat_service)


def test_shared_box_fair_shares_keep_light_users_waits_and_charge_the_swaps() -> None:
    """A heavy user's flood leaves the chat users' p95 waits within 1.5x of theirs without
    it (arrival order inside the class: several times), with no more loads than without fair
    shares; the agent that alternates models pays for its swaps."""
    from corral.sim.scenarios import LIGHT_USERS
    from corral.sim.trace import Trace

    sc = get_scenario("shared-box")
    fair = summarize(simulate(sc.config, sc.trace, check=True))
    off_config = sc.config.model_copy(
        update={"scheduler": sc.config.scheduler.model_copy(update={"fair_shares": False})}
    )
    off = summarize(simulate(off_config, sc.trace, check=True))
    quiet = [x for x in sc.trace.lines if x.principal != "heavy"]
    alone = summarize(simulate(sc.config, Trace(quiet, sc.trace.source), check=True))
    for who in LIGHT_USERS:
        p95 = fair["per_principal"][who]["wait_p95_s"]
        assert p95 <= 1.5 * alone["per_principal"][who]["wait_p95_s"], who
        assert off["per_principal"][who]["wait_p95_s"] > 3 * p95, who
    assert fair["loads"] <= 1.10 * off["loads"]
    agent, heavy = fair["per_principal"]["agent"], fair["per_principal"]["heavy"]
    assert agent["load_s"] > agent["service_s"]  # its alternation: most of its device time
    assert heavy["requests"] == len([x for x in sc.trace.lines if x.principal == "heavy"])
