"""Batched handlers: how a slot's claimed tasks become handler calls, and how one call's answer
becomes each task's outcome. Pure functions; the worker runs and commits them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corral.store import Task
from corral.worker.registry import Fail, HandlerSpec

Outcome = tuple[Any, BaseException | None]  # (result, error): error set means it failed


def calls(tasks: Sequence[Task], handlers: dict[str, HandlerSpec]) -> list[list[Task]]:
    """Group one slot's tasks into handler calls, in claim order of each kind's first task: a
    batched kind's tasks in lists of up to its `batch_size`, every other task alone."""
    by_kind: dict[str, list[Task]] = {}
    for t in tasks:
        by_kind.setdefault(t.kind, []).append(t)
    out: list[list[Task]] = []
    for kind, group in by_kind.items():
        spec = handlers.get(kind)
        size = spec.batch_size if spec is not None else 1
        if size > 1:
            out += [group[i : i + size] for i in range(0, len(group), size)]
        else:
            out += [[t] for t in group]
    return out


def outcomes(results: Any, n: int, kind: str) -> list[Outcome]:
    """Each payload's outcome from a batched handler's return value: one result per payload,
    in order; an exception instance fails its item alone. A return value of the wrong shape
    fails every item with a `Fail` (a retry would return the same shape)."""
    if not isinstance(results, list | tuple) or len(results) != n:
        got = (
            f"a {type(results).__name__} of {len(results)}"
            if isinstance(results, list | tuple)
            else f"{type(results).__name__}"
        )
        error = Fail(
            f"the batched handler for {kind!r} must return a list of {n} results, one per "
            f"payload in order (an exception instance for an item that failed); it returned {got}"
        )
        return [(None, error)] * n
    return [(None, r) if isinstance(r, BaseException) else (r, None) for r in results]
