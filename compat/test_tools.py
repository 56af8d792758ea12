"""The agent frameworks people run, each unchanged, against `make run`'s demo: the
OpenAI Agents SDK (a handoff between models, with a tool), pydantic-ai (a tool and structured
output), smolagents (a tool-calling agent), the `llm` CLI with llm-ollama (Ollama's door, with a
tool), aider (a main and a weak model, through `corral launch aider`) and LangChain's own
standard integration tests for ChatOpenAI and ChatOllama. `make compat` installs them from the
package registry into venvs of their own (.compat/) and runs this; each test prints its figures
(requests, loads, seconds), the ones docs/benchmarks.md gives."""

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

ROOT = Path(__file__).parents[1]
VENV = ROOT / ".compat" / "venv" / "bin"
AIDER = ROOT / ".compat" / "aider" / "bin"
FLOWS = Path(__file__).parent / "flows"

pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`make run`'s demo: `corral serve` with no configuration, on a free port."""
    with corral_serve([], tmp_path_factory.mktemp("demo")) as url:
        yield url


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`corral serve --models DIR` on the real llama-server: two gemma-3-270m models (one file
    under two names), on a free port."""
    home = tmp_path_factory.mktemp("folder")
    models = home / "models"
    models.mkdir()
    gemma_gguf(models / "gemma-a.gguf")
    os.link(models / "gemma-a.gguf", models / "gemma-b.gguf")
    with corral_serve(["--models", str(models)], home) as url:
        yield url


class Figures:
    """Requests (by model and status), loads and seconds from a start to now, from Corral's
    Prometheus counters."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.began = time.monotonic()
        self.start = counters(url)

    def now(self) -> dict[str, Any]:
        end = counters(self.url)
        new = {k: v - self.start.get(k, 0.0) for k, v in end.items()}
        requests = {k[1:]: v for k, v in new.items() if k[0] == "requests" and v > 0}
        return {
            "seconds": round(time.monotonic() - self.began, 1),
            "requests": int(sum(requests.values())),
            "loads": int(sum(v for k, v in new.items() if k[0] == "swaps")),
            "models": sorted({model for model, _ in requests}),
            "statuses": sorted({int(status) for _, status in requests}),
        }


def counters(url: str) -> dict[tuple[str, ...], float]:
    """`corral_requests_total` by (model, status) and `corral_swaps_total` by model."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == "corral_requests_total":
                out["requests", s.labels["model"], s.labels["status"]] = s.value
            elif s.name == "corral_swaps_total":
                out["swaps", s.labels["model"]] = s.value
    return out


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    both: bool = False,
    timeout_s: float = 600,
) -> str:
    """`argv`'s stdout (`both`: and its stderr after it), once it exited 0."""
    assert Path(argv[0]).exists(), f"{argv[0]} is not installed: run `make compat`"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout + done.stderr if both else done.stdout


def flow(name: str, *args: str) -> dict[str, Any]:
    out = run([str(VENV / "python"), str(FLOWS / name), *args])
    last: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return last


def test_the_agents_sdk_hands_off_between_two_models_and_calls_a_tool(demo: str) -> None:
    seen = Figures(demo)
    out = flow("agents_sdk.py", demo, "orchestrator", "coder")
    figures = seen.now()
    print("agents sdk on the demo:", out, figures)
    assert out["last_agent"] == "Weather agent"  # the handoff happened
    assert out["tool_calls"] == 1
    assert out["final"]
    assert figures["models"] == ["coder-7b", "orchestrator-14b"]
    assert figures["statuses"] == [200]


def test_pydantic_ai_calls_its_tool_and_returns_structured_output(demo: str) -> None:
    seen = Figures(demo)
    out = flow("pydantic_ai_flow.py", demo, "coder")
    figures = seen.now()
    print("pydantic-ai on the demo:", out, figures)
    assert out["tool_calls"] == 1
    assert set(out["output"]) == {"city", "summary", "temperature_c"}
    assert figures["statuses"] == [200]


def test_smolagents_runs_its_tool_calling_loop_to_a_final_answer(demo: str) -> None:
    seen = Figures(demo)
    out = flow("smolagents_flow.py", demo, "explorer")
    figures = seen.now()
    print("smolagents on the demo:", out, figures)
    assert out["tool_calls"] == 1
    assert out["answer"]
    assert figures["statuses"] == [200]


def test_the_llm_cli_lists_and_prompts_through_ollamas_door_with_a_tool(
    demo: str, tmp_path: Path
) -> None:
    env = {"OLLAMA_HOST": demo, "LLM_USER_PATH": str(tmp_path / "llm")}
    llm = str(VENV / "llm")
    listed = run([llm, "models", "list"], env)
    assert "ollama/coder-7b:latest" in listed  # llm-ollama lists Corral's models
    seen = Figures(demo)
    answer = run([llm, "-m", "ollama/coder-7b", "Say hello."], env)
    tool = "def get_weather(city: str) -> str:\n    return f'sunny in {city}'\n"
    with_tool = run([llm, "-m", "ollama/coder-7b", "--functions", tool, "--td",
                     "What is the weather in Paris?"], env, both=True)  # fmt: skip
    figures = seen.now()
    print("llm + llm-ollama on the demo:", figures)
    assert answer.strip()
    assert "Tool call: get_weather(" in with_tool  # --td shows the call (on stderr)
    assert figures["statuses"] == [200]
    assert figures["requests"] >= 3  # a prompt, a call, its answer


@pytest.mark.make_compat
def test_aider_asks_its_main_model_and_commits_with_its_weak_model(
    demo: str, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text("print('hello')\n")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "start"]):
        subprocess.run([*git, *argv], check=True)
    env = {"HOME": str(tmp_path / "home"), "PATH": f"{AIDER}:{os.environ['PATH']}"}
    aider = [CORRAL, "launch", "aider", "--url", demo, "--", "--yes-always", "--no-check-update",
             "--no-show-release-notes", "--no-pretty", "--no-auto-lint"]  # fmt: skip
    seen = Figures(demo)
    out = run([*aider, "--message", "Add a comment to hello.py", "hello.py"], env, work)
    asked = seen.now()
    (work / "hello.py").write_text("# says hello\nprint('hello')\n")
    seen = Figures(demo)
    run([*aider, "--commit"], env, work)  # the weak model writes the commit message
    committed = seen.now()
    print("aider on the demo: message", asked, "commit", committed)
    assert "token limit" not in out  # the demo answers and stops (it once ran to the cap)
    assert asked["models"] == ["coder-7b"]  # the main model, by `corral launch`'s roles
    assert committed["models"] == ["explorer-3b"]  # the weak one
    assert asked["statuses"] == committed["statuses"] == [200]
    log = subprocess.run([*git, "log", "--format=%s"], capture_output=True, text=True).stdout
    assert len(log.splitlines()) == 2  # aider committed the change


@pytest.mark.parametrize("door", ["TestCorralChatOpenAI", "TestCorralChatOllama"])
def test_langchains_standard_integration_tests_pass(demo: str, door: str) -> None:
    seen = Figures(demo)
    here = Path(__file__).parent / "langchain_standard"
    done = subprocess.run(
        [str(VENV / "python"), "-m", "pytest", "-q", "-c", str(here / "pytest.ini"),
         "--rootdir", str(here), f"{here / 'test_standard.py'}::{door}"],
        capture_output=True, text=True, timeout=800,
        env={**os.environ, "CORRAL_URL": demo, "CORRAL_MODEL": "coder"},
    )  # fmt: skip
    figures = seen.now()
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    print(f"langchain standard tests, {door}, on the demo:", summary, figures)
    assert done.returncode == 0, done.stdout[-6000:]


# On the real llama-server, gemma-3-270m: each flow must complete with every answer a 200 (what
# the model does inside it is the model's: a 270M model rarely hands off and may loop until the
# tool's step limit). Each gets a cap on answers (passed through the tool's own settings): the
# model may never stop on its own, and the tools send no max_tokens.
REAL_FLOWS = [
    ("agents_sdk.py", ["gemma-a", "gemma-b", "256"]),
    ("pydantic_ai_flow.py", ["gemma-a", "512"]),
    ("smolagents_flow.py", ["gemma-b", "128"]),
]


@pytest.mark.make_compat
@pytest.mark.parametrize(("script", "args"), REAL_FLOWS, ids=[f for f, _ in REAL_FLOWS])
def test_each_framework_completes_on_the_real_llama_server(
    folder: str, script: str, args: list[str]
) -> None:
    seen = Figures(folder)
    out = flow(script, folder, *args)
    figures = seen.now()
    print(f"{script} on gemma-3-270m:", out, figures)
    assert figures["statuses"] == [200]
    assert figures["requests"] >= 1


@pytest.mark.make_compat
def test_the_llm_cli_completes_on_the_real_llama_server(folder: str, tmp_path: Path) -> None:
    env = {"OLLAMA_HOST": folder, "LLM_USER_PATH": str(tmp_path / "llm")}
    seen = Figures(folder)
    answer = run([str(VENV / "llm"), "-m", "ollama/gemma-a", "-o", "num_predict", "32",
                  "What is the capital of France?"], env)  # fmt: skip
    figures = seen.now()
    print("llm on gemma-3-270m:", answer.strip()[:200], figures)
    assert answer.strip()  # what it says is the 270M base model's own ("What is the capital...")
    assert figures["statuses"] == [200]


@pytest.mark.make_compat
def test_aider_completes_on_the_real_llama_server(folder: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text("print('hello')\n")
    env = {"HOME": str(tmp_path / "home"), "PATH": f"{AIDER}:{os.environ['PATH']}"}
    seen = Figures(folder)
    run([CORRAL, "launch", "aider", "--url", folder, "--", "--yes-always", "--no-git",
         "--no-check-update", "--no-show-release-notes", "--no-pretty", "--no-auto-lint",
         "--message", "Add a comment to hello.py", "hello.py"], env, work,
        timeout_s=1500)  # fmt: skip
    figures = seen.now()
    print("aider on gemma-3-270m:", figures)
    assert figures["statuses"] == [200]
    assert figures["requests"] >= 1


@pytest.mark.make_compat
def test_langchains_standard_tests_on_the_real_llama_server_fail_only_on_the_model(
    folder: str,
) -> None:
    """LangChain's standard tests through Ollama's door on gemma-3-270m (its answers capped:
    the model may never stop): Corral answers every request 200 with the server's answer; the
    failures, listed, are the model's (docs/benchmarks.md explains each kind)."""
    seen = Figures(folder)
    here = Path(__file__).parent / "langchain_standard"
    done = subprocess.run(
        [str(VENV / "python"), "-m", "pytest", "-q", "-rf", "--tb=no", "-c",
         str(here / "pytest.ini"), "--rootdir", str(here),
         f"{here / 'test_standard.py'}::TestCorralChatOllama"],
        capture_output=True, text=True, timeout=3000,
        env={**os.environ, "CORRAL_URL": folder, "CORRAL_MODEL": "gemma-a",
             "CORRAL_MAX_TOKENS": "128", "COLUMNS": "400"},  # each failure's reason, whole
    )  # fmt: skip
    figures = seen.now()
    failed = [x for x in done.stdout.splitlines() if x.startswith("FAILED")]
    print("langchain standard tests, ChatOllama, on gemma-3-270m:",
          done.stdout.strip().splitlines()[-1], figures, *failed, sep="\n")  # fmt: skip
    assert figures["statuses"] == [200]
