"""OpenCode itself (the npm package `opencode-ai`, unchanged), run headless through `corral
launch opencode`, against `make run`'s demo. `make compat` installs it (from the npm
registry) and runs this; the run prints its figures (requests, loads, seconds), the ones
docs/benchmarks.md gives; and on a models folder, the real llama-server serving gemma-3-270m."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from compat_serve import corral_serve
from tests.support.gateway import CORRAL
from tests.support.gemma import gemma_gguf

BIN = Path(__file__).parents[1] / ".compat" / "node_modules" / ".bin"

pytestmark = [pytest.mark.timeout(900), pytest.mark.make_compat]


@pytest.fixture
def corral(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """`corral serve` (its arguments: the test's `serve_args` parameter) on a free port."""
    args: list[str] = list(request.param)
    if "GEMMA" in args:  # a models folder: the packaged gemma-3-270m on the real llama-server
        (tmp_path / "models").mkdir()
        gemma_gguf(tmp_path / "models" / "gemma-3-270m.gguf")
        args[args.index("GEMMA")] = str(tmp_path / "models")
    with corral_serve(args, tmp_path) as url:
        yield url


def run_opencode(
    url: str, tmp_path: Path, message: str, timeout_s: float = 800
) -> list[dict[str, object]]:
    """`corral launch opencode -- run --format json MESSAGE` in a fresh home; its events."""
    assert (BIN / "opencode").exists(), "OpenCode is not installed: run `make compat`"
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / "share"),
           "XDG_CONFIG_HOME": str(home / "config"), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
    done = subprocess.run(
        [CORRAL, "launch", "opencode", "--url", url, "--", "run", "--format", "json", message],
        cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def figures(url: str, began: float) -> dict[str, Any]:
    status = httpx.get(f"{url}/api/status").json()
    served = status["activity"]
    return {
        "seconds": round(time.monotonic() - began, 1),
        "requests": len(served),
        "by_model": sorted({a["model"] for a in served}),
        "statuses": sorted({a["status"] for a in served}),
        "loads": len(status["recent_swaps"]),
    }


@pytest.mark.parametrize("corral", [[]], indirect=True, ids=["make-run-demo"])
def test_opencode_completes_a_run_on_the_demo(corral: str, tmp_path: Path) -> None:
    began = time.monotonic()
    events = run_opencode(corral, tmp_path, "Explain what this project does, briefly.")
    finished = [e for e in events if e.get("type") == "step_finish"]
    assert finished
    texts = [e for e in events if e.get("type") == "text"]
    assert texts  # it answered in text
    seen = figures(corral, began)
    print("opencode on the demo:", seen)
    assert seen["statuses"] == [200]
    assert "coder-7b" in seen["by_model"]  # the main model, by `corral launch`'s roles


@pytest.mark.parametrize("corral", [[]], indirect=True, ids=["make-run-demo"])
def test_opencode_runs_its_explore_sub_agent_on_the_small_model(
    corral: str, tmp_path: Path
) -> None:
    """Asked to, OpenCode's main model calls its task tool; the explore sub-agent's session runs
    on the model `corral launch` gave it (the small one), and the run completes. (`opencode
    run` passes an `@explore` mention as plain text.)"""
    began = time.monotonic()
    ask = "List the files in this folder: call the task tool with subagent: explore"
    events = run_opencode(corral, tmp_path, ask)
    parts: list[dict[str, Any]] = [e["part"] for e in events if e.get("type") == "tool_use"]  # type: ignore[misc]
    tasks = [p for p in parts if p.get("tool") == "task"]
    seen = figures(corral, began)
    print("opencode with its explore sub-agent on the demo:", seen, len(tasks), "task calls")
    assert tasks, [e.get("type") for e in events]
    state = tasks[0]["state"]
    assert state["status"] == "completed", state
    assert state["input"]["subagent_type"] == "explore"
    assert seen["statuses"] == [200]
    assert {"coder-7b", "explorer-3b"} <= set(seen["by_model"])  # main, then the sub-agent


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "corral", [["--models", "GEMMA", "--context", "16384"]], indirect=True, ids=["models-folder"]
)
def test_opencode_completes_a_run_on_a_models_folder(corral: str, tmp_path: Path) -> None:
    """The same run on a models folder, the real llama-server serving gemma-3-270m at 16K
    (OpenCode's system prompt and tool schemas alone are ~7,000 tokens; `corral launch` gives
    it an output limit of a quarter of that: a 270M model may never stop before it, and on a
    2-core CPU 8,192 tokens at the 32K default take minutes a request)."""
    began = time.monotonic()
    events = run_opencode(corral, tmp_path, "Say hello.", timeout_s=1500)
    seen = figures(corral, began)
    print("opencode on a models folder (gemma-3-270m):", seen)
    assert [e for e in events if e.get("type") == "step_finish"]
    assert seen["statuses"] == [200]
    assert seen["by_model"] == ["gemma-3-270m"]
