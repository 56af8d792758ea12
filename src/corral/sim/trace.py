"""Simulator traces: one JSON object per line, open loop (`t`) or closed loop (`session`).

Open loop:   {"t": 12.5, "model": "m", "service_s": 3.2, "priority": 0}
Closed loop: {"session": "agent-1", "think_s": 0.8, "model": "m", "service_s": 3.2}
A conversation: {"session": "agent-1", "model": "m", "service_s": 0.9, "context_tokens": 8200}
A line's `principal` names whose work it is (fair shares between principals: the weights are
the config's `server.principals`). A line's `class` is "interactive" (the default: someone
waits for it) or "batch" (background work, like a Batch API line); `priority` orders requests
inside their class.
A session's first request arrives at its `t` (default 0); each later one arrives `think_s` after
the session's previous request finished. A session's lines are in order.
`context_tokens` (a session's lines): the tokens of the prompt the request sends, its
conversation so far; its model's server processes what its prompt cache does not hold at the
model's `prefill_tok_s`, on top of `service_s` (sim/engine.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.errors import Problem, TraceError
from corral.limits import PRIORITY_MAX, PRIORITY_MIN

ALLOWED_KEYS = (
    "t", "session", "think_s", "model", "service_s", "priority", "class", "context_tokens",
    "principal",
)  # fmt: skip
CLASSES = ("interactive", "batch")
_MAX_PROBLEMS = 20


@dataclass(frozen=True, slots=True)
class TraceLine:
    line: int
    model: str
    service_s: float
    priority: int = 0
    t: float | None = None  # open loop: arrival time; closed loop: the session's start (first line)
    session: str | None = None
    think_s: float = 0.0
    background: bool = False  # the line's class: batch (background work), else interactive
    context_tokens: int = 0  # a conversation's prompt tokens (the session is the conversation)
    principal: str | None = None  # whose work it is (fair shares)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.session is not None:
            out["session"] = self.session
            if self.t is not None:
                out["t"] = self.t
            if self.think_s:
                out["think_s"] = self.think_s
        else:
            out["t"] = self.t
        out["model"] = self.model
        out["service_s"] = self.service_s
        if self.priority:
            out["priority"] = self.priority
        if self.background:
            out["class"] = "batch"
        if self.context_tokens:
            out["context_tokens"] = self.context_tokens
        if self.principal is not None:
            out["principal"] = self.principal
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    lines: list[TraceLine]
    source: str = "<trace>"

    @property
    def open_loop(self) -> bool:
        return all(x.session is None for x in self.lines)

    def write(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for x in self.lines:
                f.write(json.dumps(x.to_json()) + "\n")


def _number(
    obj: dict[str, object], key: str, problems: list[str], *, positive: bool = False
) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        problems.append(f"{key} must be a finite number; got {v!r}")
        return None
    if v < 0 or (positive and v == 0):
        problems.append(f"{key} must be {'> 0' if positive else '>= 0'}; got {v!r}")
        return None
    return float(v)


def _line(
    obj: dict[str, Any], lineno: int, known: set[str], sessions_seen: set[str], errs: list[str]
) -> TraceLine | None:
    """One line's request, or None with what is wrong with it added to `errs`."""
    allowed = set(ALLOWED_KEYS)
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        errs.append(
            f"unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"
            f" (allowed: {', '.join(ALLOWED_KEYS)})"
        )
    model = obj.get("model")
    if model is None:
        errs.append("missing key 'model'")
    elif not isinstance(model, str) or model not in known:
        errs.append(f"unknown model {model!r} (the config has: {', '.join(sorted(known))})")
    if "service_s" not in obj:
        errs.append("missing key 'service_s'")
    service_s = _number(obj, "service_s", errs, positive=True)
    t = _number(obj, "t", errs)
    think_s = _number(obj, "think_s", errs)
    priority = obj.get("priority", 0)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        errs.append(
            f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}; got {priority!r}"
        )
    context = obj.get("context_tokens", 0)
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= 1 << 24:
        errs.append(f"context_tokens must be an integer from 0 to {1 << 24}; got {context!r}")
    elif context and obj.get("session") is None:
        errs.append("context_tokens needs a 'session' (the conversation it belongs to)")
    principal = obj.get("principal")
    if principal is not None and (not isinstance(principal, str) or not 0 < len(principal) <= 64):
        errs.append(f"principal must be a name of 1 to 64 characters; got {principal!r}")
    klass = obj.get("class", "interactive")
    if klass not in CLASSES:
        errs.append(f"class must be 'interactive' or 'batch'; got {klass!r}")
    session = obj.get("session")
    if session is None:
        if "t" not in obj:
            errs.append("missing key 't' (open loop) or 'session' (closed loop)")
        if "think_s" in obj:
            errs.append("think_s needs a 'session'")
    elif not isinstance(session, str) or not session:
        errs.append(f"session must be a non-empty string; got {session!r}")
    elif session in sessions_seen and "t" in obj:
        errs.append(f"t is allowed only on session {session!r}'s first line")
    if errs:
        return None
    if isinstance(session, str):
        sessions_seen.add(session)
    assert isinstance(model, str)
    assert service_s is not None
    assert isinstance(priority, int)
    return TraceLine(
        lineno,
        model,
        service_s,
        priority,
        t,
        session if isinstance(session, str) else None,
        think_s or 0.0,
        klass == "batch",
        context if isinstance(context, int) else 0,
        principal if isinstance(principal, str) else None,
    )


def parse_trace(lines: Iterable[str], models: Collection[str], source: str = "<trace>") -> Trace:
    """Parse and validate trace lines; raise `TraceError` naming each bad line (first 20)."""
    out: list[TraceLine] = []
    problems: list[Problem] = []
    sessions_seen: set[str] = set()
    known = set(models)
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        errs: list[str] = []
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            errs.append(f"not valid JSON ({exc.msg} at column {exc.colno})")
            obj = None
        if obj is not None and not isinstance(obj, dict):
            errs.append("each line must be a JSON object")
        if isinstance(obj, dict):
            line = _line(obj, lineno, known, sessions_seen, errs)
            if line is not None:
                out.append(line)
        for e in errs:
            problems.append(Problem(source, lineno, "", e))
        if len(problems) >= _MAX_PROBLEMS:
            problems.append(Problem(source, None, "", "stopped after 20 problems"))
            break
    if problems:
        raise TraceError(problems)
    if not out:
        raise TraceError([Problem(source, None, "", "the trace has no requests")])
    return Trace(out, source)


def load_trace(path: str | Path, models: Collection[str]) -> Trace:
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            return parse_trace(f, models, str(p))
    except FileNotFoundError:
        raise TraceError([Problem(str(p), None, "", "no such file")]) from None
    except UnicodeDecodeError as exc:
        raise TraceError([Problem(str(p), None, "", f"not UTF-8 text ({exc.reason})")]) from None
