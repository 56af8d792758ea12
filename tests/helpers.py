"""Test doubles for the scheduler core (recorded effects, a hand-driven clock) and small helpers
for tests that run real processes."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import httpx

from corral.config import parse_config
from corral.core import Request, Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RecordedEffects:
    """Records every effect; `take()` returns and clears what happened since the last call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.timers: list[tuple[float, str]] = []

    def load(
        self,
        model: str,
        device: str,
        evict: Sequence[str],
        sleep: Sequence[str] = (),
        wake: bool = False,
        deep: Sequence[str] = (),
    ) -> None:
        if deep:
            self.calls.append(("load", model, tuple(evict), tuple(sleep), wake, tuple(deep)))
        elif sleep or wake:
            self.calls.append(("load", model, tuple(evict), tuple(sleep), wake))
        else:
            self.calls.append(("load", model, tuple(evict)))

    def unload(self, model: str, device: str) -> None:
        self.calls.append(("unload", model))

    def abort(self, model: str, device: str) -> None:
        self.calls.append(("abort", model))

    def dispatch(self, request: Request) -> None:
        self.calls.append(("dispatch", request.id))

    def reject(self, request: Request, reason: str) -> None:
        self.calls.append(("reject", request.id, reason))

    def set_timer(self, at_s: float, key: str) -> None:
        self.timers.append((at_s, key))

    def take(self) -> list[tuple[object, ...]]:
        out, self.calls = self.calls, []
        return out


class Harness:
    """A scheduler with recorded effects; requests are created by id like 'a1' -> model 'a'."""

    def __init__(self, yaml_text: str, policy: str | None = None) -> None:
        config = parse_config(yaml_text)
        if policy is not None:
            config = config.with_policy(policy)  # type: ignore[arg-type]
        self.clock = Clock()
        self.fx = RecordedEffects()
        self.s = Scheduler(config, self.fx, self.clock)
        self.requests: dict[str, Request] = {}

    def at(self, t: float) -> Harness:
        self.clock.t = t
        return self

    def arrive(
        self,
        rid: str,
        model: str | None = None,
        priority: int = 0,
        batch: bool = False,
        principal: str | None = None,
    ) -> Request:
        r = Request(rid, model or rid.rstrip("0123456789"), priority, batch, principal=principal)
        self.requests[rid] = r
        self.s.on_request(r)
        return r

    def loaded(self, model: str) -> None:
        self.s.on_load_finished(model)

    def finish(self, rid: str) -> None:
        self.s.on_request_finished(self.requests[rid])

    def timers_due(self) -> None:
        """Fire every timer due by now, in time order."""
        while True:
            due = sorted(t for t in self.fx.timers if t[0] <= self.clock.t)
            if not due:
                return
            self.fx.timers.remove(due[0])
            self.s.on_timer(due[0][1])

    def take(self) -> list[tuple[object, ...]]:
        return self.fx.take()


def alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_http_ok(url: str, timeout_s: float = 30.0) -> float:
    """Poll `url` until it answers 200; returns the seconds it took, or fails the test."""
    started = time.monotonic()
    # One client for every poll: a client per poll loads the CA bundle each time (tens of ms
    # of CPU), which on a busy machine starved the very server being waited for.
    with httpx.Client(timeout=1) as client:
        while time.monotonic() - started < timeout_s:
            with contextlib.suppress(httpx.TransportError):
                if client.get(url).status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.02)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s:g} s")


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A quiet HTTP handler for a test's own upstream: `answer(status, doc)` sends JSON."""

    def answer(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass
