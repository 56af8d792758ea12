"""Errors in OpenAI's body shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse


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
