"""Sync handlers that can be stopped: each call runs in a child process the worker can kill.

A Python thread cannot be stopped from outside, so a sync handler with `timeout_s` runs in a
process of its own, started through multiprocessing's forkserver (never a fork of the worker,
whose threads may hold locks). Its timeout and its cancellation then really end it, within a
tenth of a second. The price: the function is pickled by reference, so it must be defined at
module level, and each call costs a process start (milliseconds; the forkserver has the
modules imported).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from typing import Any

from corral.worker.registry import Fail, Handler, TaskContext, _current


class HandlerTimeout(Exception):
    """The handler ran past its `timeout_s` and was stopped."""


class HandlerCancelled(Exception):
    """The task was cancelled and its handler's process stopped."""


class HandlerDied(Exception):
    """The handler's process ended without an answer (a crash, the OOM killer)."""


_CONTEXT = multiprocessing.get_context("forkserver")
# A handler's `timeout_s` counts from when it begins in its process: the process's start (the
# handler's module imported there, seconds on a busy machine) is bounded apart, by this.
START_LIMIT_S = 60.0


def run(fn: Handler, payload: Any, ctx: TaskContext, timeout_s: float | None) -> Any:
    """`fn(payload)` in a child process; its result, or its exception (`Fail` stays `Fail`;
    others become RuntimeError with the original type and message). HandlerTimeout once it has
    run `timeout_s` (from when it began, its process started), HandlerDied if its process does
    not begin it within `START_LIMIT_S`, HandlerCancelled once `ctx.cancelled`; each kills the
    process."""
    receive, send = _CONTEXT.Pipe(duplex=False)
    info = (ctx.task_id, ctx.attempt, ctx.max_attempts, ctx.model)
    proc = _CONTEXT.Process(target=_child, args=(fn, payload, info, send), daemon=True)
    started = time.monotonic()
    began: float | None = None
    proc.start()
    send.close()  # the child holds the other copy: EOF on ours when it exits
    try:
        while True:
            if receive.poll(0.1):
                try:
                    kind, value = receive.recv()
                except EOFError:
                    proc.join(1)
                    raise HandlerDied(
                        f"the handler's process died (exit code {proc.exitcode})"
                    ) from None
                if kind != "began":
                    break
                began = time.monotonic()
            if ctx.cancelled:
                raise HandlerCancelled("cancelled: its handler's process was stopped")
            now = time.monotonic()
            if timeout_s is not None and began is not None and now - began > timeout_s:
                raise HandlerTimeout(f"the handler ran past its timeout_s of {timeout_s:g} s")
            if began is None and now - started > START_LIMIT_S:
                raise HandlerDied(f"the handler's process did not start it in {START_LIMIT_S:g} s")
            if not proc.is_alive() and not receive.poll(0):
                raise HandlerDied(f"the handler's process died (exit code {proc.exitcode})")
    finally:
        receive.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        proc.close()
    if kind == "ok":
        return value
    if kind == "fail":
        raise Fail(value)
    raise RuntimeError(value)


def _child(
    fn: Handler,
    payload: Any,
    info: tuple[str, int, int, str],
    send: multiprocessing.connection.Connection,
) -> None:
    _current.set(TaskContext(*info))
    send.send(("began", None))  # its timeout counts from here
    try:
        result = fn(payload)
    except Fail as exc:
        send.send(("fail", str(exc)))
    except Exception as exc:
        send.send(("error", f"{type(exc).__name__}: {exc}"))
    else:
        send.send(("ok", result))
    send.close()
