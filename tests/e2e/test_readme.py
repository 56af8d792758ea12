"""The README's and the guides' examples, run as written: the Python blocks (the task queue;
the Batch API against `make run`'s demo gateway, with the README's own input lines), and the
configuration error shown, produced by `corral config check` on the file it describes."""

from __future__ import annotations

import json
import os
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

ROOT = Path(__file__).parents[2]
# The README and the guides it leads to: their examples are run as written.
README = "".join(
    p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
)


def blocks(language: str) -> list[str]:
    """The README's fenced blocks in `language` ("": no language), each fence opened and closed
    in order (a closing fence is not the opening of the next block)."""
    found: list[str] = []
    current: list[str] = []
    lang: str | None = None
    for line in README.splitlines(keepends=True):
        if line.startswith("```"):
            if lang is None:
                lang, current = line[3:].strip(), []
            else:
                if lang == language:
                    found.append("".join(current))
                lang = None
        elif lang is not None:
            current.append(line)
    return found


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
    demo's models say what an answer needs and stop, they do not generate 32,000
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


def test_corral_launch_opencode_starts_it_on_the_demos_models(demo: str, tmp_path: Path) -> None:
    """`corral launch opencode` against `make run`: it reads the demo's listing, writes
    OpenCode's configuration and starts `opencode` (a stand-in on PATH that records what it
    was given) with it and the arguments after `--`; `--print` shows the same, starting
    nothing; no Corral at the URL is a clear error."""
    fake = tmp_path / "bin" / "opencode"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD.args"\ncp "$OPENCODE_CONFIG" "$RECORD.json"\n'
    )
    fake.chmod(0o755)
    record = tmp_path / "record"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "RECORD": str(record),
           "XDG_DATA_HOME": str(tmp_path / "data")}  # fmt: skip
    url = f"http://{demo}"
    ran = subprocess.run(
        [CORRAL, "launch", "opencode", "--url", url, "--", "run", "fix the bug"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert record.with_suffix(".args").read_text().splitlines() == ["run", "fix the bug"]
    config = json.loads(record.with_suffix(".json").read_text())
    provider = config["provider"]["corral"]
    assert provider["options"]["baseURL"] == f"{url}/v1"
    assert sorted(provider["models"]) == ["coder-7b", "explorer-3b", "orchestrator-14b"]
    assert config["model"] == "corral/coder-7b"
    assert config["small_model"] == "corral/explorer-3b"
    printed = subprocess.run(
        [CORRAL, "launch", "opencode", "--url", url, "--print"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert printed.returncode == 0
    assert "OPENCODE_CONFIG=" in printed.stdout
    assert '"small_model": "corral/explorer-3b"' in printed.stdout
    gone = subprocess.run(
        [CORRAL, "launch", "opencode", "--url", f"http://127.0.0.1:{free_port()}"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert gone.returncode == 2
    assert "no Corral answers at" in gone.stderr


def test_the_context_example_is_a_valid_configuration() -> None:
    """The README's `models_dir:` sections read as a configuration says."""
    from corral.config import ModelsDir, parse_config

    (text,) = [b for b in blocks("yaml") if "contexts:" in b]
    config = parse_config(text, "README.md")
    assert config.models_dir == [
        ModelsDir(path="~/models"),
        ModelsDir(path="~/agents", context=65536, contexts={"qwen3-coder": 131072}),
    ]
