"""Adaptive split-on-failure: a list in one call; on failure, halves, down to single items.

Serial within a task (the protocol needs it: each half sees the same model state), and the
task commits once with every item's outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class AllItemsFailed(Exception):
    """Every item of a split task failed; the message holds the first error."""


def _check(items: list[Any], results: Any) -> list[Any]:
    if not isinstance(results, list) or len(results) != len(items):
        raise TypeError(
            f"a split_on_failure handler must return one result per item ({len(items)}); "
            f"got {type(results).__name__}"
        )
    return results


def _outcome(results: list[Any], failed: dict[int, str]) -> dict[str, Any]:
    if len(failed) == len(results):
        raise AllItemsFailed(f"all {len(results)} items failed; item 0: {failed[0]}")
    return {"results": results, "failed": {str(i): e for i, e in sorted(failed.items())}}


def run_split(fn: Callable[[list[Any]], Any], items: list[Any]) -> dict[str, Any]:
    """The whole list, then halves of any part that fails, down to single items."""
    results: list[Any] = [None] * len(items)
    failed: dict[int, str] = {}
    stack = [(0, len(items))]
    while stack:
        lo, hi = stack.pop()
        try:
            results[lo:hi] = _check(items[lo:hi], fn(items[lo:hi]))
        except Exception as exc:
            if hi - lo == 1:
                failed[lo] = f"{type(exc).__name__}: {exc}"
            else:
                mid = (lo + hi) // 2
                stack += [(mid, hi), (lo, mid)]  # the left half first: items keep their order
    return _outcome(results, failed)


async def run_split_async(
    fn: Callable[[list[Any]], Awaitable[Any]], items: list[Any]
) -> dict[str, Any]:
    """`run_split` for an async handler."""
    results: list[Any] = [None] * len(items)
    failed: dict[int, str] = {}
    stack = [(0, len(items))]
    while stack:
        lo, hi = stack.pop()
        try:
            results[lo:hi] = _check(items[lo:hi], await fn(items[lo:hi]))
        except Exception as exc:
            if hi - lo == 1:
                failed[lo] = f"{type(exc).__name__}: {exc}"
            else:
                mid = (lo + hi) // 2
                stack += [(mid, hi), (lo, mid)]
    return _outcome(results, failed)
