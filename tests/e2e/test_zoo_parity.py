"""The simulator's live parity on the zoo's files: the conversations scenario over two
architectures on real llama-servers through `corral serve`, one whose prompt caches are kept
(qwen3: its restores are honoured) and one whose are not (qwen35, a Gated-DeltaNet hybrid: it
takes the state and processes the prompt again), against the simulator given the figures the
servers measured (`corral.sim.parity.at_engine_times`). The loads, the tokens prefilled (what the
swaps threw away, what the restores kept) and the p95 wait must agree: the same decisions."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from corral.sim.parity import simulated_beside
from corral.sim.replay import replay
from corral.zoo.scenario import KEPT, NOT_KEPT, conversations

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_the_simulator_decides_as_real_servers_on_a_kept_and_a_not_kept_architecture(
    tmp_path: Path,
) -> None:
    sc = conversations(tmp_path / "zoo")
    run, live = replay(sc.config, sc.trace, 1.0, own_backends=True)
    assert live["requests"] == len(sc.trace.lines)
    assert live["rejected"] == 0
    assert live["prompt_cache"][KEPT] == "kept and verified"
    assert live["prompt_cache"][NOT_KEPT].startswith("not kept: its server restored")
    # The kept one came back with what it held: its one slot holds the conversation it served
    # last, in the same residency or saved at the swap and restored, so a step whose loop was
    # the last served there reuses it (which loop that is, the timing decides). The other
    # never reused anything.
    engine = {int(k): v for k, v in live["engine"].items()}
    when = {
        x.line: r.dispatched_at or 0.0 for x, r in zip(sc.trace.lines, run.requests, strict=True)
    }
    served = sorted((x for x in sc.trace.lines if x.model == KEPT), key=lambda x: when[x.line])
    followed = [x for prev, x in itertools.pairwise(served) if prev.session == x.session]
    assert all(engine[x.line]["cache_n"] > 1000 for x in followed), [
        (x.line, engine[x.line]) for x in followed
    ]
    assert any(engine[x.line]["cache_n"] > 1000 for x in served)
    assert all(engine[x.line]["cache_n"] < 64 for x in sc.trace.lines if x.model == NOT_KEPT)

    _, diffs = simulated_beside(sc.config, run, live)
    report = "\n".join(
        f"  {d.figure}: simulated {d.simulated:.2f} ({d.low:.2f} to {d.high:.2f}), "
        f"live {d.live:.2f} (±{d.tolerance:.2f})"
        for d in diffs
    )
    assert {d.figure for d in diffs} == {"loads", "prefill tokens", "interactive wait p95 s"}
    assert all(d.ok for d in diffs), f"the zoo's conversations diverge:\n{report}"

    # The parity can fail: a simulator that believed the hybrid's restores would prefill far
    # fewer tokens than its server did.
    believed = {**live, "prompt_cache": {}}
    _, wrong = simulated_beside(sc.config, run, believed)
    prefill = next(d for d in wrong if d.figure == "prefill tokens")
    assert not prefill.ok, prefill
    assert prefill.simulated < prefill.live


SHARED = ("qwen3", "gpt-oss")  # dense, and sliding-window (run with --swa-full)


def test_models_agents_share_keep_every_restore_and_the_simulator_prices_them_alike(
    tmp_path: Path,
) -> None:
    """Two agent loops share each model's server (2 slots): every swap brings both of its
    conversations back. Every restore is reused on both architectures, none blamed on
    anything, and the simulator, which brings back every saved conversation, prefills what
    the servers did; told the caches were not kept, it prefills far more."""
    sc = conversations(tmp_path / "zoo", SHARED, loops=2, steps=6, parallel=2)
    run, live = replay(sc.config, sc.trace, 1.0, own_backends=True)
    assert live["requests"] == len(sc.trace.lines)
    assert live["rejected"] == 0
    for arch in SHARED:
        restores = live["restores"][arch]
        assert restores["restores"] >= 2, (arch, restores)
        assert restores["honoured"] == restores["restores"], (arch, restores)
        assert restores["not_honoured"] == 0, (arch, restores)
        assert live["prompt_cache"][arch] == "kept and verified"
    _, diffs = simulated_beside(sc.config, run, live)
    prefill = next(d for d in diffs if d.figure == "prefill tokens")
    loads = next(d for d in diffs if d.figure == "loads")
    assert prefill.ok, prefill
    assert loads.ok, loads
    believed = {**live, "prompt_cache": dict.fromkeys(SHARED, "not kept: told so")}
    _, wrong = simulated_beside(sc.config, run, believed)
    told = next(d for d in wrong if d.figure == "prefill tokens")
    assert not told.ok, told
    assert told.simulated > told.live


def test_replay_cli_runs_the_models_own_servers_and_compares(tmp_path: Path) -> None:
    sc = conversations(tmp_path / "zoo", loops=1, steps=4)
    config, trace = tmp_path / "corral.yaml", tmp_path / "trace.jsonl"
    spec = sc.config.model_dump(mode="json", by_alias=True, exclude_none=True)
    config.write_text(yaml.safe_dump(spec))
    sc.trace.write(trace)
    args = [sys.executable, "-m", "corral", "replay", "--config", str(config)]
    args += ["--trace", str(trace), "--own-servers", "--compare", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    data = json.loads(out.stdout)
    live, simulated = data["results"]
    assert (live["mode"], simulated["mode"]) == ("live", "simulated")
    assert len(live["engine"]) == len(sc.trace.lines)  # every answer's own timings
    assert live["prompt_cache"][KEPT] == "kept and verified"
    assert {p["figure"] for p in data["parity"]} == {
        "loads",
        "prefill tokens",
        "interactive wait p95 s",
    }
    # What the scheduler decided must agree: the loads and what the swaps threw away. The
    # wait p95 of four steps at 1x on real servers is the machine's timing: a loaded clean
    # clone (two `yes` beside the suite) read 1.48 s live against 0.97 s simulated with the
    # same 4 loads, past the 0.25 s floor, on this commit and on the one before the session
    # that found it; it is reported, and the CLI's own comparison shows it, but not asserted.
    decided = [p for p in data["parity"] if p["figure"] != "interactive wait p95 s"]
    assert all(p["ok"] for p in decided), data["parity"]
    (wait,) = [p for p in data["parity"] if p["figure"] == "interactive wait p95 s"]
    assert wait["live"] > 0, wait
    assert wait["simulated"] > 0, wait

    # Real servers run at their own speed: a faster replay is refused, with the reason.
    fast = subprocess.run([*args, "--speed", "5"], capture_output=True, text=True, timeout=60)
    assert fast.returncode != 0
    assert "a replay on the models' own servers runs at 1x, not 5x" in fast.stderr
