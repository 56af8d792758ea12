"""Each principal's limits on its model calls: how many may start per minute, how many may be
in flight (queued or being answered) and how many may wait for their model at once. Pure: the
clock is given. The gateway's admission (`Turns.submit`) asks `Quotas.enter` for a `Ticket` per
call and holds it until the call ends; a call over a limit is `OverLimit`, with when to retry.

Requests per minute is a token bucket (`requests_per_minute` tokens, refilled at that rate):
bursts up to the limit, then one call per 60/limit seconds. A refused call takes nothing.
Tokens per minute is a bucket of model tokens (input and output, the server's counts) refilled
at `tokens_per_minute` a minute: a call's tokens are known when it ends (`Ticket.spent`), so a
call may take the bucket below empty, and calls are refused until it refills above empty."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """A principal's limits; None: unlimited."""

    requests_per_minute: int | None = None
    in_flight: int | None = None
    queued: int | None = None
    tokens_per_minute: int | None = None

    def __bool__(self) -> bool:
        return any(
            x is not None
            for x in (
                self.requests_per_minute,
                self.in_flight,
                self.queued,
                self.tokens_per_minute,
            )
        )


NO_LIMITS = Limits()


class OverLimit(Exception):
    """A call over one of its principal's limits: `limit` names it, `retry_after_s` says when
    a retry may pass (at least 1 s)."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = max(1, math.ceil(retry_after_s))


@dataclass
class _Account:
    in_flight: int = 0
    queued: int = 0
    tokens: float = 0.0
    filled_at: float = 0.0
    model_tokens: float = 0.0  # the tokens-per-minute bucket (below 0: spent ahead)
    model_filled_at: float = 0.0
    tokens_per_minute: int | None = None

    def refill(self, now: float) -> None:
        tpm = self.tokens_per_minute
        if tpm is not None:
            gained = (now - self.model_filled_at) * tpm / 60.0
            self.model_tokens = min(float(tpm), self.model_tokens + gained)
            self.model_filled_at = now


class Ticket:
    """One admitted call's hold on its principal's counts: `started` when its turn comes,
    `spent` with its tokens, `close` when it ends (each idempotent)."""

    __slots__ = ("_account", "_clock", "_closed", "_spent", "_started")

    def __init__(self, account: _Account, clock: Callable[[], float]) -> None:
        self._account = account
        self._clock = clock
        self._started = False
        self._closed = False
        self._spent = False

    def spent(self, tokens: int) -> None:
        """The call used `tokens` model tokens (input and output): its tokens per minute."""
        a = self._account
        if self._spent or a.tokens_per_minute is None:
            return
        self._spent = True
        a.refill(self._clock())
        a.model_tokens -= max(0, tokens)

    def started(self) -> None:
        if not self._started and not self._closed:
            self._started = True
            self._account.queued -= 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._account.in_flight -= 1
            if not self._started:
                self._account.queued -= 1


class Quotas:
    """The counts of every principal with limits, by name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._accounts: dict[str, _Account] = {}

    def enter(self, name: str, limits: Limits) -> Ticket | None:
        """A ticket for a call by principal `name` under `limits` (None when it has none), or
        `OverLimit` naming the limit it is over."""
        if not limits:
            return None
        a = self._accounts.get(name)
        if a is None:
            now = self.clock()
            tpm = limits.tokens_per_minute
            a = self._accounts[name] = _Account(
                tokens=float(limits.requests_per_minute or 0),
                filled_at=now,
                model_tokens=float(tpm or 0),
                model_filled_at=now,
            )
        a.tokens_per_minute = limits.tokens_per_minute
        if a.tokens_per_minute is not None:
            a.refill(self.clock())
            if a.model_tokens <= 0:
                wait_s = (1.0 - a.model_tokens) * 60.0 / a.tokens_per_minute
                why = (
                    f"{name} has used {a.tokens_per_minute} tokens this minute "
                    "(its tokens_per_minute)"
                )
                raise OverLimit(why, "tokens_per_minute", wait_s)
        if limits.in_flight is not None and a.in_flight >= limits.in_flight:
            why = f"{name} has {a.in_flight} requests in flight (its in_flight limit)"
            raise OverLimit(why, "in_flight", 1.0)
        if limits.queued is not None and a.queued >= limits.queued:
            why = f"{name} has {a.queued} requests waiting for a model (its queued limit)"
            raise OverLimit(why, "queued", 1.0)
        rpm = limits.requests_per_minute
        if rpm is not None:
            now = self.clock()
            a.tokens = min(float(rpm), a.tokens + (now - a.filled_at) * rpm / 60.0)
            a.filled_at = now
            if a.tokens < 1.0:
                wait_s = (1.0 - a.tokens) * 60.0 / rpm
                why = f"{name} has made {rpm} requests this minute (its requests_per_minute)"
                raise OverLimit(why, "requests_per_minute", wait_s)
            a.tokens -= 1.0
        a.in_flight += 1
        a.queued += 1
        return Ticket(a, self.clock)

    def counts(self, name: str) -> tuple[int, int]:
        """(in flight, queued) of principal `name`."""
        a = self._accounts.get(name)
        return (a.in_flight, a.queued) if a is not None else (0, 0)
