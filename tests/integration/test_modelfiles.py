"""GGUF files as models: the real gemma GGUF's facts read from its metadata, a folder
scanned (split files, projectors, unreadable files), and the memory estimate against what a real
llama-server holds once loaded, at two context sizes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from corral.backends.process import free_port
from corral.modelfiles.folder import find_llama_server, scan
from corral.modelfiles.gguf import estimate_memory, read_gguf
from tests.support.gateway import CORRAL
from tests.support.gemma import gemma_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma_gguf(tmp_path_factory.mktemp("gguf") / "gemma-3-270m.gguf")


def test_the_facts_come_from_the_files_metadata(gguf: Path) -> None:
    m = read_gguf(gguf)
    assert (m.architecture, m.size_label, m.quantization) == ("gemma3", "268M", "Q4_K_M")
    assert (m.context_length, m.layers, m.heads, m.kv_heads) == (32768, 18, 4, 1)
    assert (m.key_length, m.value_length, m.vocab, m.sliding_window) == (256, 256, 262144, 512)
    assert m.chat_template is None
    assert 240e6 < m.weights_bytes <= gguf.stat().st_size


def test_a_folder_names_its_models_by_file(gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    link = shutil.copy if gguf.stat().st_dev != tmp_path.stat().st_dev else os.link
    link(gguf, tmp_path / "small.gguf")
    for part in (1, 2):  # a split model: the first part stands for it
        link(gguf, tmp_path / "sub" / f"big-{part:05d}-of-00002.gguf")
    link(gguf, tmp_path / "sub" / "mmproj-big-f16.gguf")  # its vision projector
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    found, bad = scan(tmp_path)
    assert [m.name for m in found] == ["big", "small"]
    big = found[0]
    assert big.projector == tmp_path / "sub" / "mmproj-big-f16.gguf"
    assert f"--mmproj {big.projector}" in big.command("llama-server")
    assert "--alias big --ctx-size 32768" in big.command("llama-server")  # trained for 32K
    assert [u.path.name for u in bad] == ["broken.gguf"]
    assert "not a GGUF file" in bad[0].why


def test_corral_models_lists_them(gguf: Path, tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "400", "XDG_DATA_HOME": str(tmp_path)}
    # At 8K (the figures below): a 32K default here would say nothing new (its context is
    # checked in tests/unit/test_context_rule.py and tests/e2e/test_models_folder.py).
    out = subprocess.run(
        [CORRAL, "models", "--context", "8192", str(gguf.parent)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "gemma-3-270m" in out.stdout
    assert "Q4_K_M" in out.stdout
    assert "8,192 of 32,768" in out.stdout
    # Its prompt caches kept across swaps (the default): --swa-full, its sliding-window layers
    # holding the whole context, counted in the estimate and in llama-server's own projection
    # (asked for this very command; 412 MiB and the process's 24), which it is packed by (*).
    assert "kept" in out.stdout
    assert "file 0.47, engine 0.46*" in out.stdout
    assert (tmp_path / "corral" / "engine-memory.json").exists()  # kept for the next start
    off = subprocess.run(
        [CORRAL, "models", "--no-prompt-cache", "--context", "8192", str(gguf.parent)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert off.returncode == 0, off.stderr
    assert "file 0.38, engine 0.36*" in off.stdout
    assert "--slot-save-path" not in off.stdout
    assert "--swa-full" not in off.stdout


@pytest.fixture
def llama_server(gguf: Path) -> Iterator[object]:
    server = find_llama_server()
    assert server is not None, "llama-server is missing (the `llama` extra)"
    started: list[subprocess.Popen[bytes]] = []

    def start(context: int, *flags: str) -> int:
        port = free_port()
        proc = subprocess.Popen(
            [server, "-m", str(gguf), "--port", str(port), "--ctx-size", str(context), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        started.append(proc)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, f"llama-server exited ({proc.returncode}) while loading"
            assert time.monotonic() < deadline, "llama-server did not load"
            time.sleep(0.2)
        return int(psutil.Process(proc.pid).memory_info().rss)

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.timeout(300)  # a real load, on a machine that may be busy
@pytest.mark.parametrize(("context", "swa_full"), [(2048, False), (32768, False), (32768, True)])
def test_the_estimate_is_within_15_percent_of_a_loaded_servers_memory(
    gguf: Path, llama_server: object, context: int, swa_full: bool
) -> None:
    """`swa_full`: as Corral starts it to keep its prompt caches."""
    rss = llama_server(context, *(["--swa-full"] if swa_full else []))  # type: ignore[operator]
    estimate = estimate_memory(read_gguf(gguf), context, swa_full=swa_full).total_bytes
    assert abs(estimate / rss - 1) <= 0.15, (context, estimate, rss)


@pytest.mark.timeout(300)  # gguf's own reader takes seconds on the vocabulary
def test_the_header_walk_agrees_with_llama_cpps_reader(gguf: Path) -> None:
    from gguf import GGUFReader

    from corral.modelfiles.gguf import _Array, _header

    fields, tensors = _header(gguf)
    reader = GGUFReader(gguf)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        theirs = field.contents()
        ours = fields[key]
        if isinstance(ours, _Array):
            assert ours.count == len(theirs)
            if ours.values:
                assert ours.values == theirs
        else:
            assert ours == pytest.approx(theirs) if isinstance(ours, float) else ours == theirs
    assert [
        (int(t.n_elements), int(t.n_bytes), t.name, int(t.tensor_type)) for t in reader.tensors
    ] == tensors
