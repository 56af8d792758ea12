"""The `corral` command as a user runs it: a real process, real files."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corral.backends.process import free_port
from tests.helpers import wait_http_ok

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
CONFIG = """\
models:
  a: {load_s: 4, unload_s: 1}
  b: {load_s: 12, unload_s: 2}
scheduler: {policy: cost, max_wait_s: 120}
"""


def corral(
    *args: str | Path, ok: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [CORRAL, *map(str, args)], capture_output=True, text=True, timeout=120, env=full_env
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "corral.yaml"
    config.write_text(CONFIG)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            f'{{"t": {i * 0.1:.1f}, "model": "{"ab"[i % 2]}", "service_s": 5}}\n' for i in range(20)
        )
    )
    return config, trace


def test_config_check_prints_the_resolved_config(files: tuple[Path, Path]) -> None:
    p = corral("config", "check", files[0])
    assert "is valid (2 models, 1 device, policy cost)" in p.stderr
    assert "concurrency: 1" in p.stdout  # defaults filled in
    data = json.loads(corral("config", "check", files[0], "--json").stdout)
    assert data["models"]["b"]["load_s"] == 12


def test_config_check_bad_file_names_line_and_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a:\n    laod_s: 4\nscheduler: {policy: lifo}\n")
    p = corral("config", "check", bad, ok=False)
    assert p.returncode == 2
    assert f"{bad}:3: models.a.laod_s: unknown key (allowed: load_s" in p.stderr
    assert f"{bad}:4: scheduler.policy:" in p.stderr
    assert "fifo-plus" in p.stderr


def test_simulate_json_compares_policies(files: tuple[Path, Path]) -> None:
    p = corral(
        "simulate",
        "--config",
        files[0],
        "--trace",
        files[1],
        "--policy",
        "fifo",
        "--policy",
        "cost",
        "--json",
    )
    results = {r["policy"]: r for r in json.loads(p.stdout)["results"]}
    assert set(results) == {"fifo", "cost"}
    assert results["fifo"]["loads"] == 20
    assert results["cost"]["loads"] == 2
    for key in (
        "requests",
        "makespan_s",
        "throughput_rps",
        "wait_p99_s",
        "latency_max_s",
        "busy_frac",
        "swap_frac",
        "idle_frac",
        "jain_fairness",
        "per_model",
        "lower_bound_makespan_s",
    ):
        assert key in results["cost"]
    assert results["cost"]["makespan_s"] >= results["cost"]["lower_bound_makespan_s"]


def test_simulate_defaults_to_the_configs_policy_and_prints_a_table(
    files: tuple[Path, Path],
) -> None:
    p = corral("simulate", "-c", files[0], "-t", files[1])
    assert "cost" in p.stdout
    assert "fifo" not in p.stdout
    assert "lower bound on makespan" in p.stdout


def test_simulate_prints_each_principals_waits_and_charges_where_the_trace_names_them() -> None:
    p = corral("simulate", "--scenario", "shared-box", "--policy", "cost")
    table = p.stdout[p.stdout.index("per principal") :]
    for who in ("agent", "alice", "bob", "carol", "etl", "heavy"):
        assert who in table
    assert "loads s" in table
    plain = corral("simulate", "--scenario", "approvals", "--policy", "cost")
    assert "per principal" not in plain.stdout  # no principals: no table


def test_simulate_out_writes_csv_and_plots(files: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    corral("simulate", "-c", files[0], "-t", files[1], "-p", "all", "--out", out)
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["policy"] for r in rows} == {
        "fifo",
        "grouped",
        "fifo-plus",
        "priority",
        "cost",
        "lru-route",
        "llama-swap",
    }
    assert {r["model"] for r in rows} == {"*", "a", "b"}
    for name in ("loads.png", "wait_cdf.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 5_000


def test_bad_trace_names_the_line(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"t": 0, "model": "a", "service_s": 1}\n{"t": 1, "model": "zz", "service_s": 1}\n'
    )
    p = corral("simulate", "-c", files[0], "-t", trace, ok=False)
    assert p.returncode == 2
    assert f"{trace}:2: unknown model 'zz' (the config has: a, b)" in p.stderr


def test_scenarios_list_run_and_save(tmp_path: Path) -> None:
    listed = json.loads(corral("simulate", "--list-scenarios", "--json").stdout)
    names = [s["name"] for s in listed["scenarios"]]
    assert names == [
        "approvals",
        "agents",
        "two-batches",
        "poisson",
        "chat-batch",
        "devices-4",
        "devices-8",
        "sleepers",
        "beside-batch",
        "conversations",
        "shared-box",
    ]
    p = corral(
        "simulate",
        "--scenario",
        "approvals",
        "-p",
        "fifo",
        "-p",
        "grouped",
        "--json",
        "--save-scenario",
        tmp_path / "sc",
    )
    loads = {r["policy"]: r["loads"] for r in json.loads(p.stdout)["results"]}
    assert loads == {"fifo": 20, "grouped": 2}
    # The saved files replay to the same figures.
    again = corral(
        "simulate",
        "-c",
        tmp_path / "sc" / "config.yaml",
        "-t",
        tmp_path / "sc" / "trace.jsonl",
        "-p",
        "fifo",
        "-p",
        "grouped",
        "--json",
    )
    assert json.loads(again.stdout) == json.loads(p.stdout)


def test_unknown_scenario_and_policy_are_clear_errors() -> None:
    p = corral("simulate", "--scenario", "nope", ok=False)
    assert p.returncode == 2
    assert "choose one of: approvals, agents" in p.stderr
    p = corral("simulate", "--scenario", "agents", "--policy", "lifo", ok=False)
    assert p.returncode == 2
    assert "unknown policy 'lifo'" in p.stderr


def test_light_entry_points_do_not_load_the_heavy_parts() -> None:
    """`corral sim-backend` starts once per simulated swap: the CLI and the sim server must not
    import pydantic (the config), numpy (the simulator) or the worker until a command needs them."""
    probe = (
        "import sys, corral.cli, corral.bundled.sim_server; "
        "print(sorted(m for m in ('pydantic', 'numpy', 'matplotlib', 'corral.config', "
        "'corral.worker', 'corral.queue') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_serve_refuses_a_config_with_nothing_to_serve_and_check_says_so() -> None:
    example = Path(__file__).parents[2] / "examples" / "corral.yaml"
    r = corral("serve", "--config", example, "--listen", "127.0.0.1:1", ok=False)
    assert r.returncode == 2
    assert "nothing to serve (cover-writer, research-8b)" in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr
    r = corral("config", "check", example)
    assert r.returncode == 0
    assert "`corral serve` will not serve cover-writer, research-8b" in " ".join(r.stderr.split())


def test_serve_reports_llama_swap_keys_it_ignores_at_start(tmp_path: Path) -> None:
    config = tmp_path / "ls.yaml"
    config.write_text(
        "logLevel: debug\nprofiles: {}\nmodels:\n  m:\n    cmd: server --port ${PORT}\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "ignored  logLevel: Corral logs at INFO" in err
    assert "ignored  profiles: not supported" in err
