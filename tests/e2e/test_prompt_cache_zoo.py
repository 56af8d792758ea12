"""Prompt caches verified per architecture, through `corral serve` on real
llama-server processes with the zoo's files, one model resident at a time: after a swap, a
conversation comes back restored, and the server's own figures for that request
(`timings.cache_n`) say whether it reused what was restored. A dense model does (kept and
verified); a hybrid one (Gated DeltaNet, Qwen3.5's shape) takes the state and processes the
prompt again, since its recurrent state cannot be rolled back past the answer it generated:
its prompt caches are then not kept, said once with why, nothing more is saved for it, and
/api/status and /metrics say so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.modelfiles.folder import find_llama_server
from corral.prompt_cache.caches import PROBE_FIRST_STARTS
from corral.zoo import make
from tests.e2e.test_prompt_cache import index, serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SYSTEM = "You are a terse assistant. " + "The sky is blue because of Rayleigh scattering. " * 8


def config(zoo: Path, states: Path) -> str:
    server = find_llama_server()
    flags = "--port ${PORT} --ctx-size 4096 --parallel 2 --jinja"
    lines = ["devices: [{name: cpu}]  # one model at a time: every switch is a swap",
             f"prompt_cache: {{dir: {states}, max_gb: 1, min_tokens: 64}}", "models:"]  # fmt: skip
    for name, arch in (("dense", "qwen3"), ("hybrid", "qwen35"), ("other", "gemma3")):
        lines.append(f'  {name}: {{cmd: "{server} -m {zoo / f"{arch}-tiny.gguf"} {flags}", '
                     "load_s: 1, health_timeout_s: 120}")  # fmt: skip
    return "\n".join(lines) + "\n"


def conversation(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("zoo")
    for arch in ("qwen3", "qwen35", "gemma3"):
        make(arch, folder)
    return folder


def test_a_restore_is_verified_by_the_servers_own_figures(zoo: Path, tmp_path: Path) -> None:
    states = tmp_path / "states"
    with serving(tmp_path, config(zoo, states)) as g:
        asked = conversation("Why is the sky blue?")
        for model in ("dense", "hybrid"):
            first = g.chat(model, asked, max_tokens=16)  # the slot holds the answer too
            g.chat("other", conversation("Name a colour."))  # a swap: the slot is saved
            assert [s["model"] for s in index(states)].count(model) == 1
            back = g.chat(model, asked)  # restored, then the same prompt: a regenerate
            prompt = first["usage"]["prompt_tokens"]
            view = g.cache(model)
            assert view["restores"] == 1
            if model == "dense":  # the latent cache is cut back to the prompt: reused
                assert back["timings"]["cache_n"] >= prompt // 2
                assert view["verified"] == "kept and verified"
                assert (view["honoured"], view["not_honoured"]) == (1, 0)
            else:  # the recurrent state cannot be: the server processed it all again
                assert back["timings"]["cache_n"] == 0
                assert back["timings"]["prompt_n"] == prompt
                assert view["verified"].startswith("not kept: its server restored")
                assert (view["honoured"], view["not_honoured"]) == (0, 1)
                assert view["not_honoured_model_state"] == 1  # its file says why (blame.py)
        # Not kept: nothing more is saved for the hybrid, the dense one goes on saving.
        g.chat("hybrid", conversation("Another question, long enough to be worth saving?"))
        g.chat("other", conversation("Name a colour."))
        assert g.cache("hybrid")["saves"] == 1
        metrics = httpx.get(f"{g.url}/metrics").text
        assert 'corral_prompt_cache_restores_not_honoured_total{model="hybrid"} 1.0' in metrics
        assert 'corral_prompt_cache_restores_not_honoured_total{model="dense"} 0.0' in metrics
        assert (
            'corral_prompt_cache_restores_not_honoured_by_cause_total{cause="model_state",'
            'model="hybrid"} 1.0'
        ) in metrics
        said = [
            line for line in g.logged().splitlines() if "not kept across swaps from now" in line
        ]
        assert len(said) == 1
        assert "model hybrid" in said[0]
    # Corral starts again: the verdict on that server (its file and flags) holds from its start.
    with serving(tmp_path / "again", config(zoo, states)) as g:
        g.chat("hybrid", conversation("Why is the sky blue?"))
        view = g.cache("hybrid")
        assert view["verified"].startswith("not kept: its server restored")
        assert "found in an earlier run" in view["verified"]
        assert view["restores"] == 0  # nothing restored for it: its state is no use
        assert g.cache("dense")["verified"] == "kept"  # verified afresh when it comes back


def test_a_verdict_from_an_earlier_run_is_probed_and_a_reused_restore_lifts_it(
    zoo: Path, tmp_path: Path
) -> None:
    """A dense model recorded as not kept (as if an earlier run had blamed it): its restores
    are tried again on its fourth server's start, on the real server, and the restore it
    reuses brings its prompt caches back, the recorded verdict forgotten."""
    states = tmp_path / "states"
    asked = conversation("Why is the sky blue?")
    with serving(tmp_path / "first", config(zoo, states)) as g:
        g.chat("dense", asked)
        g.chat("other", conversation("Name a colour."))  # a swap: its conversation is saved
    made_by = {s["fingerprint"] for s in index(states) if s["model"] == "dense"}
    assert len(made_by) == 1
    recorded = {f: {"model": "dense", "why": "blamed earlier", "at": 1.0, "cause": "model_state"}
                for f in made_by}  # fmt: skip
    (states / "verdicts.json").write_text(json.dumps(recorded))
    with serving(tmp_path / "again", config(zoo, states)) as g:
        seen = []
        for _ in range(PROBE_FIRST_STARTS + 1):  # each start of dense's server counts
            back = g.chat("dense", asked)
            seen.append(g.cache("dense")["verified"])
            g.chat("other", conversation("Name a colour."))
        probe = PROBE_FIRST_STARTS - 1  # the probe's server restores the saved state: reused
        assert all(v.startswith("not kept: blamed earlier") for v in seen[:probe]), seen
        assert all(v == "kept and verified" for v in seen[probe:]), seen
        assert back["timings"]["cache_n"] >= back["usage"]["prompt_tokens"] // 2
        assert "prompt caches kept again" in g.logged()
    assert json.loads((states / "verdicts.json").read_text()) == {}
