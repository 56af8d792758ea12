"""A principal's limits on its model calls: the token bucket of requests per minute, calls in
flight and calls queued; a refused call takes nothing."""

from __future__ import annotations

import pytest

from corral.access.limits import Limits, OverLimit, Quotas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_bursts_to_the_limit_then_refills_at_its_rate() -> None:
    clock = Clock()
    q = Quotas(clock)
    rpm = Limits(requests_per_minute=6)  # one every 10 s once the burst is spent
    tickets = [q.enter("a", rpm) for _ in range(6)]
    with pytest.raises(OverLimit) as over:
        q.enter("a", rpm)
    assert over.value.limit == "requests_per_minute"
    assert over.value.retry_after_s == 10
    for t in tickets:
        assert t is not None
        t.close()
    clock.now += 4.0
    with pytest.raises(OverLimit) as over:
        q.enter("a", rpm)  # a refused call took nothing: 6 s still to wait
    assert over.value.retry_after_s == 6
    clock.now += 6.0
    assert q.enter("a", rpm) is not None
    assert q.enter("b", rpm) is not None  # each principal its own bucket


def test_in_flight_and_queued_count_until_the_turn_and_the_end() -> None:
    q = Quotas(Clock())
    both = Limits(in_flight=2, queued=1)
    first = q.enter("a", both)
    assert first is not None
    with pytest.raises(OverLimit, match="waiting for a model") as over:
        q.enter("a", both)
    assert over.value.limit == "queued"
    first.started()
    first.started()  # idempotent
    second = q.enter("a", both)
    assert second is not None
    assert q.counts("a") == (2, 1)
    with pytest.raises(OverLimit, match="in flight"):
        q.enter("a", both)
    second.close()  # left the queue without its turn
    second.close()
    assert q.counts("a") == (1, 0)
    first.close()
    assert q.counts("a") == (0, 0)


def test_a_principal_without_limits_holds_nothing() -> None:
    q = Quotas(Clock())
    assert q.enter("a", Limits()) is None
    assert q.counts("a") == (0, 0)


def test_tokens_per_minute_counts_each_calls_tokens_when_it_ends() -> None:
    clock = Clock()
    q = Quotas(clock)
    tpm = Limits(tokens_per_minute=600)  # 10 tokens a second
    first = q.enter("a", tpm)
    second = q.enter("a", tpm)  # admitted: nothing spent yet
    assert first is not None
    assert second is not None
    first.spent(500)
    first.spent(500)  # told twice, counted once
    first.close()
    third = q.enter("a", tpm)  # 100 left
    assert third is not None
    second.spent(400)  # the bucket is 300 below empty: spent ahead
    with pytest.raises(OverLimit) as over:
        q.enter("a", tpm)
    assert over.value.limit == "tokens_per_minute"
    assert over.value.retry_after_s == 31  # (300 + 1) tokens at 10 a second
    clock.now += 31
    assert q.enter("a", tpm) is not None
    assert q.enter("b", tpm) is not None  # each principal its own bucket
