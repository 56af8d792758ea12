"""The Batch API of `corral serve` on sim backends, driven by the official `openai` client with
strict response validation: files, batches, results, errors, cancel, expiry, limits, webhooks,
and a kill -9 in the middle of a batch."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import pytest

from corral.backends.process import free_port
from corral.store.sql_batches import LINES_PER_TX
from tests.helpers import JsonHandler, alive, wait_http_ok
from tests.support.batches import chat_line, finish, lines_of, upload
from tests.support.gateway import CORRAL, SIM, Gateway, serve, wait_for

CONFIG = f"""
models:
  alpha:
    load_s: 0.3
    concurrency: 4
    cmd: {SIM} --load-s 0.3 --tokens-per-s 2000 --parallel 4
  beta:
    load_s: 0.3
    concurrency: 4
    cmd: {SIM} --load-s 0.3 --tokens-per-s 2000 --parallel 4
  slow:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3 --tokens-per-s 20
server:
  log_dir: LOG_DIR
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("batches"), CONFIG) as g:
        yield g


def test_a_mixed_model_batch_runs_grouped_and_every_line_has_one_result(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    models = ["alpha", "beta"] * 20
    file_id = upload(client, [chat_line(i, m) for i, m in enumerate(models)])
    before = gw.status()["swaps"]
    b = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert (b.status, b.request_counts and b.request_counts.total) == ("in_progress", 40)
    b = finish(client, b.id)
    assert b.status == "completed"
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (40, 0)
    assert b.metadata == {"job": "test"}
    assert b.error_file_id is None
    out = lines_of(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(40))
    assert {x["response"]["status_code"] for x in out} == {200}
    by_id = {x["custom_id"]: x["response"]["body"]["model"] for x in out}
    assert all(by_id[f"r{i}"] == m for i, m in enumerate(models))
    # 40 lines alternating between two models: grouped, each model loads once.
    assert gw.status()["swaps"] - before <= 2, json.dumps(gw.status()["recent_decisions"], indent=1)
    assert client.files.retrieve(b.output_file_id or "").purpose == "batch_output"


def test_a_batch_stored_in_several_transactions_runs_each_line_once(gw: Gateway) -> None:
    # More lines than one transaction stores (LINES_PER_TX): the batch is held back while its
    # creator stores them, and the batch tick, running all the while, never stores it twice.
    client = gw.client(max_retries=0)
    n = 2 * LINES_PER_TX + 100
    b = client.batches.create(
        input_file_id=upload(client, [chat_line(i, "alpha", tokens=1) for i in range(n)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert (b.status, b.request_counts and b.request_counts.total) == ("in_progress", n)
    b = finish(client, b.id, timeout_s=600)
    assert b.status == "completed"
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    out = lines_of(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(n))


def test_failing_lines_go_to_the_error_file_with_their_status(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    emb = [
        json.dumps(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "alpha", "input": "x" if i % 2 else []},
            }
        )
        for i in range(6)
    ]
    b = client.batches.create(
        input_file_id=upload(client, emb), endpoint="/v1/embeddings", completion_window="24h"
    )
    b = finish(client, b.id)
    assert b.status == "completed"
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (3, 3)
    errors = lines_of(client, b.error_file_id)
    assert sorted(x["custom_id"] for x in errors) == ["e0", "e2", "e4"]
    assert {x["response"]["status_code"] for x in errors} == {400}  # not retried: a 4xx
    assert sorted(x["custom_id"] for x in lines_of(client, b.output_file_id)) == ["e1", "e3", "e5"]


def test_a_file_with_bad_lines_fails_the_batch_with_each_line_named(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    lines = [chat_line(1, "alpha"), "{oops", chat_line(1, "alpha"), chat_line(4, "nope")]
    b = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert b.status == "failed"
    assert b.errors is not None
    got = [(e.code, e.line) for e in b.errors.data or []]
    assert got == [("invalid_json_line", 2), ("duplicate_custom_id", 3), ("model_not_found", 4)]
    assert gw.status()["models"]["alpha"]["queued"] == 0  # all or nothing: no line queued


def test_bad_requests_are_clear_errors(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no file with id 'file-nope'"):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    file_id = upload(client, [chat_line(1, "alpha")])
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/responses",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="completion_window must be 24h; got 'soon'"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="soon",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    r = httpx.post(f"{gw.url}/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "purpose")
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_list_pages_and_an_idempotency_key_makes_one_batch(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    file_id = upload(client, [chat_line(1, "alpha")])
    ids = []
    for i in range(3):
        b = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers={"Idempotency-Key": f"key-{i // 2}"},
        )
        ids.append(b.id)
    assert ids[0] == ids[1] != ids[2]  # a retried create returns the first batch
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [ids[2]]
    assert first.has_more
    page = client.batches.list(limit=100, after=ids[2])
    assert page.data[0].id == ids[0]
    files = client.files.list()
    assert file_id in [f.id for f in files.data]


def test_cancel_keeps_finished_lines_and_reports_the_rest(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    lines = [chat_line(i, "slow", tokens=4) for i in range(40)]  # 0.2 s each, one at a time
    b = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 2)  # type: ignore[union-attr]
    extra = client.batches.retrieve(b.id).model_extra or {}
    progress = extra["corral"]  # Corral's extension: progress, ETA and place in line
    assert 0 < progress["progress"] < 1
    assert progress["eta_s"] > 0
    assert progress["queue_position"] == 0  # no batch started before it is still running
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    b = finish(client, b.id)
    assert b.status == "cancelled"
    assert b.cancelled_at is not None
    assert b.request_counts is not None
    done, failed = b.request_counts.completed, b.request_counts.failed
    assert 2 <= done < 40
    assert done + failed == 40
    out, errors = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert (len(out), len(errors)) == (done, failed)
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in out + errors) == sorted(f"r{i}" for i in range(40))
    small = client.batches.create(
        input_file_id=upload(client, [chat_line(1, "alpha")]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert finish(client, small.id).status == "completed"
    with pytest.raises(openai.ConflictError, match="only a running batch can be cancelled"):
        client.batches.cancel(small.id)


def test_interactive_requests_go_before_batch_lines(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    lines = [chat_line(i, "slow", tokens=4) for i in range(30)]  # 6 s of batch work
    b = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 1)  # type: ignore[union-attr]
    t = time.monotonic()
    client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "now"}], max_tokens=2
    )
    assert time.monotonic() - t < 1.5  # one batch line ahead of it at most, not the 28 left
    left = client.batches.retrieve(b.id).request_counts
    assert left is not None
    assert left.completed < 20
    client.batches.cancel(b.id)
    finish(client, b.id)


LIMITED = f"""
models:
  slow:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 20
server:
  log_dir: LOG_DIR
batch:
  max_lines: 5
  max_file_mb: 0.01
  max_queued_batches: 1
  webhook_hosts: [127.0.0.1]
  completion_windows: [24h, 1s]  # 1s: an extension, to see a batch expire
"""


class Hooks(http.server.BaseHTTPRequestHandler):
    """A webhook receiver that fails its first call (so the retry is exercised)."""

    got: ClassVar[list[dict[str, Any]]] = []
    calls: ClassVar[int] = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        Hooks.calls += 1
        if Hooks.calls == 1:
            self.send_response(503)
        else:
            Hooks.got.append(json.loads(body))
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_limits_expiry_and_webhooks(tmp_path: Path) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = f"http://127.0.0.1:{server.server_address[1]}/done"
    try:
        with serve(tmp_path, LIMITED) as g:
            client = g.client(max_retries=0)
            too_many = upload(client, [chat_line(i, "slow") for i in range(6)])
            b = client.batches.create(
                input_file_id=too_many, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert b.status == "failed"
            assert b.errors is not None
            assert "more than 5 lines (batch.max_lines)" in str((b.errors.data or [])[0].message)
            lines = upload(client, [chat_line(i, "slow", tokens=10) for i in range(5)])
            b = client.batches.create(
                input_file_id=lines,
                endpoint="/v1/chat/completions",
                completion_window="1s",  # type: ignore[arg-type]
                metadata={"webhook_url": hook},
            )
            with pytest.raises(
                openai.RateLimitError, match=r"limit is 1 \(batch.max_queued_batches\)"
            ):
                client.batches.create(
                    input_file_id=lines, endpoint="/v1/chat/completions", completion_window="24h"
                )
            with pytest.raises(openai.BadRequestError, match="is not allowed"):
                client.batches.create(
                    input_file_id=lines,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    extra_body={"webhook_url": "http://example.com/x"},
                )
            b = finish(client, b.id)
            assert b.status == "expired"  # 5 lines of 0.5 s do not fit in 1 s
            errors = lines_of(client, b.error_file_id)
            assert {x["error"]["code"] for x in errors} == {"batch_expired"}
            assert b.request_counts is not None
            assert b.request_counts.completed + len(errors) == 5
            wait_for(lambda: bool(Hooks.got))  # the second try, 2 s after a 503

            def webhook() -> dict[str, Any]:
                extra = client.batches.retrieve(b.id).model_extra or {}
                return extra["corral"]["webhook"] or {}

            assert Hooks.got[0]["type"] == "batch.expired"
            assert Hooks.got[0]["data"]["id"] == b.id
            wait_for(lambda: bool(webhook().get("delivered_at")))
            assert (webhook()["tries"], webhook()["last_error"]) == (2, "HTTP 503")
            r = httpx.post(
                f"{g.url}/v1/files",
                files={"file": ("a.jsonl", b"x" * 20_000)},
                data={"purpose": "batch"},
            )
            assert (r.status_code, r.json()["error"]["code"]) == (413, "file_too_large")
            assert "(batch.max_file_mb)" in r.json()["error"]["message"]
    finally:
        server.shutdown()


KILL = f"""
models:
  alpha:
    load_s: 0.2
    concurrency: 8
    cmd: {SIM} --load-s 0.2 --tokens-per-s 5000 --parallel 8
server:
  log_dir: LOG_DIR
"""


def test_kill_9_mid_batch_then_restart_finishes_with_one_line_per_custom_id(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    n = 2000
    config = tmp_path / "corral.yaml"
    config.write_text(KILL.replace("LOG_DIR", str(tmp_path / "logs")))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = subprocess.Popen(
        [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http_ok(f"{url}/health")
        client = Gateway(url).client(max_retries=0)
        file_id = upload(client, [chat_line(i, "alpha", tokens=2) for i in range(n)])
        b = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 300)  # type: ignore[union-attr]
        orphan = Gateway(url).status()["models"]["alpha"]["pid"]
        first.kill()  # kill -9: no shutdown of any kind, mid-batch
        first.wait(10)
    finally:
        first.kill()
    assert alive(orphan)  # its model server outlived it ...
    with serve(tmp_path, KILL, env=env) as g:
        wait_for(lambda: not alive(orphan))  # ... until the next run on the folder stopped it
        client = g.client(max_retries=0)
        b = finish(client, b.id, timeout_s=120)
        assert b.status == "completed"
        out = lines_of(client, b.output_file_id)
        ids = [x["custom_id"] for x in out]
        assert len(ids) == len(set(ids)) == n  # exactly one line per custom_id
        assert b.request_counts is not None
        counts = b.request_counts
        assert (counts.completed, counts.failed, counts.total) == (n, 0, n)
        assert b.error_file_id is None


def corral(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CORRAL, *args], capture_output=True, text=True, timeout=120)


def test_corral_submit_waits_with_progress_and_downloads_the_results(
    gw: Gateway, tmp_path: Path
) -> None:
    src = tmp_path / "jobs.jsonl"
    src.write_text("\n".join(chat_line(i, "whatever") for i in range(12)) + "\n")
    done = corral(
        "submit",
        str(src),
        "--model",
        "beta",
        "--wait",
        "--out",
        str(tmp_path / "out"),
        "--url",
        gw.url,
    )
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert f"batch {batch_id} completed: 12 completed, 0 failed" in done.stderr
    saved = tmp_path / "out" / f"{batch_id}_output.jsonl"
    out = [json.loads(x) for x in saved.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(12))
    assert {x["response"]["body"]["model"] for x in out} == {"beta"}  # --model applied
    listed = corral("batches", "list", "--url", gw.url)
    assert batch_id in listed.stdout
    shown = corral("batches", "show", batch_id, "--url", gw.url)
    assert json.loads(shown.stdout)["status"] == "completed"
    again = corral("batches", "cancel", batch_id, "--url", gw.url)
    assert again.returncode == 1
    assert "only a running batch can be cancelled" in again.stderr


def test_corral_submit_names_the_bad_lines_and_the_unreachable_server(
    gw: Gateway, tmp_path: Path
) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(chat_line(1, "alpha") + "\n{nope\n")
    bad = corral("submit", str(src), "--url", gw.url)
    assert bad.returncode == 1
    assert "invalid_json_line: line 2: is not valid JSON" in bad.stderr
    gone = corral("batches", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 1
    assert "is `corral serve` running?" in gone.stderr


class Flaky(JsonHandler):
    """An OpenAI-compatible upstream that answers 503 twice per request id, then 200; a
    request whose prompt says "broken" always gets 500."""

    hits: ClassVar[dict[str, int]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["prompt"]
        Flaky.hits[prompt] = Flaky.hits.get(prompt, 0) + 1
        if "broken" in prompt:
            self.answer(500, {"error": {"message": "the model fell over"}})
        elif Flaky.hits[prompt] <= 2:
            self.answer(503, {"error": {"message": "busy"}})
        else:
            self.answer(200, {"id": "c1", "object": "text_completion", "choices": []})

    def do_GET(self) -> None:
        self.answer(200, {"object": "list", "data": []})


def test_5xx_answers_are_retried_and_the_last_one_kept(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = f"""
models:
  remote:
    upstream: http://127.0.0.1:{server.server_address[1]}
server:
  log_dir: LOG_DIR
"""
    lines = [
        json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "remote", "prompt": cid},
            }
        )
        for cid in ("ok-1", "ok-2", "broken-1")
    ]
    try:
        with serve(tmp_path, config) as g:  # retries back off 1 s, then 2 s
            client = g.client(max_retries=0)
            b = client.batches.create(
                input_file_id=upload(client, lines),
                endpoint="/v1/completions",
                completion_window="24h",
            )
            b = finish(client, b.id)
            assert b.request_counts is not None
            assert (b.request_counts.completed, b.request_counts.failed) == (2, 1)
            assert Flaky.hits == {"ok-1": 3, "ok-2": 3, "broken-1": 3}  # 3 attempts each
            (err,) = lines_of(client, b.error_file_id)
            assert err["custom_id"] == "broken-1"
            assert err["response"]["status_code"] == 500  # the server's last answer, kept
            assert err["response"]["body"]["error"]["message"] == "the model fell over"
    finally:
        server.shutdown()
