"""Request coalescing (`batch:` on a model): concurrent /v1/embeddings requests go upstream as one
request and each client gets its own answer; a live `corral serve`, the official client."""

from __future__ import annotations

import http.server
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from corral.gateway.pipeline.coalesce import apportion, inputs_of, split_answer
from tests.helpers import JsonHandler
from tests.support.gateway import SIM, serve


class Recording(JsonHandler):
    """An embeddings upstream that records each request's inputs, answers one 3-number vector per
    input (its length, its position, 1), and refuses with 400 any request holding "poison"."""

    seen: ClassVar[list[list[Any]]] = []
    lock = threading.Lock()
    delay_s: ClassVar[float] = 0.2

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        inputs = body["input"]
        with self.lock:
            Recording.seen.append(inputs)
        threading.Event().wait(self.delay_s)  # a forward pass, long enough for others to queue
        if "poison" in inputs:
            self.answer(400, {"error": {"message": "input 'poison' is not allowed"}})
            return
        data = [
            {"object": "embedding", "index": i, "embedding": [len(str(x)), i, 1]}
            for i, x in enumerate(inputs)
        ]
        tokens = sum(len(str(x)) for x in inputs)
        self.answer(
            200,
            {
                "object": "list",
                "data": data,
                "model": body["model"],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    def do_GET(self) -> None:
        self.answer(200, {"object": "list", "data": []})


@pytest.fixture
def upstream() -> Any:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Recording.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)


def test_concurrent_requests_share_upstream_requests_and_each_gets_its_own_answer(
    tmp_path: Path, upstream: str
) -> None:
    config = f"""
models:
  emb:
    upstream: {upstream}
    batch: {{max_size: 16, max_wait_ms: 100}}
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path, config) as gw:
        client = gw.client()

        def one(i: int) -> Any:
            texts = [f"text-{i}-{j}" + "x" * i for j in range(1 + i % 3)]
            return texts, client.embeddings.with_raw_response.create(
                model="emb", input=texts, encoding_format="float"
            )

        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(one, range(24)))
        for texts, raw in answers:
            emb = raw.parse()
            assert [d.index for d in emb.data] == list(range(len(texts)))
            assert [d.embedding[0] for d in emb.data] == [len(t) for t in texts]  # its own
            assert emb.usage.prompt_tokens >= 0
            assert int(raw.headers["x-corral-batch-size"]) >= len(texts)
        total_inputs = sum(len(t) for t, _ in answers)
        assert sum(len(s) for s in Recording.seen) == total_inputs  # every input went once
        assert len(Recording.seen) <= 8  # 48 inputs in a handful of upstream requests
        assert max(len(s) for s in Recording.seen) <= 16
        # usage apportioned: the parts add up to what the server counted
        assert sum(raw.parse().usage.prompt_tokens for _, raw in answers) == sum(
            len(str(x)) for s in Recording.seen for x in s
        )
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert f'corral_batch_inputs_count{{model="emb"}} {len(Recording.seen)}.0' in metrics

        # Different options never share a batch; a lone request waits no more than max_wait_ms.
        Recording.seen = []
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(
                lambda fmt: _post(gw.url, {"model": "emb", "input": "q", "user": fmt}),
                ["u1", "u2"],
            )
        assert a.status_code == b.status_code == 200
        assert Recording.seen == [["q"], ["q"]]
        assert float(a.headers["x-corral-wait-ms"]) < 1000


def test_a_refused_batch_is_retried_request_by_request_so_one_bad_input_fails_alone(
    tmp_path: Path, upstream: str
) -> None:
    # The batch goes when full (three inputs): the three share it however slowly a busy
    # machine sends them; the long window only bounds how long the first one waits.
    config = f"""
models:
  emb:
    upstream: {upstream}
    batch: {{max_size: 3, max_wait_ms: 10000}}
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path, config) as gw:
        bodies = [{"model": "emb", "input": t} for t in ("good", "poison", "fine")]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda b: _post(gw.url, b), bodies))
        assert [r.status_code for r in answers] == [200, 400, 200]
        assert "poison" in answers[1].json()["error"]["message"]
        assert answers[0].json()["data"][0]["embedding"] == [4, 0, 1]
        assert sorted(Recording.seen[0]) == ["fine", "good", "poison"]  # tried together first
        assert sorted(map(tuple, Recording.seen[1:])) == [("fine",), ("good",), ("poison",)]


def test_a_full_batch_queue_answers_503_with_retry_after(tmp_path: Path, upstream: str) -> None:
    Recording.delay_s = 1.0
    config = f"""
models:
  emb:
    upstream: {upstream}
    batch: {{max_size: 2, max_wait_ms: 0, max_queued: 4}}
server:
  log_dir: LOG_DIR
"""
    try:
        with serve(tmp_path, config) as gw:
            with ThreadPoolExecutor(10) as pool:
                answers = list(
                    pool.map(lambda i: _post(gw.url, {"model": "emb", "input": f"t{i}"}), range(10))
                )
            codes = sorted(r.status_code for r in answers)
            assert codes.count(200) >= 4
            full = [r for r in answers if r.status_code == 503]
            assert full, codes
            assert full[0].headers["retry-after"] == "1"
            assert "batch.max_queued 4" in full[0].json()["error"]["message"]
            assert full[0].json()["error"]["code"] == "batch_queue_full"
    finally:
        Recording.delay_s = 0.2


def test_sim_backend_embeddings_batched_match_those_of_lone_requests(
    tmp_path: Path,
) -> None:
    config = f"""
models:
  batched:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3
    batch: {{max_size: 8, max_wait_ms: 20}}
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path, config) as gw:
        client = gw.client()
        texts = [f"sentence number {i}" for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            got = list(
                pool.map(
                    lambda t: client.embeddings.create(model="batched", input=t).data[0].embedding,
                    texts,
                )
            )
        metrics = httpx.get(f"{gw.url}/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("corral_batch_inputs_count"))
        assert float(line.split()[-1]) < 12  # 12 requests, fewer upstream requests
        # One at a time, each request is a batch of its own: the same vectors, in the same order.
        want = [client.embeddings.create(model="batched", input=t).data[0].embedding for t in texts]
        assert got == want


def test_inputs_apportion_and_split_answer() -> None:
    assert inputs_of("a") == ("text", ["a"])
    assert inputs_of(["a", "b"]) == ("text", ["a", "b"])
    assert inputs_of([1, 2, 3]) == ("tokens", [[1, 2, 3]])
    assert inputs_of([[1], [2, 3]]) == ("tokens", [[1], [2, 3]])
    bad: object
    for bad in ([], [1, "a"], [[1], "a"], [[]], {"a": 1}, None, [True]):
        assert inputs_of(bad) is None
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(apportion(7, [5, 0, 2])) == 7
    assert apportion(5, [0, 0]) == [3, 2]
    answer = {
        "object": "list",
        "model": "m",
        "data": [{"index": i, "embedding": [i]} for i in (2, 0, 1)],
        "usage": {"prompt_tokens": 9, "total_tokens": 9},
    }
    a, b = split_answer(answer, [1, 2], [1, 2])
    assert a["data"] == [{"index": 0, "embedding": [0]}]
    assert b["data"] == [{"index": 0, "embedding": [1]}, {"index": 1, "embedding": [2]}]
    assert (a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]) == (3, 6)
    assert a["model"] == "m"
    with pytest.raises(ValueError, match="answered 2 embeddings for 3 inputs"):
        split_answer({"data": [{}, {}]}, [1, 2], [1, 1])
