"""The Batch API's request fields, checked: `completion_window`, `metadata`, `expires_after`;
and `BatchError`, a request the Batch API refuses."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's bounds on `expires_after.seconds` (one hour to 30 days) and on metadata.
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2_592_000
_META_PAIRS, _META_KEY, _META_VALUE = 16, 64, 512


class BatchError(Exception):
    """A request the Batch API refuses: HTTP `status`, OpenAI error `code`, and `param`."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def expires_after_s(value: Any, param: str) -> int:
    """`expires_after` (`{"anchor": "created_at", "seconds": N}`, N from one hour to 30 days)
    as seconds; `BatchError` naming `param` otherwise."""
    anchor = value.get("anchor") if isinstance(value, dict) else None
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if anchor != "created_at":
        raise BatchError(
            400, f"{param}.anchor must be 'created_at'; got {anchor!r}", "invalid_value", param
        )
    if (
        isinstance(seconds, str) and seconds.isdigit()  # multipart fields are strings
    ):
        seconds = int(seconds)
    if (
        not isinstance(seconds, int)
        or isinstance(seconds, bool)
        or not EXPIRES_MIN_S <= seconds <= EXPIRES_MAX_S
    ):
        raise BatchError(
            400,
            f"{param}.seconds must be an integer from {EXPIRES_MIN_S} (one hour) to "
            f"{EXPIRES_MAX_S} (30 days); got {seconds!r}",
            "invalid_value",
            param,
        )
    return seconds


def completion_window_s(window: Any, allowed: Sequence[str]) -> float:
    """`completion_window` as seconds, if it is one of `allowed`; `BatchError` otherwise."""
    if window is None:
        raise BatchError(
            400,
            "missing `completion_window` (24h)",
            "missing_required_parameter",
            "completion_window",
        )
    m = _WINDOW.match(window) if isinstance(window, str) else None
    if window not in allowed or not m:
        raise BatchError(
            400,
            f"completion_window must be {' or '.join(allowed)}; got {window!r} "
            "(batch.completion_windows lists the windows offered)",
            "invalid_value",
            "completion_window",
        )
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def metadata_of(metadata: Any) -> dict[str, str] | None:
    """`metadata` if it is within OpenAI's bounds (`BatchError` otherwise)."""
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > _META_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= _META_KEY
            and len(v) <= _META_VALUE
            for k, v in metadata.items()
        )
    ):
        raise BatchError(
            400,
            f"metadata must be at most {_META_PAIRS} pairs of strings, keys up to {_META_KEY} "
            f"characters and values up to {_META_VALUE}",
            "invalid_value",
            "metadata",
        )
    return metadata
