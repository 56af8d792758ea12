"""An ordinary, messy models folder never stops `corral serve --models`: the real
gemma GGUF under a downloaded file's name with spaces, under a name that is not UTF-8 and under
a name holding `${env.X}`, served and answered; beside them files with hostile headers and a
model bigger than every device, each skipped with one line naming it, shown in /api/status and
told to a client that asks for it (the official openai and ollama clients); `corral models` on
the same folder never shows a traceback; `--watch` survives a crafted file landing."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import psutil
import pytest
from gguf import GGUFValueType as T

from tests.e2e.test_models_folder import CAPITALS, serving
from tests.support.gateway import CORRAL
from tests.support.gemma import gemma_gguf
from tests.support.gguf_files import gguf_bytes, kv, llama_fields, nested_array, text, write
from tests.support.listing import model_ids, wait_for_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SECRET = "corral-test-secret-7f3a"
SPACES = "Gemma 3 270M Instruct (Q4_K_M)"
NOT_UTF8 = b"gemma-caf\xe9"
MACRO = "x${env.CORRAL_TEST_SECRET}"
HOSTILE = {
    "heads-zero": llama_fields(llama__attention__head_count=(T.UINT32, 0)),
    "context-inf": llama_fields(llama__context_length=(T.FLOAT32, float("inf"))),
    "context-negative": llama_fields(llama__context_length=(T.INT32, -1)),
    "context-text": llama_fields(llama__context_length=(T.STRING, "lots")),
    "template-number": llama_fields(tokenizer__chat_template=(T.UINT32, 7)),
}


def huge_model(path: Path, data_bytes: int) -> Path:
    """A llama GGUF whose one tensor holds `data_bytes` (a sparse file: no disk used)."""
    fields = llama_fields()
    elements = data_bytes // 4
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(fields))
    body = head + b"".join(kv(k, t, v) for k, (t, v) in fields.items())
    body += text("blk.0.weight") + struct.pack("<I2QIQ", 2, elements // 1024, 1024, 0, 0)
    body += b"\0" * (-len(body) % 32)
    write(path, body)
    with path.open("r+b") as f:
        f.truncate(len(body) + elements * 4)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("messy")
    first = gemma_gguf(root / f"{SPACES}.gguf")
    os.link(first, os.fsencode(root) + b"/" + NOT_UTF8 + b".gguf")
    os.link(first, root / f"{MACRO}.gguf")
    for name, fields in HOSTILE.items():
        write(root / "bad" / f"{name}.gguf", gguf_bytes(fields))
    nest_fields = llama_fields()
    nest = b"GGUF" + struct.pack("<IQQ", 3, 0, len(nest_fields) + 1)
    nest += b"".join(kv(k, t, v) for k, (t, v) in nest_fields.items()) + nested_array(5000)
    write(root / "bad" / "nested.gguf", nest + b"\0" * 64)
    write(root / "bad" / "counts.gguf", gguf_bytes(llama_fields(), n_kv=1 << 60))
    huge_model(root / "llama-70b.gguf", 2 << 40)  # 2 TiB: past any device here
    return root


@pytest.fixture(scope="module")
def gw(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    os.environ["CORRAL_TEST_SECRET"] = SECRET  # in the server's environment, as a key would be
    gen = serving(["--models", str(folder)], tmp_path_factory.mktemp("home"))
    g, logged = next(gen)
    try:
        yield g.url, logged
    finally:
        for _ in gen:
            pass
        del os.environ["CORRAL_TEST_SECRET"]


SERVED = sorted(["Gemma-3-270M-Instruct-(Q4_K_M)", "gemma-caf%E9", MACRO])
SKIPPED = sorted([*HOSTILE, "nested", "counts", "llama-70b"])


def test_a_messy_folder_serves_every_good_model_and_says_why_of_the_rest(
    gw: tuple[str, list[str]],
) -> None:
    url, _ = gw
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert sorted(m["id"] for m in models) == SERVED
    tags = ollama.Client(host=url).list().models
    assert sorted(m.model or "" for m in tags) == sorted(f"{n}:latest" for n in SERVED)
    skipped = {s["model"]: s["why"] for s in httpx.get(f"{url}/api/status").json()["skipped"]}
    assert sorted(skipped) == SKIPPED
    assert "llama.attention.head_count is 0" in skipped["heads-zero"]
    assert "heads-zero.gguf" in skipped["heads-zero"]
    assert "context_length" in skipped["context-inf"]
    assert "tokenizer.chat_template is not text" in skipped["template-number"]
    assert "nested more than" in skipped["nested"]
    assert "more than the largest device" in skipped["llama-70b"]


def test_a_skipped_model_is_a_404_that_says_why(gw: tuple[str, list[str]]) -> None:
    url, _ = gw
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        oai.chat.completions.create(model="llama-70b", messages=CAPITALS)
    assert "is not served" in str(caught.value)
    assert "more than the largest device" in str(caught.value)
    with pytest.raises(ollama.ResponseError) as told:
        ollama.Client(host=url).chat(model="heads-zero", messages=CAPITALS)
    assert told.value.status_code == 404
    assert "head_count is 0" in told.value.error


@pytest.mark.parametrize("model", SERVED)
def test_every_good_model_answers(gw: tuple[str, list[str]], model: str) -> None:
    url, _ = gw
    oc = ollama.Client(host=url, timeout=300)
    answer = oc.chat(model=model, messages=CAPITALS, options={"num_predict": 4, "temperature": 0})
    assert (answer.message.content or "").strip().startswith("Paris")
    # Loaded, it is listed by every route that lists loaded models (a path that is not
    # UTF-8 in its command once made them answer 500).
    assert f"{model}:latest" in [m.model for m in oc.ps().models]
    running = httpx.get(f"{url}/running")
    assert running.status_code == 200
    assert model in [r["model"] for r in running.json()["running"]]
    assert httpx.get(f"{url}/api/status").status_code == 200


def test_a_macro_in_a_file_name_reads_no_secret(gw: tuple[str, list[str]], folder: Path) -> None:
    """The file's name reaches llama-server as it is: the variable's value is on no command
    line, in no log and on no page."""
    url, _ = gw
    ollama.Client(host=url, timeout=300).generate(
        model=MACRO, prompt="hi", options={"num_predict": 1}
    )
    pid = httpx.get(f"{url}/api/status").json()["models"][MACRO]["pid"]
    argv = psutil.Process(pid).cmdline()
    assert argv[argv.index("-m") + 1] == str(folder / f"{MACRO}.gguf")
    assert argv[argv.index("--alias") + 1] == MACRO
    assert SECRET not in " ".join(argv)
    assert SECRET not in httpx.get(f"{url}/logs").text
    status = httpx.get(f"{url}/api/status").text
    assert SECRET not in status


def test_the_log_names_each_skipped_file_once_and_shows_no_traceback(
    folder: Path, tmp_path: Path
) -> None:
    gen = serving(["--models", str(folder)], tmp_path)
    _, logged = next(gen)
    for _ in gen:  # stopped: its whole stderr is in
        pass
    text_ = "\n".join(logged)
    assert "Traceback" not in text_
    for name in SKIPPED:
        assert sum(f"{name}.gguf" in line and "skipped" in line for line in logged) == 1, name


def test_corral_models_lists_the_good_and_names_the_rest(folder: Path) -> None:
    out = subprocess.run(
        [CORRAL, "models", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    for name in SKIPPED:
        assert f"{name}.gguf" in out.stderr
    assert "Gemma-3-270M-Instruct-(Q4_K_M)" in out.stdout
    assert "gemma-caf%E9" in out.stdout


def test_a_watched_folder_survives_a_crafted_file_and_keeps_serving(
    folder: Path, tmp_path: Path
) -> None:
    """`--watch` once stopped silently when a crafted GGUF landed: no line, and files added
    later never appeared."""
    mine = tmp_path / "watched"
    mine.mkdir()
    os.link(folder / f"{SPACES}.gguf", mine / "first.gguf")
    gen = serving(["--models", str(mine), "--watch"], tmp_path)
    g, logged = next(gen)
    try:
        assert model_ids(g.url) == ["first"]
        os.link(folder / "bad" / "nested.gguf", mine / "crafted.gguf")
        deadline = time.monotonic() + 60
        while "crafted" not in [s["model"] for s in g.status()["skipped"]]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.link(folder / f"{SPACES}.gguf", mine / "second.gguf")
        wait_for_ids(g.url, ["first", "second"], timeout_s=60)
    finally:
        for _ in gen:
            pass
    assert any("skipped" in line and "crafted.gguf" in line for line in logged)


def test_a_folder_with_nothing_servable_names_every_file_and_why(tmp_path: Path) -> None:
    for name, fields in HOSTILE.items():
        write(tmp_path / "models" / f"[bold]{name}.gguf", gguf_bytes(fields))  # markup: text
    for argv in (
        [CORRAL, "serve", "--models", str(tmp_path / "models"), "--listen", "127.0.0.1:1"],
        [CORRAL, "models", str(tmp_path / "models")],
    ):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        assert "can be served" in out.stderr
        for name in HOSTILE:
            assert f"[bold]{name}.gguf" in out.stderr, (argv[1], name)


def test_a_gguf_landing_in_a_watched_folder_is_read_and_projected_off_the_event_loop(
    folder: Path, tmp_path: Path
) -> None:
    """The reload reads the folder, the new file's header and llama-server's memory projection
    for it (a new path: a new projection) in a thread: the gateway's own loop watch logs no
    stall inside that code, while it demonstrably watches (its lag histogram counts). Read
    from what ran on the loop, not from how long anything took, so it holds on a busy machine
    (with the reload on the loop, the stall names the projection's code in modelfiles/)."""
    mine = tmp_path / "watched"
    mine.mkdir()
    os.link(folder / f"{SPACES}.gguf", mine / "first.gguf")
    gen = serving(["--models", str(mine), "--watch"], tmp_path)
    g, logged = next(gen)
    try:
        assert model_ids(g.url) == ["first"]
        os.link(folder / f"{SPACES}.gguf", mine / "second.gguf")
        wait_for_ids(g.url, ["first", "second"], timeout_s=120)
        status = g.status()["models"]["second"]
        metrics = httpx.get(f"{g.url}/metrics").text
    finally:
        for _ in gen:
            pass
    assert "corral_event_loop_lag_seconds_count" in metrics
    lags = [
        ln for ln in metrics.splitlines() if ln.startswith("corral_event_loop_lag_seconds_count")
    ]
    assert float(lags[0].split()[-1]) > 0
    assert status is not None
    stalls = [line for line in logged if "event loop has not run" in line]
    # The reading itself (compose and modelfiles) never runs on the loop; applying what was
    # read does (reload.py), and a starved machine may stall the loop while it does.
    blamed = [s for s in stalls if "modelfiles" in s or "compose.py" in s]
    assert blamed == [], blamed
