"""The package's import graph has no cycle (issue 26): a room imports only the rooms after it.
Read from the source (every import, at any depth, typing-only ones included)."""

from __future__ import annotations

import pytest

from tests.support.architecture import cycles, import_graph, measure

pytestmark = pytest.mark.unit


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_corral_imports_itself_back() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    assert cycles(graph) == []


def test_the_gateway_imports_nothing_from_the_worker() -> None:
    """Issue 37: a request carries its own grant and the batch worker is composed in
    batch/runtime.py, so no gateway module routes by who submitted a request."""
    assert measure().gateway_imports_worker == []


def test_no_mixin_stack() -> None:
    assert measure().mixin_stacks == []
