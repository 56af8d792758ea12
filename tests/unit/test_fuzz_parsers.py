"""The parsers that take what a client or a config author sends, fuzzed: each either
accepts its input or refuses it with its own error naming the problem, and never raises
anything else. The HTTP side (every route with generated bodies) is fuzzed by schemathesis in
tests/e2e/test_openapi.py; the header checks here run on raw header bytes.

CORRAL_EXAMPLES=5000 for a long hunt; CI runs the default.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from corral.batch.jsonl import TooLong, bounded_lines, check
from corral.batch.webhooks import WebhookRefused, check_url
from corral.config import parse_config
from corral.errors import ConfigError
from corral.gateway.doors.ollama_shapes import (
    MAX_KEEP_ALIVE_S,
    BadRequest,
    chat_request,
    embed_request,
    generate_request,
    keep_alive_s,
)
from corral.gateway.pipeline.guard import Guard
from corral.secrets import Redactor, flag_values, mask

EXAMPLES = int(os.environ.get("CORRAL_EXAMPLES", "200"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

JSONL_PIECES = st.sampled_from(
    [
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "m"}}',
        b'{"custom_id": 1}',
        b"[]",
        b"{",
        b"\xef\xbb\xbf",
        b"\xff\xfe",
        b"\r",
        b"\n",
        b" ",
        b'"stream": true',
        b"x" * 40,
    ]
)


@SETTINGS
@given(st.lists(st.one_of(JSONL_PIECES, st.binary(max_size=30)), max_size=30))
def test_batch_files_are_checked_without_surprises(pieces: list[bytes]) -> None:
    data = b"".join(pieces)
    fd, name = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    path = Path(name)
    path.write_bytes(data)
    try:
        out = check(path, "/v1/chat/completions", {"m": "m"}.get, 1000, max_line_bytes=64)
    finally:
        path.unlink()
    assert out.ok == (not out.errors)
    for e in out.errors:
        assert e.message  # every error says what is wrong
        if e.line is not None:
            assert e.message.startswith(f"line {e.line}: ")


@SETTINGS
@given(st.binary(max_size=300), st.integers(1, 40))
def test_bounded_lines_keep_short_lines_whole_and_only_measure_long_ones(
    data: bytes, cap: int
) -> None:
    got = list(bounded_lines(io.BytesIO(data), cap))
    lines = re.findall(rb"[^\n]*\n|[^\n]+$", data)
    assert len(got) == len(lines)
    for line, item in zip(lines, got, strict=True):
        if len(line.rstrip(b"\r\n")) <= cap:
            assert item == line
        else:
            assert isinstance(item, TooLong)


YAML_PIECES = st.sampled_from(
    [
        "models:\n",
        "  m: {load_s: 1}\n",
        "  m:\n    cmd: x ${PORT}\n",
        "server:\n  api_keys: ['${env.CORRAL_FUZZ_UNSET}']\n",
        "server: {allowed_hosts: [a, '*']}\n",
        "batch: {max_line_mb: 0}\n",
        "devices: [{name: g0, memory_gb: 8}]\n",
        "scheduler: {policy: cost, max_wait_s: -1}\n",
        "- a\n",
        ": :\n",
        "\t",
        "&a [*a]\n",
        "'",
    ]
)


@SETTINGS
@given(st.lists(st.one_of(YAML_PIECES, st.text(max_size=20)), max_size=8))
def test_configs_are_valid_or_a_config_error(pieces: list[str]) -> None:
    problems: list[str] = []
    try:
        parse_config("".join(pieces), "fuzz.yaml")
    except ConfigError as exc:
        problems = [str(p) for p in exc.problems] or ["(none)"]
    assert all(p.startswith("fuzz.yaml") for p in problems)


URLS = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda scheme, host, port, path: f"{scheme}://{host}{port}{path}",
        st.sampled_from(["http", "https", "ftp", "HTTP", "", "javascript"]),
        st.sampled_from(
            [
                "127.0.0.1",
                "[::1]",
                "10.0.0.1",
                "169.254.169.254",
                "a.example",
                "[::ffff:7f00:1]",
                "0x7f000001",
                "2130706433",
                "user:pw@a.example",
                "",
                "[",
                "a..b",
                "xn--",
            ]
        ),
        st.sampled_from(["", ":80", ":0", ":99999", ":x", ":-1"]),
        st.text(max_size=10),
    ),
)


def lookup(host: str, port: int) -> list[str]:
    if host in ("a.example",):
        return ["93.184.215.14"]
    raise OSError("does not resolve")


@SETTINGS
@given(URLS, st.sampled_from([[], ["127.0.0.1"], ["a.example"]]))
def test_webhook_urls_are_checked_or_refused(url: str, allowed: list[str]) -> None:
    try:
        t = check_url(url, allowed, lookup)
    except WebhookRefused as exc:
        why = str(exc)
    else:
        why = ""
        assert t.url.lower().startswith(("http://", "https://"))
    assert why or t


HEADER = st.binary(max_size=40)


@SETTINGS
@given(HEADER, HEADER, HEADER, st.sampled_from(["GET", "POST", "DELETE"]), st.text(max_size=20))
def test_the_guard_answers_any_headers_with_pass_or_403(
    host: bytes, origin: bytes, fetch_site: bytes, method: str, path: str
) -> None:
    passed: list[bool] = []
    sent: list[dict[str, object]] = []

    async def app(scope: object, receive: object, send: object) -> None:
        passed.append(True)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "http.disconnect"}

    headers = [(b"host", host), (b"origin", origin), (b"sec-fetch-site", fetch_site)]
    scope = {"type": "http", "method": method, "path": "/" + path, "headers": headers}
    asyncio.run(Guard(app, ["corral.example"])(scope, receive, send))  # type: ignore[arg-type]
    if not passed:
        assert sent[0]["status"] == 403


@SETTINGS
@given(st.text(max_size=80), st.text(min_size=1, max_size=30))
def test_secrets_are_found_and_masked_in_any_text(cmd: str, secret: str) -> None:
    assert isinstance(flag_values(cmd), list)  # never raises, whatever the quoting
    shown = Redactor([secret])(cmd + secret + cmd)
    assert mask(secret) in shown


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
OLLAMA_KEYS = st.sampled_from(
    ["model", "messages", "prompt", "system", "images", "options", "format", "tools", "think",
     "stream", "keep_alive", "raw", "suffix", "input", "role", "content", "tool_calls",
     "tool_name", "function", "arguments", "num_predict", "stop", "context", "dimensions",
     "logprobs", "top_logprobs"]
)  # fmt: skip
OLLAMA_BODIES = st.dictionaries(
    OLLAMA_KEYS,
    JSON_VALUES
    | st.lists(st.dictionaries(OLLAMA_KEYS, JSON_VALUES, max_size=5), max_size=3)
    | st.dictionaries(OLLAMA_KEYS, JSON_VALUES, max_size=4),
    max_size=8,
)


@SETTINGS
@example({"prompt": "hi", "messages": [], "input": "x", "options": {"model": "other"}})
@example({"prompt": "hi", "context": [2**24 + 1, 2**40, -1]})
@example({"prompt": "hi", "suffix": "x", "context": [1.5]})
@given(OLLAMA_BODIES)
def test_ollama_requests_are_taken_or_refused_by_name(body: dict[str, object]) -> None:
    """Any JSON object an Ollama client (or an attacker) sends becomes an OpenAI request or a
    BadRequest naming the field; nothing else escapes (it would be a 500)."""
    converts: list[Callable[[dict[str, Any]], dict[str, Any]]] = [
        lambda b: chat_request(b, "m"),
        lambda b: generate_request(b, "m")[1],
        lambda b: embed_request(b, "m", "embed"),
        lambda b: embed_request(b, "m", "embeddings"),
    ]
    for convert in converts:
        why = ""
        try:
            out = convert(body)
        except BadRequest as exc:
            why = str(exc) or "(empty)"
        else:
            assert out["model"] == "m"  # nothing a client sends picks another
        assert why != "(empty)"  # a refusal says why


@SETTINGS
@given(
    st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()
    | st.text(alphabet="0123456789.-+hmsun e", max_size=30)
    | JSON_VALUES
)
def test_any_keep_alive_is_refused_or_a_time_ps_can_show(raw: object) -> None:
    """`keep_alive: 1e308` once passed here and made /api/ps answer 500 for every client."""
    try:
        seconds = keep_alive_s(raw)
    except BadRequest as exc:
        seconds, why = None, str(exc)
    else:
        why = "keep_alive"
    assert "keep_alive" in why
    assert seconds is None or seconds == math.inf or 0 <= seconds <= MAX_KEEP_ALIVE_S
