"""`corral bench` as a real process against a live `corral serve` (sim backends): the CSV, the
manifest and the plots exist and hold sane numbers, and --tune picks a point."""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway import CORRAL, SIM, Gateway, serve

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
models:
  four:
    load_s: 0.2
    concurrency: 4
    cmd: {SIM} --load-s 0.2 --tokens-per-s 400 --parallel 4
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path_factory.mktemp("bench"), config) as g:
        yield g


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CORRAL, "bench", *args], capture_output=True, text=True, timeout=300)


def test_bench_writes_sane_figures_plots_and_a_tuned_snippet(gw: Gateway, tmp_path: Path) -> None:
    done = bench(
        gw.url, "-m", "four", "--concurrency", "1,4", "--requests", "24", "--max-tokens", "8",
        "--out", str(tmp_path), "--tune", "--p95-ms", "5000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (tmp_path / "results.csv").open() as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    one, four = rows["concurrency 1"], rows["concurrency 4"]
    for r in (one, four):
        assert (r["completed"], r["errors"]) == ("24", "0")
        # 8 tokens at 400 tokens/s: about 20 ms each, and well under a second here
        assert 15 <= float(r["e2e_p50_ms"]) < 1000
        assert float(r["ttft_p50_ms"]) <= float(r["e2e_p50_ms"])
        assert float(r["output_tokens_per_s"]) > 0
    # four slots: four in flight serve well over twice the requests per second of one
    assert float(four["requests_per_s"]) > 2 * float(one["requests_per_s"])
    for plot in ("throughput_latency.png", "latency_cdf.png"):
        assert (tmp_path / plot).stat().st_size > 5_000
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["spec"]["models"] == ["four"]
    assert manifest["server"]["models"]["data"][0]["id"] == "four"
    assert "corral_status" in manifest["server"]  # Corral's own account of the run
    assert len(manifest["points"]) == 2
    assert "best within p95 5000 ms: concurrency 4" in done.stdout
    assert "four:\n    concurrency: 4" in done.stdout


def test_bench_embeddings_at_a_rate_and_bad_options_are_clear(gw: Gateway, tmp_path: Path) -> None:
    done = bench(
        gw.url, "-m", "four", "--endpoint", "embeddings", "--rate", "40", "--requests", "20",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (tmp_path / "results.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert (row["label"], row["completed"], row["errors"]) == ("rate 40/s", "20", "0")
    bad = bench(gw.url, "-m", "four", "--concurrency", "1,x")
    assert bad.returncode == 2
    assert "--concurrency must be a comma-separated list of numbers" in bad.stderr
    both = bench(gw.url, "-m", "four", "--concurrency", "1", "--rate", "2")
    assert "give --concurrency or --rate, not both" in both.stderr
    unknown = bench(gw.url, "-m", "nope", "--requests", "2", "--out", str(tmp_path / "x"))
    assert unknown.returncode == 0  # errors are counted, not fatal
    assert "2" in next(csv.DictReader((tmp_path / "x" / "results.csv").open()))["errors"]
