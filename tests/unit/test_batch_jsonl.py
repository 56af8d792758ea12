"""A batch's input file: every bad-line case with its code and line number; lines as tasks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from corral.batch.jsonl import TooLong, bounded_lines, check, result_line, tasks
from corral.store import Task, TaskStatus

EP = "/v1/chat/completions"
MODELS = {"alpha": "alpha", "a": "alpha", "beta": "beta"}


def line(i: int, **over: object) -> str:
    item: dict[str, object] = {
        "custom_id": f"r{i}",
        "method": "POST",
        "url": EP,
        "body": {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
    }
    item.update(over)
    return json.dumps(item)


def run(tmp_path: Path, data: bytes, max_lines: int = 100) -> list[tuple[str, int | None, str]]:
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    checked = check(path, EP, MODELS.get, max_lines)
    return [(e.code, e.line, e.message) for e in checked.errors]


def good(n: int) -> list[str]:
    return [line(i) for i in range(1, n + 1)]


@pytest.mark.parametrize(
    ("bad", "code", "fragment"),
    [
        ("{not json", "invalid_json_line", "is not valid JSON"),
        ("[1, 2]", "invalid_json_line", "must be a JSON object"),
        ("   ", "invalid_json_line", "is blank"),
        (
            json.dumps({"custom_id": "x", "method": "POST", "url": EP}),
            "missing_required_parameter",
            "missing body",
        ),
        (
            json.dumps({"method": "POST", "url": EP, "body": {}}),
            "missing_required_parameter",
            "missing custom_id",
        ),
        (line(9, url="/v1/embeddings"), "invalid_url", "differs from the batch's endpoint"),
        (line(9, method="GET"), "invalid_request", "method must be POST"),
        (line(9, body={"model": "alpha", "stream": True}), "streaming_unsupported", "stream: true"),
        (line(9, body={"model": "gpt-9"}), "model_not_found", "model 'gpt-9' is not served"),
        (line(9, body={"messages": []}), "missing_required_parameter", "body.model is missing"),
        (line(1), "duplicate_custom_id", "custom_id 'r1' appears twice"),
        (line(9, custom_id=""), "invalid_request", "custom_id must be a non-empty string"),
    ],
)
def test_each_bad_line_is_named_with_its_code_and_line(
    tmp_path: Path, bad: str, code: str, fragment: str
) -> None:
    data = "\n".join([*good(2), bad, line(4)]) + "\n"
    ((got_code, got_line, message),) = run(tmp_path, data.encode())
    assert (got_code, got_line) == (code, 3)
    assert message.startswith("line 3: ")
    assert fragment in message


def test_invalid_utf8_empty_file_and_too_many_lines(tmp_path: Path) -> None:
    data = (line(1) + "\n").encode() + b'{"custom_id": "\xff"}\n'
    assert run(tmp_path, data)[0][:2] == ("invalid_encoding", 2)
    assert run(tmp_path, b"") == [("empty_file", None, "the file has no lines")]
    ((code, at, message),) = run(tmp_path, "\n".join(good(4)).encode(), max_lines=3)
    assert (code, at) == ("too_many_lines", None)
    assert "more than 3 lines (batch.max_lines)" in message


def test_every_problem_is_reported_at_once_and_a_good_file_has_none(tmp_path: Path) -> None:
    data = "\n".join([line(1), "{", line(1), line(4, url="/x")])
    assert [(c, n) for c, n, _ in run(tmp_path, data.encode())] == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("invalid_url", 4),
    ]
    assert run(tmp_path, "\n".join(good(3)).encode()) == []  # no trailing newline: fine too


def test_lines_become_tasks_in_order_with_their_text_and_resolved_model(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    texts = [line(1), line(2, body={"model": "a"}), line(3, body={"model": "beta"})]
    path.write_text("\r\n".join(texts) + "\n")
    checked = check(path, EP, MODELS.get, 10)
    out = list(tasks(path, checked, "batch_1", -1, 3))
    assert [t.model for t in out] == ["alpha", "alpha", "beta"]  # the alias resolved
    assert [t.payload_raw for t in out] == texts
    assert {(t.batch_id, t.priority, t.max_attempts, t.kind) for t in out} == {
        ("batch_1", -1, 3, "openai_batch")
    }


def a_task(status: TaskStatus, result: object = None, error: str | None = None) -> Task:
    return Task(
        "t1",
        1,
        "openai_batch",
        "alpha",
        {"custom_id": "r1"},
        -1,
        None,
        status,
        1,
        3,
        0.0,
        0.0,
        result=result,
        error=error,
    )


def test_result_lines_match_openais_shapes() -> None:
    answer = {"status_code": 200, "request_id": "req_1", "body": {"id": "x"}}
    ok, text = result_line(a_task(TaskStatus.SUCCEEDED, answer), "batch_cancelled")
    assert ok
    assert json.loads(text) == {
        "id": "batch_req_t1",
        "custom_id": "r1",
        "response": answer,
        "error": None,
    }
    bad = json.dumps({"status_code": 400, "request_id": "req_2", "body": {"error": {}}})
    ok, text = result_line(a_task(TaskStatus.FAILED, error=bad), "batch_cancelled")
    assert not ok
    assert json.loads(text)["response"]["status_code"] == 400
    ok, text = result_line(a_task(TaskStatus.FAILED, error="ClientError: refused"), "x")
    assert json.loads(text)["error"] == {"code": "backend_error", "message": "ClientError: refused"}
    ok, text = result_line(a_task(TaskStatus.CANCELLED), "batch_expired")
    assert json.loads(text)["error"]["code"] == "batch_expired"
    assert json.loads(text)["response"] is None


def test_a_model_override_runs_every_line_on_it(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([line(1, body={"messages": []}), line(2)]) + "\n")
    checked = check(path, EP, MODELS.get, 10, override="beta")
    assert (checked.errors, checked.models) == ([], ["beta", "beta"])


def test_lines_over_the_cap_are_measured_never_held() -> None:
    data = b"abc\n" + b"x" * 50 + b"\n" + b"12345\r\n" + b"y" * 10 + b"\n" + b"z" * 25
    assert list(bounded_lines(io.BytesIO(data), 10)) == [
        b"abc\n",
        TooLong(50),
        b"12345\r\n",
        b"y" * 10 + b"\n",
        TooLong(25),  # the last line, without its newline
    ]
    assert list(bounded_lines(io.BytesIO(b"1234567890\r\n"), 10)) == [b"1234567890\r\n"]
