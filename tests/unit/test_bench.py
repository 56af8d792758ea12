"""`corral bench`'s arithmetic: percentiles, a point's summary, and --tune's choice."""

from __future__ import annotations

from corral.bench.loadgen import Point, Sample, percentile, tune


def test_percentiles_interpolate_and_are_none_without_values() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 95) == 95.0


def point(concurrency: int, e2e_s: list[float], elapsed_s: float, errors: int = 0) -> Point:
    samples = [
        Sample("m", 0.0, first_s=x / 2, done_s=x, tokens=10, gaps_s=[0.01, 0.03]) for x in e2e_s
    ]
    samples += [Sample("m", 0.0, error="HTTP 503") for _ in range(errors)]
    return Point(f"concurrency {concurrency}", concurrency, None, samples, elapsed_s)


def test_a_points_summary_counts_only_completed_requests() -> None:
    row = point(2, [0.1, 0.2, 0.3, 0.4], elapsed_s=2.0, errors=1).summary()
    assert (row["requests"], row["completed"], row["errors"]) == (5, 4, 1)
    assert row["requests_per_s"] == 2.0
    assert row["output_tokens_per_s"] == 20.0
    assert row["e2e_p50_ms"] == 250.0
    assert row["ttft_p50_ms"] == 125.0
    assert row["itl_p50_ms"] == 20.0


def test_tune_takes_the_most_throughput_within_the_target_and_no_needless_waiting() -> None:
    one = point(1, [0.1] * 10, elapsed_s=1.0)  # 10 req/s, p95 100 ms
    four = point(4, [0.12] * 40, elapsed_s=1.0)  # 40 req/s, p95 120 ms
    eight = point(8, [0.24] * 41, elapsed_s=1.0)  # 41 req/s: no more throughput, twice the wait
    sixteen = point(16, [0.9] * 60, elapsed_s=1.0)  # 60 req/s but p95 900 ms
    broken = point(32, [0.1] * 80, elapsed_s=1.0, errors=3)
    points = [one, four, eight, sixteen, broken]
    assert tune(points, p95_ms=500) is four
    assert tune(points, p95_ms=1000) is sixteen
    assert tune(points, p95_ms=50) is None
