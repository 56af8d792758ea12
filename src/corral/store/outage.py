"""Riding out a database outage: a dropped connection, a restart, a cut network path.

An operation that lost its connection is tried again on a fresh one, with backoff, for up to
the store's `patience_s`; then `StoreUnavailable`. Whether it may be tried again depends on
where the connection dropped:

- before the commit (getting a connection, any statement of a transaction before COMMIT): the
  database rolled it back, so trying again is always safe;
- during the commit, or during a statement that is its own transaction: it may have taken
  effect. Idempotent operations and writes fenced by a lease token run again (a fenced write
  that did land finds its lease gone, writes nothing and says so); an operation that is neither
  first runs its `resolve`, which looks for its own effect (a claim finds the tasks its nonce
  leased, an enqueue finds its task ids) and runs again only if there is none; the rest raise
  `StoreUnavailable` saying the effect is unknown.

One warning when the database becomes unreachable, one when it is back, whatever the number of
threads that noticed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from corral.store.base import StoreUnavailable

log = logging.getLogger("corral.store")
T = TypeVar("T")
P = ParamSpec("P")


class Lost(Exception):
    """The connection dropped under an operation (`maybe_done`: during its commit)."""

    def __init__(self, cause: BaseException, maybe_done: bool) -> None:
        # libpq's messages run over several lines: one line each in the log
        super().__init__(" ".join(str(cause).split()) or type(cause).__name__)
        self.maybe_done = maybe_done


class Guard(Protocol):
    """How a store runs one operation: `Outage.call` where connections drop, `unguarded`
    where they cannot (SQLite). Each operation says whether it is `idempotent` and how to
    `resolve` whether a try whose commit was lost took effect."""

    def __call__(
        self,
        op: str,
        fn: Callable[[], T],
        *,
        idempotent: bool = True,
        resolve: Callable[[], T | None] | None = None,
    ) -> T: ...


def unguarded(
    op: str,
    fn: Callable[[], T],
    *,
    idempotent: bool = True,
    resolve: Callable[[], T | None] | None = None,
) -> T:
    """Runs `fn` once: a database in this process has no connection to lose."""
    return fn()


class Guarded(Protocol):
    """An object whose operations run under its `_guard`."""

    _guard: Guard


G = TypeVar("G", bound=Guarded)


def guarded(method: Callable[Concatenate[G, P], T]) -> Callable[Concatenate[G, P], T]:
    """A method run under its object's guard, as the operation of its name: one that may run
    again, because it is idempotent, a read, or a write fenced by a lease token (one that
    landed before its connection dropped writes nothing the second time and returns what a
    lost lease does)."""

    @functools.wraps(method)
    def run(self: G, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._guard(method.__name__, lambda: method(self, *args, **kwargs))

    return run


class Outage:
    """Tries operations again through an outage of the database `name` (for the logs)."""

    def __init__(
        self,
        name: str,
        patience_s: float,
        first_delay_s: float = 0.05,
        max_delay_s: float = 1.0,
    ) -> None:
        self.name = name
        self.patience_s = patience_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._lock = threading.Lock()
        self.down_since: float | None = None  # monotonic; None while reachable
        self.last_error = ""
        self.outages = 0  # how many times it became unreachable

    def call(
        self,
        op: str,
        fn: Callable[[], T],
        *,
        idempotent: bool = True,
        resolve: Callable[[], T | None] | None = None,
    ) -> T:
        """`fn()`, tried again while its connection drops (see the module docstring)."""
        started = time.monotonic()
        delay = self.first_delay_s
        unknown = False  # the last try may have taken effect
        while True:
            try:
                if unknown and resolve is not None:
                    found = resolve()
                    if found is not None:
                        self._up()
                        return found
                out = fn()
            except Lost as lost:
                self._down(lost)
                if lost.maybe_done and not idempotent and resolve is None:
                    raise StoreUnavailable(
                        f"{self.name}: the connection dropped while committing {op} ({lost}); "
                        "it may or may not have taken effect: check before doing it again"
                    ) from None
                unknown = unknown or lost.maybe_done
                waited_s = time.monotonic() - started
                if waited_s + delay > self.patience_s:
                    raise StoreUnavailable(
                        f"{self.name} is unreachable ({lost}); gave up on {op} after "
                        f"{waited_s:.1f} s{' (it may have taken effect)' if unknown else ''}"
                    ) from None
                time.sleep(delay)
                delay = min(2 * delay, self.max_delay_s)
                continue
            self._up()
            return out

    def _down(self, lost: Lost) -> None:
        with self._lock:
            self.last_error = str(lost)
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
            self.outages += 1
        log.warning(
            "%s: connection lost (%s); trying again, for up to %g s per operation",
            self.name,
            lost,
            self.patience_s,
        )

    def _up(self) -> None:
        if self.down_since is None:  # the hot path: no lock
            return
        with self._lock:
            if self.down_since is None:
                return
            down_s = time.monotonic() - self.down_since
            self.down_since = None
        log.warning("%s: connected again after %.1f s", self.name, down_s)
