"""Three `corral serve` hosts, each in a network namespace of its own, behind a router that picks
as llm-d's endpoint picker does with the recipe's configuration (tests/support/epp_router.py,
deploy/epp/epp-config.yaml), against round-robin on three fresh hosts. The figures
the EPP reads are each host's own /metrics; the decisions are asserted (where each model ended
up, how many loads), not the latencies (`make bench-epp` measures those)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.epp_router import run, trace

pytestmark = pytest.mark.e2e

MODELS = ["alpha", "beta", "gamma"]


@pytest.mark.timeout(400)
def test_the_epps_scoring_sends_each_model_to_the_host_holding_it(tmp_path: Path) -> None:
    lines = trace(MODELS, 36, 1.5, seed=7)
    epp, rr = (
        run(tmp_path, mode, lines, load_s=1.0, tokens_per_s=200.0, max_tokens=40)
        for mode in ("epp", "round-robin")
    )
    assert epp["errors"] == rr["errors"] == []
    # Round-robin sends every model to every host, each one loading over the others.
    assert all(hosts == [0, 1, 2] for hosts in rr["hosts_per_model"].values())
    # The EPP's scoring settles each model on a host that holds it: a model reaches a second
    # host only while the first is busiest (a copy for load), so loads stay near one a model.
    assert epp["loads"] <= len(MODELS) + 3, epp
    assert rr["loads"] >= 2 * epp["loads"], (epp["loads"], rr["loads"])
    # After the first requests found their hosts, nearly every request went to one holding
    # its model (the routed hosts of the last two thirds: each model on at most two hosts).
    late = epp["routed"][len(lines) // 3 :]
    for m in MODELS:
        assert len({r.host for r in late if r.model == m}) <= 2, (m, epp["hosts_per_model"])
