"""The Batch API against OpenAI's own reference, through the official client: listing order and
limits, expiring files, usage, the `validating` status, completion windows, metadata bounds,
error bodies, and the input files editors write (a BOM, a trailing blank line)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_gateway_errors import http_server
from tests.support.batches import chat_line, finish, lines_of, upload
from tests.support.gateway import SIM, Gateway, serve

pytestmark = pytest.mark.e2e


class _Refuses(BaseHTTPRequestHandler):
    """A model server that refuses every request with a plain-text 400."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b"prompt too long"
        self.send_response(400)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with http_server(_Refuses) as refuses:
        config = f"""
models:
  alpha:
    load_s: 0.2
    concurrency: 4
    cmd: {SIM} --load-s 0.2 --tokens-per-s 5000 --parallel 4
  refuses:
    upstream: {refuses}
server:
  log_dir: LOG_DIR
batch:
  validate_inline_mb: 0.002   # files over 2 kB are checked after the batch is created
"""
        folder: Path = tmp_path_factory.mktemp("batch-conformance")
        with serve(folder, config) as g:
            yield g


def test_files_list_in_either_order_with_checked_limits_and_cursors(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    ids = [upload(client, [chat_line(i, "alpha")]) for i in range(3)]
    newest_first = [f.id for f in client.files.list() if f.id in ids]
    assert newest_first == ids[::-1]
    oldest_first = [f.id for f in client.files.list(order="asc") if f.id in ids]
    assert oldest_first == ids
    page = client.files.list(order="asc", after=ids[0], limit=1)
    assert [f.id for f in page.data] == [ids[1]]
    for query, param in [
        ("limit=0", "limit"),
        ("limit=abc", "limit"),
        ("limit=10001", "limit"),
        ("order=sideways", "order"),
        ("after=file-nope", "after"),
    ]:
        r = httpx.get(f"{gw.url}/v1/files?{query}")
        assert r.status_code == 400, query
        assert r.json()["error"]["param"] == param, query
    for query in ("limit=0", "limit=101", "after=batch_nope"):
        r = httpx.get(f"{gw.url}/v1/batches?{query}")
        assert r.status_code == 400, query
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_expires_after_sets_expires_at_on_uploads_and_outputs(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    data = (chat_line(0, "alpha") + "\n").encode()
    f = client.files.create(
        file=("in.jsonl", data),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert f.expires_at == f.created_at + 7200
    assert client.files.retrieve(f.id).expires_at == f.created_at + 7200
    plain = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert plain.expires_at == plain.created_at + 30 * 86_400  # OpenAI's default for batch files
    with pytest.raises(openai.BadRequestError, match=r"expires_after\.seconds must be"):
        client.files.create(
            file=("in.jsonl", data),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},
        )
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    b = finish(client, b.id)
    out = client.files.retrieve(b.output_file_id or "")
    assert out.expires_at == out.created_at + 3600
    b = finish(
        client,
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    out = client.files.retrieve(b.output_file_id or "")
    assert out.expires_at == out.created_at + 30 * 86_400  # files Corral writes expire too


def test_a_finished_batch_reports_the_usage_of_its_answers(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    b = client.batches.create(
        input_file_id=upload(client, [chat_line(i, "alpha", tokens=5) for i in range(6)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    b = finish(client, b.id)
    assert b.status == "completed"
    answers = [x["response"]["body"]["usage"] for x in lines_of(client, b.output_file_id)]
    assert b.usage is not None
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in answers) > 0
    assert b.usage.output_tokens == sum(u["completion_tokens"] for u in answers) == 30
    assert b.usage.total_tokens == sum(u["total_tokens"] for u in answers)


def test_a_large_file_is_validating_first_then_runs(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    file_id = upload(client, [chat_line(i, "alpha", tokens=1) for i in range(60)])  # ~8 kB
    b = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating"
    assert b.in_progress_at is None
    b = finish(client, b.id)
    assert b.status == "completed"
    assert b.request_counts is not None
    assert b.request_counts.completed == 60
    # checked, and its lines stored, by a process of its own (batch/checker.py)
    said = re.search(rf"batch {b.id} is in_progress: .* by process (\d+) \(nice 10\)", gw.logged())
    assert said is not None, gw.logged()
    assert int(said[1]) != gw.pid()
    # a bad line in a large file: the batch fails after validating, naming the line
    bad = [chat_line(i, "alpha", tokens=1) for i in range(60)]
    bad[41] = chat_line(41, "nope")
    b = client.batches.create(
        input_file_id=upload(client, bad), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating"
    b = finish(client, b.id)
    assert b.status == "failed"
    assert b.errors is not None
    assert [(e.line, e.code) for e in b.errors.data or []] == [(42, "model_not_found")]


def test_completion_window_and_metadata_follow_openai(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    file_id = upload(client, [chat_line(0, "alpha")])
    body: dict[str, Any] = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    missing = httpx.post(f"{gw.url}/v1/batches", json=body)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "completion_window"
    for window in ("10s", "1h", "24", 24):
        r = httpx.post(f"{gw.url}/v1/batches", json={**body, "completion_window": window})
        assert r.status_code == 400, window
        assert "completion_window must be 24h" in r.json()["error"]["message"]
    for metadata in ({"k": "v" * 513}, {"k" * 65: "v"}, {f"k{i}": "v" for i in range(17)}):
        with pytest.raises(openai.BadRequestError, match="metadata must be at most 16 pairs"):
            client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata=metadata,
            )
    ok = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"k": "v" * 512},
    )
    assert ok.metadata == {"k": "v" * 512}


def test_an_error_answer_that_is_not_json_is_an_object_in_the_error_file(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    b = client.batches.create(
        input_file_id=upload(client, [chat_line(i, "refuses") for i in range(2)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    b = finish(client, b.id)
    errors = lines_of(client, b.error_file_id)
    assert len(errors) == 2
    for line in errors:
        assert line["response"]["status_code"] == 400
        body = line["response"]["body"]
        assert isinstance(body, dict)
        assert "prompt too long" in body["error"]["message"]


def test_a_bom_and_trailing_blank_lines_are_accepted_a_blank_line_inside_is_not(
    gw: Gateway,
) -> None:
    client = gw.client(max_retries=0)
    text = "\ufeff" + "\n".join(chat_line(i, "alpha") for i in range(3)) + "\n\n\r\n"
    f = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "in_progress"
    b = finish(client, b.id)
    assert b.request_counts is not None
    assert (b.status, b.request_counts.completed) == ("completed", 3)
    assert sorted(x["custom_id"] for x in lines_of(client, b.output_file_id)) == [
        "r0",
        "r1",
        "r2",
    ]
    inside = chat_line(0, "alpha") + "\n\n" + chat_line(1, "alpha") + "\n"
    f = client.files.create(file=("in.jsonl", inside.encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "failed"
    assert b.errors is not None
    assert [e.line for e in b.errors.data or []] == [2]


def test_listing_batches_pages_with_a_cursor(gw: Gateway) -> None:
    client = gw.client(max_retries=0)
    file_id = upload(client, [chat_line(0, "alpha")])
    made = [
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2]
    assert page.has_more
    rest = client.batches.list(limit=2, after=made[1])
    assert rest.data[0].id == made[0]
