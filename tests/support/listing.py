"""What a running `corral serve` lists, and waiting for a watched change to show there."""

from __future__ import annotations

import time

import httpx


def model_ids(url: str) -> list[str]:
    """The ids `/v1/models` lists, sorted."""
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"])


def wait_for_ids(url: str, want: list[str], timeout_s: float) -> None:
    """Until `/v1/models` lists exactly `want` (a reload under `--watch`), or fail the test."""
    deadline = time.monotonic() + timeout_s
    while (got := model_ids(url)) != want:
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
