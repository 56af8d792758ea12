"""The worker's claim buffer (`worker/buffer.py`): which claimed-ahead tasks a slot takes, in
which order, and what goes back to the store."""

from __future__ import annotations

import dataclasses

import pytest

from corral.store import NewTask, Task
from corral.store.memory import MemoryStore
from corral.worker.buffer import ClaimBuffer, Mark

pytestmark = pytest.mark.unit


def reserved(n: int) -> list[Task]:
    store = MemoryStore()
    store.enqueue_many([NewTask("k", "m", {"i": i}) for i in range(n)])
    return store.claim("m", "w", limit=n, lease_s=30, start=0)


def ids(xs: list[Task]) -> list[object]:
    return [t.payload["i"] for t in xs]


def test_a_slot_takes_the_oldest_first_and_skips_those_a_commit_is_starting() -> None:
    buf = ClaimBuffer()
    buf.add("m", reserved(5), claimed_at=100.0)
    (first,) = buf.next_to_start("m", 1)  # a commit is writing task 0's start mark
    assert first.mark is Mark.STARTING
    taken, stale = buf.take("m", 2, fresh_after=50.0)
    assert (ids([a.task for a in taken]), stale) == ([1, 2], [])
    buf.started([first])
    taken, _ = buf.take("m", 9, fresh_after=50.0)
    assert ids([a.task for a in taken]) == [0, 3, 4]  # once started, it is taken (first)
    assert taken[0].mark is Mark.STARTED
    assert taken[0].task.attempts == 1  # as its start mark left it
    assert not buf.holding("m")


def test_once_one_task_is_too_old_the_whole_buffer_goes_back_in_order() -> None:
    """Giving back only the old ones let a fresher task run first (FIFO broken on a loaded
    machine); the claim after the give-back takes them all again, in order."""
    buf = ClaimBuffer()
    tasks = reserved(4)
    buf.add("m", tasks[:2], claimed_at=10.0)
    buf.add("m", tasks[2:], claimed_at=90.0)
    taken, stale = buf.take("m", 1, fresh_after=50.0)
    assert taken == []
    assert ids([a.task for a in stale]) == [0, 1, 2, 3]
    assert buf.empty()


def test_a_task_that_must_run_alone_is_never_started_by_a_commit() -> None:
    buf = ClaimBuffer()
    a, b, c = reserved(3)
    buf.add("m", [dataclasses.replace(a, run_alone=True), b, c], claimed_at=1.0)
    nxt = buf.next_to_start("m", 2)
    assert ids([x.task for x in nxt]) == [1, 2]
    buf.unstart(nxt)  # the commit failed: reserved again
    assert all(x.mark is Mark.RESERVED for x in nxt)


def test_dropping_a_model_gives_back_all_but_those_starting() -> None:
    buf = ClaimBuffer()
    buf.add("m", reserved(3), claimed_at=1.0)
    (starting,) = buf.next_to_start("m", 1)
    gone = buf.drop("m")
    assert ids([a.task for a in gone]) == [1, 2]
    assert starting.drop  # its commit gives it back once its mark lands
    assert buf.levels("m") == {}
