"""The README's examples, run as written: the Python blocks (the task queue; the Batch API
against `make run`'s demo gateway, with the README's own input lines), and the configuration
error it shows, produced by `corral config check` on the file it describes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.process import free_port
from corral.config import parse_config
from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL

pytestmark = pytest.mark.e2e

README = (Path(__file__).parents[2] / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, flags=re.S | re.M)


def python_block(marker: str) -> str:
    (code,) = [b for b in blocks("python") if marker in b]
    return code


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_task_queue_example_runs_as_written(tmp_path: Path) -> None:
    done = run_python(python_block("corral.Queue("), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Dear ACME ..."
    assert (tmp_path / "tasks.db").exists()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`make run`'s gateway (the built-in demo) on a free port."""
    folder = tmp_path_factory.mktemp("readme")
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "serve", "--listen", f"127.0.0.1:{port}"],
        env={**os.environ, "XDG_DATA_HOME": str(folder / "data")},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_batch_api_example_runs_on_the_demo_with_the_readmes_input_lines(
    demo: str, tmp_path: Path
) -> None:
    (lines,) = blocks("jsonl")
    (tmp_path / "jobs.jsonl").write_text(lines)
    code = python_block("client.batches.create").replace("127.0.0.1:8080", demo)
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith("completed BatchRequestCounts(completed=2, failed=0, total=2")
    assert '"custom_id": "q1"' in done.stdout
    assert '"custom_id": "q2"' in done.stdout


def test_the_configuration_error_shown_is_the_one_corral_prints(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("models:\n  a:\n    laod_s: 3\nscheduler:\n  policy: lifo\n")
    done = subprocess.run(
        [CORRAL, "config", "check", "bad.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    (shown,) = [b for b in blocks("") if b.startswith("error: invalid configuration")]
    assert done.stderr.split() == shown.split()  # the same words (the terminal may wrap lines)


def test_the_sleeping_models_example_is_a_valid_configuration() -> None:
    (text,) = [b for b in blocks("yaml") if "sleep:" in b]
    config = parse_config(text, "README.md")
    nap = config.models["qwen-7b"].sleep
    assert nap is not None
    assert (nap.level, nap.wake_s, nap.api) == (1, 2, "vllm")
    assert config.host.memory_gb == 96


def test_the_demo_answers_an_agents_32000_token_requests_like_a_model(demo: str) -> None:
    """OpenCode's title (explorer) and main request (coder) each ask `max_tokens: 32000`: the
    demo's models say what an answer needs and stop (issue 48), they do not generate 32,000
    tokens (six minutes at the explorer's speed) with `finish_reason: length`."""
    import openai

    c = openai.OpenAI(base_url=f"http://{demo}/v1", api_key="unused", timeout=120)
    for model in ("explorer", "coder"):
        r = c.chat.completions.create(
            model=model,
            max_tokens=32000,
            messages=[
                {"role": "system", "content": "You are opencode, an interactive CLI tool."},
                {"role": "user", "content": "Generate a title for this conversation: fix the bug"},
            ],
        )
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None
        assert 0 < r.usage.completion_tokens <= 200
