"""Loads priced by the page cache, live: `corral serve --models DIR` over two zoo
files on the real llama-server. A file dropped from the page cache loads cold: the scheduler
hears how much was cached when the load began, learns its cold figure from it, and prices the
next load, with the file cached, by its warm figure."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.modelfiles.folder import find_llama_server
from corral.modelfiles.mincore import cached, drop
from corral.zoo import make_zoo
from tests.e2e.test_models_folder import serving
from tests.support.gateway import Gateway, serve, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, list[Path]]:
    if find_llama_server() is None:
        pytest.fail("llama-server is not installed: `make .venv/.installed-embed`")
    folder = tmp_path / "zoo"
    folder.mkdir()
    made = make_zoo(folder, ["qwen3", "gemma3"])
    files = [z.path for z in made]
    os.sync()  # written pages are dirty until written back; only clean ones can be dropped
    return folder, files


def model(g: Gateway, name: str) -> dict[str, Any]:
    return dict(g.status()["models"][name])


def chat(g: Gateway, name: str) -> None:
    out = g.client(max_retries=0, timeout=120).chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert out.usage is not None
    assert out.usage.completion_tokens >= 1


def test_a_cold_file_is_measured_learned_and_the_next_load_priced_warm(
    two_files: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    folder, files = two_files
    gen = serving(["--models", str(folder)], tmp_path)
    g, _ = next(gen)
    try:
        names = sorted(g.status()["models"])
        assert len(names) == 2
        first = next(n for n in names if n.startswith("qwen3"))
        other = next(n for n in names if n != first)
        # Reading a folder reads each file's header (of a tiny file, most of it: its
        # vocabulary). Then other work pushes them out of the page cache, as a user meets it.
        wait_for(lambda: model(g, other)["file_cached"] is not None, 10)
        drop(files)
        got = [cached([f]) for f in files]
        assert all(x is not None and x < 0.5 for x in got), got
        wait_for(lambda: model(g, first)["file_cached"] < 0.5, 10)  # measured every 2 s
        assert model(g, other)["file_cached"] < 0.5
        assert model(g, first)["cold_load_s_estimate"] is None  # no cold load seen yet
        chat(g, first)
        swap = g.status()["recent_swaps"][-1]
        assert swap["model"] == first
        assert swap["file_cached"] is not None
        assert swap["file_cached"] < 0.5
        m = model(g, first)
        assert m["cold_load_s_estimate"] is not None  # learned from that load
        # Read in by the load: measured again at once (and at most every 2 s).
        wait_for(lambda: model(g, first)["file_cached"] > 0.9, 10)
        assert model(g, other)["file_cached"] < 0.5  # never read
        warm_before = model(g, first)["warm_load_s_estimate"]
        r = httpx.post(f"{g.url}/api/models/{first}/unload", timeout=60)
        assert r.status_code < 300, r.text
        wait_for(lambda: model(g, first)["state"] == "unloaded", 60)
        # Priced warm now: its file stayed in the page cache after its server stopped.
        assert model(g, first)["load_s_estimate"] == pytest.approx(
            model(g, first)["warm_load_s_estimate"], abs=0.05
        )
        chat(g, first)
        swap = g.status()["recent_swaps"][-1]
        assert swap["model"] == first
        assert swap["file_cached"] > 0.9
        m = model(g, first)
        assert m["warm_load_s_estimate"] != warm_before  # the warm load refined the warm figure
        assert m["cold_load_s_estimate"] is not None
    finally:
        for _ in gen:
            pass


def alternating(files: list[Path], *extra: str) -> str:
    """Models `a` and `b` on `files`, on one device that holds one at a time."""
    binary = find_llama_server()
    assert binary is not None
    lines = ["devices: [{name: cpu}]", *extra, "models:"]
    for name, path in zip("ab", files, strict=True):
        cmd = shlex.join([binary, "-m", str(path), "--ctx-size", "512", "--parallel", "1"])
        lines.append(f"  {name}: {{cmd: '{cmd} --port ${{PORT}}', health_timeout_s: 120}}")
    return "\n".join(lines) + "\n"


def test_the_predicted_next_models_file_is_read_in_before_its_request(
    two_files: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """Two models alternate on a device that holds one: once the alternation is learned, the
    next model's file, dropped from the page cache while the other serves, is read back in
    before its request comes, and its load finds it cached (a hit of the predictor)."""
    _, files = two_files
    with serve(tmp_path / "corral", alternating(files)) as g:
        for name in "abab":
            chat(g, name)
        chat(g, "a")  # the alternation is learned: b comes next
        prepare = g.status()["prepare"]
        assert prepare["on"]
        assert prepare["predicted_next"] == {"b": 1.0}
        assert prepare["wanted"] == ["b"]
        wait_for(lambda: model(g, "b")["file_cached"] > 0.9, 10)  # b's load left it cached
        drop([files[1]])  # other work pushes it out while a serves
        # Measured (every second) and read back in, whole.
        wait_for(lambda: g.status()["prepare"]["prepared"].get("b", 0) >= 1, 20)
        wait_for(lambda: model(g, "b")["file_cached"] > 0.9, 10)
        got = cached([files[1]])
        assert got is not None
        assert got > 0.9
        hits = g.status()["prepare"]["hits"]
        chat(g, "b")
        swap = g.status()["recent_swaps"][-1]
        assert swap["model"] == "b"
        assert swap["file_cached"] > 0.9
        assert g.status()["prepare"]["hits"] == hits + 1


def test_with_prepare_off_nothing_is_read_ahead(
    two_files: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    _, files = two_files
    with serve(tmp_path / "corral", alternating(files, "scheduler: {prepare: false}")) as g:
        for name in "ababa":
            chat(g, name)
        assert g.status()["prepare"]["wanted"] == ["b"]  # predicted all the same
        drop([files[1]])
        wait_for(lambda: model(g, "b")["file_cached"] < 0.5, 10)
        time.sleep(3)  # three passes of the measure: a preparation would have begun
        assert g.status()["prepare"]["prepared_gb"] == 0
        assert model(g, "b")["file_cached"] < 0.5
