"""Adaptive split-on-failure, pure: halves until the failing items stand alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corral.worker.split import AllItemsFailed, run_split, run_split_async


def make(bad: set[str]) -> tuple[list[list[str]], Any]:
    calls: list[list[str]] = []

    def fn(items: list[str]) -> list[str]:
        calls.append(list(items))
        if bad & set(items):
            raise ValueError(f"bad in {items}")
        return [x.upper() for x in items]

    return calls, fn


def test_no_failure_is_one_call() -> None:
    calls, fn = make(set())
    assert run_split(fn, ["a", "b", "c"]) == {"results": ["A", "B", "C"], "failed": {}}
    assert calls == [["a", "b", "c"]]


def test_one_bad_item_is_isolated_and_the_rest_kept() -> None:
    calls, fn = make({"c"})
    out = run_split(fn, list("abcdefgh"))
    assert out["results"] == ["A", "B", None, "D", "E", "F", "G", "H"]
    assert out["failed"] == {"2": "ValueError: bad in ['c']"}
    # whole list, left half, right half, then halving the left half down to "c"
    assert calls == [
        list("abcdefgh"),
        list("abcd"),
        list("ab"),
        list("cd"),
        ["c"],
        ["d"],
        list("efgh"),
    ]


def test_every_item_failing_fails_the_task() -> None:
    _, fn = make({"a", "b"})
    with pytest.raises(AllItemsFailed, match="all 2 items failed; item 0: ValueError"):
        run_split(fn, ["a", "b"])


def test_a_handler_must_return_one_result_per_item() -> None:
    with pytest.raises(AllItemsFailed, match="must return one result per item"):
        run_split(lambda items: "not a list", ["a"])


def test_async_handlers_split_the_same_way() -> None:
    async def fn(items: list[int]) -> list[int]:
        if 3 in items:
            raise RuntimeError("three")
        return [i * 10 for i in items]

    out = asyncio.run(run_split_async(fn, [1, 2, 3, 4]))
    assert out == {"results": [10, 20, None, 40], "failed": {"2": "RuntimeError: three"}}
