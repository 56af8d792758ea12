"""Errors in OpenAI's body shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from corral.ratelog import Throttle, no_space

_throttle = Throttle(logging.getLogger("corral.gateway"))


def error(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error in OpenAI's shape."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
        headers=headers,
    )


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve, raised where it is found and answered in
    one place (`answer`): OpenAI's error body, or another door's (the Ollama API maps it at
    its door). A kind sets the status and the OpenAI `type`; the message names the field and
    the fix."""

    status = 500
    kind = "api_error"
    model: str | None = None  # the model the refused request is for, once known (metrics)

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> Response:
        return error(self.status, self.message, self.kind, self.param, self.code, self.headers)


class InvalidRequest(GatewayError):
    status, kind = 400, "invalid_request_error"


class ModelNotFound(GatewayError):
    status, kind = 404, "invalid_request_error"


class NotStored(GatewayError):
    """A stored object (a response) the gateway does not keep: the model's server may."""

    status, kind = 404, "invalid_request_error"


class BodyTooLarge(GatewayError):
    status, kind = 413, "invalid_request_error"


class QueueFull(GatewayError):
    status, kind = 429, "rate_limit_error"


class ClientLeft(GatewayError):
    """The client went away while it waited: 499 (nginx's), with no body, for the logs."""

    status = 499

    def __init__(self) -> None:
        super().__init__("the client left")

    def response(self) -> Response:
        return Response(status_code=499)


class Forbidden(GatewayError):
    status, kind = 403, "permission_error"


class Conflict(GatewayError):
    status, kind = 409, "conflict"


class UpstreamFailed(GatewayError):
    status, kind = 502, "upstream_error"


class ModelUnavailable(GatewayError):
    status, kind = 503, "unavailable_error"


class WaitTimeout(GatewayError):
    status, kind = 504, "timeout_error"


async def gateway_error(_: Request, exc: Exception) -> Response:
    """A `GatewayError` raised in a FastAPI route."""
    assert isinstance(exc, GatewayError)
    return exc.response()


async def http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))


async def validation_error(_: Request, exc: Exception) -> Response:
    """A bad query or path parameter: 400 in OpenAI's shape, naming the parameter."""
    assert isinstance(exc, RequestValidationError)
    problems = exc.errors()
    first = problems[0] if problems else {}
    param = str(first.get("loc", ["", ""])[-1]) if first else None
    message = "; ".join(
        f"{'.'.join(str(x) for x in p.get('loc', ())[1:]) or 'request'}: {p.get('msg')}"
        for p in problems
    )
    return error(400, message or "invalid request", "invalid_request_error", param=param)


async def store_unavailable(_: Request, exc: Exception) -> Response:
    """The task store could not be reached (after its own retries) or stayed locked: 503 with
    Retry-After, which the official clients retry; nothing was lost."""
    return error(
        503,
        f"the task store is unavailable: {exc}; try again shortly",
        "server_error",
        code="store_unavailable",
        headers={"Retry-After": "5"},
    )


def stream_error(message: str) -> bytes:
    """A server-sent event carrying an error, as OpenAI sends one mid-stream (the official
    clients raise it as an `APIError`)."""
    body = {
        "error": {"message": message, "type": "upstream_error", "param": None, "code": "cut_short"}
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def upstream_body(
    status: int, content: bytes, content_type: str, route: str | None = None
) -> bytes | None:
    """A model server's error answer as OpenAI's error body, or None if it already is one (a
    JSON object with an `error`). A plain `Internal Server Error` reaches clients as JSON that
    their libraries can read. A 404 to a model `route` says which route: a server without it
    (no /v1/responses, no /infill) answers a bare "File Not Found"."""
    if status < 400:
        return None
    said = _said(content, content_type)
    if said is not None and not (status == 404 and route):
        return None
    wrapped = {
        "error": {
            "message": _message(status, said, content, route),
            "type": "upstream_error" if status >= 500 else "invalid_request_error",
            "param": None,
            "code": f"upstream_{status}",
        }
    }
    return json.dumps(wrapped).encode()


def upstream_message(
    status: int, content: bytes, content_type: str, route: str | None = None
) -> str:
    """What a model server's error answer says, for a door that writes errors its own way:
    the server's own message where it sent an error object, else `upstream_body`'s."""
    said = _said(content, content_type)
    if said is not None and not (status == 404 and route):
        inner = said.get("message") if isinstance(said, dict) else said
        return str(inner or f"HTTP {status}")
    return _message(status, said, content, route)


def _said(content: bytes, content_type: str) -> Any:
    """The `error` of a JSON error answer, or None."""
    parsed: Any = None
    if "json" in content_type:
        try:
            parsed = json.loads(content)
        except ValueError:
            parsed = None
    return parsed.get("error") if isinstance(parsed, dict) else None


def _message(status: int, said: Any, content: bytes, route: str | None) -> str:
    if isinstance(said, dict):
        text = str(said.get("message") or said)[:1000]
    elif said is not None:
        text = str(said)[:1000]
    else:
        text = content.decode("utf-8", "replace").strip()[:1000] or f"HTTP {status}"
    message = f"the model server answered {status}: {text}"
    if status == 404 and route:
        message = (
            f"the model server answered 404 to {route}: {text} (a server that does not serve "
            f"{route} answers so)"
        )
    return message


# Anthropic's error types by status (its Messages API's errors page); 529 is its "overloaded".
_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def as_anthropic(response: Response) -> Response:
    """An error answer of the gateway's or a server's, in OpenAI's shape, as Anthropic's
    Messages API writes one: `{"type": "error", "error": {"type", "message"}}`, the same status
    and Retry-After. An answer already in Anthropic's shape, or not an error, is as it came."""
    body = getattr(response, "body", None)
    if response.status_code < 400 or not isinstance(body, bytes):
        return response
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        return response
    if not isinstance(parsed, dict) or parsed.get("type") == "error":
        return response
    err = parsed.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    kind = _ANTHROPIC_KINDS.get(response.status_code, "api_error")
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": str(message)}},
        status_code=response.status_code,
        headers=headers,
    )


def no_space_error(where: str) -> JSONResponse:
    """507: a write failed on a full disk; nothing of the request was kept."""
    return error(
        507,
        f"no space left on the device holding {where}: free some space and try again; nothing "
        "of this request was kept",
        "server_error",
        code="insufficient_storage",
    )


async def os_error(_: Request, exc: Exception) -> Response:
    """An I/O error no route handled: 507 for a full disk, else 500, both in OpenAI's shape
    (never Starlette's plain-text 500), logged once per cause per minute."""
    assert isinstance(exc, OSError)
    if no_space(exc):
        _throttle.warning("no space", "a write failed: %s", exc)
        return no_space_error(f"Corral's data ({getattr(exc, 'filename', None) or 'a file'})")
    _throttle.warning(f"os {type(exc).__name__}", "an I/O error: %s", exc, exc_info=True)
    return error(500, f"an I/O error on the server: {exc.strerror or exc}", "server_error")
