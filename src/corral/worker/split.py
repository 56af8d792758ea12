"""Adaptive split-on-failure: a list in one call; on failure, halves, down to single items.

Serial within a task (the protocol needs it: each half sees the same model state), and the
task commits once with every item's outcome. `_bisect` is the algorithm; the two drivers only
differ in how they call the handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

Span = tuple[int, int]
Outcome = tuple[bool, Any]  # (succeeded, the handler's results or its exception)


class AllItemsFailed(Exception):
    """Every item of a split task failed; the message holds the first error."""


def _bisect(items: list[Any]) -> Generator[Span, Outcome, dict[str, Any]]:
    """Yields the span to try next, receives its outcome; returns every item's outcome."""
    results: list[Any] = [None] * len(items)
    failed: dict[int, str] = {}
    stack = [(0, len(items))]
    while stack:
        lo, hi = stack.pop()
        ok, value = yield lo, hi
        if ok and (not isinstance(value, list) or len(value) != hi - lo):
            ok, value = (
                False,
                TypeError(
                    f"a split_on_failure handler must return one result per item ({hi - lo}); "
                    f"got {type(value).__name__}"
                ),
            )
        if ok:
            results[lo:hi] = value
        elif hi - lo == 1:
            failed[lo] = f"{type(value).__name__}: {value}"
        else:
            mid = (lo + hi) // 2
            stack += [(mid, hi), (lo, mid)]  # the left half first: items keep their order
    if len(failed) == len(items):
        raise AllItemsFailed(f"all {len(items)} items failed; item 0: {failed[0]}")
    return {"results": results, "failed": {str(i): e for i, e in sorted(failed.items())}}


def run_split(fn: Callable[[list[Any]], Any], items: list[Any]) -> dict[str, Any]:
    """The whole list, then halves of any part that fails, down to single items."""
    plan = _bisect(items)
    lo, hi = next(plan)
    while True:
        try:
            outcome: Outcome = (True, fn(items[lo:hi]))
        except Exception as exc:
            outcome = (False, exc)
        try:
            lo, hi = plan.send(outcome)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def run_split_async(
    fn: Callable[[list[Any]], Awaitable[Any]], items: list[Any]
) -> dict[str, Any]:
    """`run_split` for an async handler."""
    plan = _bisect(items)
    lo, hi = next(plan)
    while True:
        try:
            outcome: Outcome = (True, await fn(items[lo:hi]))
        except Exception as exc:
            outcome = (False, exc)
        try:
            lo, hi = plan.send(outcome)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
