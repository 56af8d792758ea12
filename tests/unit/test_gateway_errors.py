"""Model servers' error answers in OpenAI's shape (the gateway's `upstream_body`)."""

from __future__ import annotations

import json

import pytest

from corral.gateway.errors import upstream_body

pytestmark = pytest.mark.unit


def test_a_plain_text_error_is_wrapped_in_openai_shape() -> None:
    out = upstream_body(500, b"Internal Server Error", "text/plain; charset=utf-8")
    assert out is not None
    err = json.loads(out)["error"]
    assert err["message"] == "the model server answered 500: Internal Server Error"
    assert (err["type"], err["code"]) == ("upstream_error", "upstream_500")


def test_json_that_is_not_an_openai_error_is_wrapped_too() -> None:
    out = upstream_body(422, b'{"detail": "bad"}', "application/json")
    assert out is not None
    assert json.loads(out)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("status", "content", "kind"),
    [
        (400, b'{"error": {"message": "n_ctx exceeded", "type": "x"}}', "application/json"),
        (200, b"plain text success", "text/plain"),
    ],
)
def test_openai_errors_and_successes_pass_through(status: int, content: bytes, kind: str) -> None:
    assert upstream_body(status, content, kind) is None


def test_an_empty_error_body_still_says_what_happened() -> None:
    out = upstream_body(503, b"", "")
    assert out is not None
    assert json.loads(out)["error"]["message"] == "the model server answered 503: HTTP 503"
