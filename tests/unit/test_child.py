"""`corral.child.Children`: a call in a child process at a lower priority, its result or what it
raised, a child that dies, and `close`."""

from __future__ import annotations

import os
import threading
import time

import pytest

from corral.child import ChildDied, ChildError, Children
from corral.errors import CorralError


def _where(x: int) -> tuple[int, int, int]:
    return x * 2, os.getpid(), os.nice(0)


def _bad_edit() -> None:
    raise CorralError("corral.yaml:3: models.m.cmd: field required")


def _bug() -> None:
    raise KeyError("nope")


def _sleep(s: float) -> None:
    time.sleep(s)


def test_a_call_runs_in_another_process_at_a_lower_priority() -> None:
    doubled, pid, nice = Children("t", nice=7).call(_where, 21)
    assert doubled == 42
    assert pid != os.getpid()
    assert nice == min(19, os.nice(0) + 7)


def test_what_the_call_raised_comes_back_named() -> None:
    kids = Children("t")
    with pytest.raises(ChildError) as bad:
        kids.call(_bad_edit)
    assert str(bad.value) == "corral.yaml:3: models.m.cmd: field required"
    assert (bad.value.type_name, bad.value.expected) == ("CorralError", True)
    with pytest.raises(ChildError) as bug:
        kids.call(_bug)
    assert (bug.value.type_name, bug.value.expected) == ("KeyError", False)


def test_a_child_that_dies_or_is_closed_raises_and_leaves_nothing() -> None:
    kids = Children("t")
    raised: list[BaseException] = []

    def call() -> None:
        try:
            kids.call(_sleep, 60)
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 60
    while not kids.running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (pid,) = kids.running()
    kids.close()
    t.join(30)
    assert len(raised) == 1
    assert isinstance(raised[0], ChildDied)
    assert "ended without an answer" in str(raised[0])
    assert kids.running() == []
    with pytest.raises(ProcessLookupError):  # gone, not a zombie left behind
        os.kill(pid, 0)
    with pytest.raises(ChildDied, match="stopping"):
        kids.call(_where, 1)
