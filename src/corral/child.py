"""A call run in a child process of its own, at a lower CPU priority: `Children`.

Work that is mostly Python (checking a 50,000-line batch file and storing its lines, reading
a folder's GGUF headers on a reload) holds the interpreter while it runs: in a thread of the
scheduler's process it delays every request, stream and `/health`, each of whose trips through
the event loop waits for the interpreter (docs/benchmarks.md, "The event loop"). Run in a
child, it costs the scheduler nothing but a core's share, and at `nice` it yields that to a
person's request.

Children start through multiprocessing's forkserver (never a fork of a process with threads),
so the function and its arguments are pickled: a function defined at module level (or a
`functools.partial` of one), and picklable arguments and result. One child per call: it ends
with its answer. `close` kills the running ones.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from corral.errors import CorralError

T = TypeVar("T")
_CONTEXT = multiprocessing.get_context("forkserver")


def preload(*modules: str) -> None:
    """Have the forkserver import `modules` once, so that each child starts with them (tenths
    of a second saved per call); effective only before the first child starts."""
    _CONTEXT.set_forkserver_preload(list(modules))


class ChildError(Exception):
    """What the call raised in its child: its message, its type's name, and whether it is one
    of the errors that name a problem for a person (`CorralError`, `ValueError`)."""

    def __init__(self, message: str, type_name: str, expected: bool) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.expected = expected


class ChildDied(RuntimeError):
    """The child ended without an answer (a kill, the OOM killer, `close`)."""


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nice: int,
    send: multiprocessing.connection.Connection,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is its parent's to handle
    with contextlib.suppress(OSError):
        os.nice(nice)
    try:
        answer: tuple[str, Any] = ("ok", fn(*args))
    except Exception as exc:
        expected = isinstance(exc, CorralError | ValueError)
        answer = ("error", (str(exc), type(exc).__name__, expected))
    send.send(answer)
    send.close()


class Children:
    """Calls in children named `name`, at `nice` below their parent; `call` blocks (call it
    from a thread, never on the event loop)."""

    def __init__(self, name: str, nice: int = 10) -> None:
        self.name = name
        self.nice = nice
        self._lock = threading.Lock()
        self._running: set[multiprocessing.process.BaseProcess] = set()
        self._closed = False

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a child; its result. ChildError with what it raised; ChildDied if
        it ended without an answer, or if `close` was called."""
        receive, send = _CONTEXT.Pipe(duplex=False)
        proc = _CONTEXT.Process(
            target=_run, args=(fn, args, self.nice, send), name=self.name, daemon=True
        )
        with self._lock:
            if self._closed:
                raise ChildDied(f"{self.name}: stopping")
            proc.start()
            self._running.add(proc)
        send.close()  # the child holds the other copy: EOF on ours if it dies
        try:
            kind, value = receive.recv()
        except EOFError:
            proc.join(5)
            raise ChildDied(
                f"{self.name}: its process ended without an answer (exit code {proc.exitcode})"
            ) from None
        finally:
            receive.close()
            proc.join(5)
            with self._lock:
                self._running.discard(proc)
            if proc.is_alive():
                proc.kill()
        if kind != "ok":
            raise ChildError(*value)
        result: T = value
        return result

    def running(self) -> list[int]:
        """The process ids of the calls running now."""
        with self._lock:
            return [p.pid for p in self._running if p.pid is not None]

    def close(self) -> None:
        """Kill the calls running now (each raises ChildDied) and start no more."""
        with self._lock:
            self._closed = True
            for proc in self._running:
                proc.kill()
