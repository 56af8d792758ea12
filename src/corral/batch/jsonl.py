"""A batch's input file, checked line by line, and its lines as tasks; the output and error
files' lines.

`check` reads the file once, keeping only each line's model and the custom_ids seen, so a
200,000-line file is checked in bounded memory; `tasks` reads it again and yields one task per
line with the line's own text as its payload (no second parse). All or nothing: a file with any
bad line is refused whole, every problem named with its line number (up to `max_errors`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from corral.store import NewTask, Task, TaskStatus

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors put first
KIND = "openai_batch"  # the task kind of a batch line


@dataclass(frozen=True)
class LineError:
    """One problem, in the shape of the Batch API's `errors.data` entries."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class Checked:
    """What `check` found: one model per line, or the errors."""

    models: list[str] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True, slots=True)
class TooLong:
    """A line longer than the cap: its length, never its bytes."""

    size: int


def bounded_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes | TooLong]:
    """The lines of `f`, each whole if it holds at most `max_bytes` (its newline aside), else a
    `TooLong` in its place: a longer line is read through in 1 MB pieces and dropped, so a
    190 MB line costs 1 MB of memory, not 190."""
    limit = max_bytes + 2  # the cap, and room for "\r\n"
    while True:
        raw = f.readline(limit)
        if not raw:
            return
        whole = raw.endswith(b"\n") or len(raw) < limit  # else the line goes on
        size = len(raw.rstrip(b"\r\n"))
        if whole and size <= max_bytes:
            yield raw
            continue
        while not whole:
            raw = f.readline(1 << 20)
            whole = not raw or raw.endswith(b"\n")
            size += len(raw.rstrip(b"\r\n"))
        yield TooLong(size)


def check(
    path: Path,
    endpoint: str,
    resolve: Callable[[str], str | None],
    max_lines: int,
    max_errors: int = 100,
    override: str | None = None,
    max_line_bytes: int = 32 << 20,
) -> Checked:
    """Check every line of the file at `path` for a batch on `endpoint`. `resolve` maps a
    body's `model` (a name or alias) to the model that serves it, None if unknown. With
    `override` (a model), every line runs on it and the bodies' own `model` is not needed.
    A line over `max_line_bytes` is an error naming it, never read whole."""
    out = Checked()
    seen: set[str] = set()
    errors = out.errors

    def bad(code: str, message: str, line: int, param: str | None = None) -> None:
        errors.append(LineError(code, f"line {line}: {message}", line, param))

    blank: list[int] = []  # blank lines so far: fine at the end of the file, not before a line
    with path.open("rb") as f:
        n = 0
        for n, raw in enumerate(bounded_lines(f, max_line_bytes), 1):
            if len(errors) >= max_errors:
                break
            if isinstance(raw, TooLong):
                mb = max_line_bytes / (1 << 20)
                bad(
                    "line_too_long",
                    f"is {raw.size / (1 << 20):.1f} MB; a line may hold {mb:g} MB "
                    "(batch.max_line_mb)",
                    n,
                )
                continue
            if n == 1:
                raw = raw.removeprefix(_BOM)
            if n > max_lines:
                errors.append(
                    LineError(
                        "too_many_lines",
                        f"the file has more than {max_lines} lines (batch.max_lines); split it",
                    )
                )
                break
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad("invalid_encoding", f"not valid UTF-8 (byte {exc.start + 1})", n)
                continue
            if not text.strip():
                blank.append(n)
                continue
            for at in blank:
                bad("invalid_json_line", "is blank; every line must be one request", at)
            blank.clear()
            try:
                item = json.loads(text)
            except json.JSONDecodeError as exc:
                bad("invalid_json_line", f"is not valid JSON ({exc.msg}, column {exc.colno})", n)
                continue
            if not isinstance(item, dict):
                bad("invalid_json_line", "must be a JSON object", n)
                continue
            model = _request(item, n, endpoint, resolve, override, seen, bad)
            if model is not None:
                out.models.append(model)
    if not out.models and not errors:
        errors.append(LineError("empty_file", "the file has no lines"))
    return out


def _request(
    item: dict[str, Any],
    n: int,
    endpoint: str,
    resolve: Callable[[str], str | None],
    override: str | None,
    seen: set[str],
    bad: Callable[..., None],
) -> str | None:
    """The model that serves line `n`'s request `item`, or None once `bad` was told what is
    wrong with it (`seen`: the custom ids so far)."""
    missing = [k for k in ("custom_id", "method", "url", "body") if k not in item]
    if missing:
        bad(
            "missing_required_parameter",
            f"missing {', '.join(missing)}",
            n,
            missing[0],
        )
        return None
    custom_id, method, url, body = (
        item["custom_id"],
        item["method"],
        item["url"],
        item["body"],
    )
    if not isinstance(custom_id, str) or not custom_id:
        bad("invalid_request", "custom_id must be a non-empty string", n, "custom_id")
        return None
    if custom_id in seen:
        bad("duplicate_custom_id", f"custom_id {custom_id!r} appears twice", n, "custom_id")
        return None
    seen.add(custom_id)
    if method != "POST":
        bad("invalid_request", f"method must be POST; got {method!r}", n, "method")
        return None
    if url != endpoint:
        bad(
            "invalid_url",
            f"url {url!r} differs from the batch's endpoint {endpoint!r}",
            n,
            "url",
        )
        return None
    if not isinstance(body, dict):
        bad("invalid_request", "body must be a JSON object", n, "body")
        return None
    if body.get("stream"):
        bad("streaming_unsupported", "stream: true is not allowed in a batch", n, "body")
        return None
    if override is not None:
        return override
    name = body.get("model")
    if not isinstance(name, str) or not name:
        bad("missing_required_parameter", "body.model is missing", n, "body.model")
        return None
    model = resolve(name)
    if model is None:
        bad("model_not_found", f"model {name!r} is not served here", n, "body.model")
        return None
    return model


def tasks(
    path: Path,
    checked: Checked,
    batch_id: str,
    priority: int,
    max_attempts: int,
    starts: Mapping[str, float] | None = None,
    weight: float = 1.0,
) -> Iterator[NewTask]:
    """One task per line of a file that `check` passed, in line order. With `starts` (per
    model, `BatchStore.starts`), the k-th line of a model takes turn start + k / `weight`."""
    placed: dict[str, int] = {}
    with path.open("rb") as f:
        lines = (x for i, x in enumerate(f) if x.strip() and not (i == 0 and x.strip() == _BOM))
        for n, (model, raw) in enumerate(zip(checked.models, lines, strict=True)):
            if n == 0:
                raw = raw.removeprefix(_BOM)
            turn = None
            if starts is not None:
                placed[model] = k = placed.get(model, 0) + 1
                turn = starts[model] + k / weight
            yield NewTask(
                KIND,
                model,
                priority=priority,
                max_attempts=max_attempts,
                batch_id=batch_id,
                payload_raw=raw.decode("utf-8").rstrip("\r\n"),
                turn=turn,
            )


# --- output -------------------------------------------------------------------------------------
def result_line(task: Task, ending: str) -> tuple[bool, bytes]:
    """A line's outcome as (goes to the output file?, its JSONL line). `ending` names why a line
    that never ran did not: `batch_cancelled` or `batch_expired`."""
    custom_id = task.payload["custom_id"]
    line_id = f"batch_req_{task.id}"
    response: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    if task.status is TaskStatus.SUCCEEDED:
        response = task.result
    elif task.status is TaskStatus.FAILED:
        response = _answer(task.error or "")
        if response is None:
            error = {"code": "backend_error", "message": task.error or "the line failed"}
    else:  # cancelled (or never run before the batch ended)
        why = "cancelled" if ending == "batch_cancelled" else "expired"
        error = {"code": ending, "message": f"the batch was {why} before this line ran"}
    ok = response is not None and int(response.get("status_code", 500)) < 400
    doc = {"id": line_id, "custom_id": custom_id, "response": response, "error": error}
    return ok, (json.dumps(doc) + "\n").encode()


def _answer(error: str) -> dict[str, Any] | None:
    """The server's answer a failed line recorded (see `corral.batch.runner`), if it got one."""
    try:
        doc = json.loads(error)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) and "status_code" in doc else None
