"""A folder of GGUF files served with no YAML: `corral serve --models DIR` with the
real gemma GGUF, answered through the official openai and ollama clients; two small models
packed on the machine's one device by their memory estimates, both resident at once;
`models_dir:` in a config, where a model written by hand wins over the file of the same name;
an Ollama store served under its Ollama names."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from corral.backends.process import free_port
from corral.modelfiles.engine_memory import EngineMemory, allocated, device_bytes
from corral.modelfiles.folder import find_llama_server
from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL, SIM, Gateway, serve
from tests.support.gemma import gemma_gguf
from tests.support.listing import model_ids, wait_for_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CAPITALS: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    first = gemma_gguf(root / "gemma-a.gguf")
    os.link(first, root / "gemma-b.gguf")  # a second small model (the same bytes)
    return root


def serving(args: list[str], home: Path) -> Iterator[tuple[Gateway, list[str]]]:
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(home / "data")}
    proc = subprocess.Popen(
        [CORRAL, "serve", *args, "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    logged: list[str] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield Gateway(f"http://127.0.0.1:{port}"), logged
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        logged += err.splitlines()


def test_a_folder_is_served_with_no_yaml_and_its_models_share_the_device(
    folder: Path, tmp_path: Path
) -> None:
    gen = serving(["--models", str(folder)], tmp_path)
    g, logged = next(gen)
    try:

        def listed() -> dict[str, str]:  # llama-swap's status, as Open WebUI reads it
            data = httpx.get(f"{g.url}/v1/models").json()["data"]
            return {m["id"]: m["status"]["value"] for m in data}

        assert listed() == {"gemma-a": "unloaded", "gemma-b": "unloaded"}
        client = g.client(max_retries=0, timeout=240)
        for model in ("gemma-a", "gemma-b"):
            out = client.chat.completions.create(
                model=model, messages=CAPITALS, max_tokens=4, temperature=0
            )
            assert (out.choices[0].message.content or "").strip().startswith("Paris")
        # Two models of 0.38 GB on one device of gigabytes: packed, the first stayed loaded.
        states = {n: m["state"] for n, m in g.status()["models"].items()}
        assert states == {"gemma-a": "ready", "gemma-b": "ready"}
        assert listed() == {"gemma-a": "loaded", "gemma-b": "loaded"}
        # The same models through Ollama's API and its official client.
        oc = ollama.Client(host=g.url, timeout=240)
        tags = {m.model or "": m for m in oc.list().models}
        assert sorted(tags) == ["gemma-a:latest", "gemma-b:latest"]
        details = tags["gemma-a:latest"].details
        assert details is not None
        assert (details.family, details.quantization_level) == ("gemma3", "Q4_K_M")
        assert details.parameter_size == "268M"
        info = oc.show("gemma-a").modelinfo or {}
        assert info["general.architecture"] == "gemma3"
        # The default context: trained for 32K, and a CPU device of gigabytes.
        assert info["gemma3.context_length"] == 32768
        listing = {t["name"]: t for t in httpx.get(f"{g.url}/api/tags").json()["models"]}
        assert listing["gemma-a:latest"]["context_length"] == 32768
        assert listing["gemma-a:latest"]["state"] == "loaded"
        assert "tools" in listing["gemma-a:latest"]["capabilities"]
        # A larger num_ctx than the window (aider's) is served in it, with no reload.
        swaps = g.status()["swaps"]
        answer = oc.chat(
            model="gemma-a", messages=CAPITALS,
            options={"num_predict": 4, "temperature": 0, "num_ctx": 65536},
        )  # fmt: skip
        assert g.status()["swaps"] == swaps
        assert (answer.message.content or "").strip().startswith("Paris")
        assert answer.eval_count
        assert answer.eval_duration
        # This GGUF carries no template: Corral's gemma template takes tools, so
        # a chat with tools is answered (llama.cpp's named template answered them with a 500).
        weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
        with_tools = oc.chat(
            model="gemma-a", messages=CAPITALS, tools=[weather],
            options={"num_predict": 4, "temperature": 0},
        )  # fmt: skip
        assert with_tools.message.content or with_tools.message.tool_calls
        assert with_tools.prompt_eval_count is not None
        assert answer.prompt_eval_count is not None
        assert with_tools.prompt_eval_count > answer.prompt_eval_count  # the tools, rendered
        assert {m.model for m in oc.ps().models} == {"gemma-a:latest", "gemma-b:latest"}
    finally:
        for _ in gen:
            pass
    # Each load's buffers, as llama-server reported them, kept for the next start;
    # its log holds its load at verbosity 4, and only what verbosity 3 says once it served.
    data = tmp_path / "data" / "corral"
    kept = json.loads((data / "engine-memory.json").read_text())
    assert len(kept) == 2
    assert all(v["measured_bytes"] for v in kept.values()), kept
    server_log = next(data.rglob("gemma-a.log")).read_text()
    measured = device_bytes(allocated(server_log.splitlines()) or EngineMemory())
    assert measured in [v["measured_bytes"] for v in kept.values()]
    served = server_log.split("listening on", 1)[1]
    assert "print_timing" in served
    assert "skipping, slot is empty" not in served  # verbosity 4's own lines, left out
    again = serving(["--models", str(folder)], tmp_path)
    _, logged_again = next(again)
    for _ in again:
        pass
    assert sum("GB (measured; the file's estimate" in line for line in logged_again) == 2
    text = "\n".join(logged)
    assert "gemma-a: gemma3 268M Q4_K_M, context 32,768 (default; trained for 32,768)" in text
    assert "a client asked for num_ctx 65536; it is served with its context of 32768" in text
    assert "devices: cpu (" in text


def test_models_dir_in_a_config_and_a_hand_written_model_wins(folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "corral.yaml"
    config.write_text(
        f"""
models_dir:
  - path: {folder}
    context: 2048
    contexts: {{gemma-b: 4096, gemma-c: 1024}}
models:
  gemma-b:   # the same name as a file in the folder: this one is served
    load_s: 0.1
    cmd: {SIM} --load-s 0.1
server:
  log_dir: {tmp_path / "logs"}
"""
    )
    gen = serving(["--config", str(config)], tmp_path)
    g, logged = next(gen)
    try:
        r = httpx.post(
            f"{g.url}/v1/chat/completions",
            json={"model": "gemma-b", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert r.status_code == 200
        assert "timings" not in r.json()  # the sim answered, not llama-server (which adds them)
        assert sorted(g.status()["models"]) == ["gemma-a", "gemma-b"]
        a = httpx.post(
            f"{g.url}/v1/chat/completions",
            json={"model": "gemma-a", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 1},
            timeout=120,
        )  # fmt: skip
        assert a.headers["x-corral-context"] == "2048"  # the folder's, told with the answer
        (listed,) = [m for m in httpx.get(f"{g.url}/v1/models").json()["data"]
                     if m["id"] == "gemma-a"]  # fmt: skip
        assert listed["context_length"] == 2048
    finally:
        for _ in gen:
            pass
    assert any("gemma-b: kept the model written in the config" in x for x in logged)
    assert any("context 2,048 (set for the folder; trained for 32,768)" in x for x in logged)
    assert any("`contexts` names no model found there: gemma-c" in x for x in logged)


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [CORRAL, "serve", "--models", str(tmp_path / "nope"), "--listen", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "no such folder" in out.stderr
    assert "Traceback" not in out.stderr


def ollama_store(root: Path, gguf: Path, name: str, tag: str) -> Path:
    """An Ollama model store holding `gguf` as `name:tag`, laid out as `ollama pull` does."""
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True)
    os.link(gguf, root / "blobs" / digest.replace(":", "-"))
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest,
             "size": gguf.stat().st_size}  # fmt: skip
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
    return root


def test_an_ollama_store_is_served_under_its_ollama_names(folder: Path, tmp_path: Path) -> None:
    store = ollama_store(tmp_path / "ollama", folder / "gemma-a.gguf", "gemma3", "270m")
    gen = serving(["--models", str(store)], tmp_path)
    g, _ = next(gen)
    try:
        client = g.client(max_retries=0, timeout=240)
        assert [m.id for m in client.models.list()] == ["gemma3:270m"]
        out = client.chat.completions.create(
            model="gemma3:270m", messages=CAPITALS, max_tokens=4, temperature=0
        )
        assert (out.choices[0].message.content or "").strip().startswith("Paris")
        # An Ollama user's own client and names, unchanged: streamed, as Open WebUI asks.
        oc = ollama.Client(host=g.url, timeout=240)
        assert [m.model for m in oc.list().models] == ["gemma3:270m"]
        parts = list(
            oc.chat(
                model="gemma3:270m",
                messages=CAPITALS,
                stream=True,
                options={"num_predict": 4, "temperature": 0},
            )
        )
        assert parts[-1].done
        assert "".join(p.message.content or "" for p in parts).strip().startswith("Paris")
    finally:
        for _ in gen:
            pass


def test_a_watched_folder_picks_up_files_added_and_removed(folder: Path, tmp_path: Path) -> None:
    mine = tmp_path / "watched"
    mine.mkdir()
    os.link(folder / "gemma-a.gguf", mine / "gemma-a.gguf")
    gen = serving(["--models", str(mine), "--watch"], tmp_path)
    g, _ = next(gen)
    try:
        assert model_ids(g.url) == ["gemma-a"]
        os.link(folder / "gemma-b.gguf", mine / "gemma-b.gguf")
        wait_for_ids(g.url, ["gemma-a", "gemma-b"], timeout_s=30)
        (mine / "gemma-a.gguf").unlink()
        wait_for_ids(g.url, ["gemma-b"], timeout_s=30)
    finally:
        for _ in gen:
            pass


def test_logprobs_from_a_real_llama_server_through_ollamas_client(
    folder: Path, tmp_path: Path
) -> None:
    """llama-server's own log probabilities, asked through Ollama's fields, whole
    and streamed, in the shape the official client reads."""
    gen = serving(["--models", str(folder)], tmp_path)
    g, _ = next(gen)
    try:
        oc = ollama.Client(host=g.url, timeout=240)
        options = {"num_predict": 4, "temperature": 0}
        whole = oc.chat(
            model="gemma-a", messages=CAPITALS, logprobs=True, top_logprobs=2, options=options
        )
        assert whole.logprobs
        assert "".join(p.token for p in whole.logprobs) == whole.message.content
        for p in whole.logprobs:
            assert p.logprob <= 0
            assert p.top_logprobs is not None
            assert len(p.top_logprobs) == 2
            assert p.top_logprobs[0].logprob >= p.top_logprobs[1].logprob
        parts = list(
            oc.chat(model="gemma-a", messages=CAPITALS, logprobs=True, stream=True, options=options)
        )
        tokens = [p.token for part in parts for p in part.logprobs or []]
        assert "".join(tokens) == "".join(part.message.content or "" for part in parts)
        assert [p.token for p in whole.logprobs] == tokens  # temperature 0: the same answer
    finally:
        for _ in gen:
            pass


def test_fill_in_the_middle_responses_and_embeddings_over_a_real_llama_server(
    tmp_path: Path,
) -> None:
    """Clients' fields over the real server, where the model matters: gemma-3-270m has no FIM
    tokens, so `suffix` gets Ollama's refusal with llama-server's reason (it was answered as a chat,
    the suffix dropped); llama-server ignores `dimensions`, so Corral cuts and renormalises
    (full-length vectors came back); its /v1/responses answers through Corral."""
    gguf = gemma_gguf(tmp_path / "gemma.gguf")
    server = find_llama_server()
    assert server is not None
    config = f"""
models:
  gemma:
    cmd: {server} -m {gguf} --port ${{PORT}} --ctx-size 2048
    load_s: 5
  gemma-embed:
    cmd: {server} -m {gguf} --port ${{PORT}} --ctx-size 2048 --embeddings --pooling mean
    load_s: 5
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path / "gateway", config) as g:
        oc = ollama.Client(host=g.url, timeout=240)
        for stream in (False, True):
            with pytest.raises(ollama.ResponseError) as refused:
                _insert(oc, stream)
            assert refused.value.status_code == 400
            assert '"gemma" does not support insert' in refused.value.error
            assert "prefix token is missing" in refused.value.error  # llama-server's reason
        full = oc.embed(model="gemma-embed", input=["hello world", "goodbye"]).embeddings
        assert len(full[0]) == 640  # gemma-3-270m's width: the server ignores `dimensions`
        short = oc.embed(model="gemma-embed", input=["hello world", "goodbye"], dimensions=8)
        for whole, cut in zip(full, short.embeddings, strict=True):
            assert len(cut) == 8
            assert sum(x * x for x in cut) == pytest.approx(1.0)
            scale = cut[0] / whole[0]
            assert cut == pytest.approx([x * scale for x in whole[:8]])
        oa = openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0, timeout=240)
        done = oa.responses.create(
            model="gemma", input="The capital of France?", max_output_tokens=6
        )
        assert done.status == "completed"
        assert done.output[0].type == "message"
        assert done.usage is not None
        assert done.usage.output_tokens == 6
        events = list(
            oa.responses.create(
                model="gemma", input="The capital of France?", max_output_tokens=6, stream=True
            )
        )
        assert events[0].type == "response.created"
        assert events[-1].type == "response.completed"
        assert any(e.type == "response.output_text.delta" for e in events)


def _insert(oc: ollama.Client, stream: bool) -> None:
    """A fill-in-the-middle request, its stream read to the end."""
    if stream:
        list(oc.generate(model="gemma", prompt="def f(", suffix="return x", stream=True))
    else:
        oc.generate(model="gemma", prompt="def f(", suffix="return x")
