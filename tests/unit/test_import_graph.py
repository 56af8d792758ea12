"""The package's import graph has no cycle (issue 26): a room imports only the rooms after it.
Read from the source (every import, at any depth, typing-only ones included)."""

from __future__ import annotations

from pathlib import Path

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


def test_no_stand_ins_no_value_or_response_and_parts_take_their_store_role() -> None:
    """Issue 37: the scheduler holds the worker's backlog (no stand-in requests); no function
    returns a value or an error response; at most three parameters take the whole `Store` (the
    worker, the Batch API's runtime and the CLI's maintenance compose the others)."""
    figs = measure()
    assert figs.stand_in_classes == []
    assert figs.or_response_returns == []
    assert len(figs.whole_store_params) <= 3, figs.whole_store_params


def test_no_module_function_or_class_over_its_size_bound() -> None:
    """Issue 37: no module over 600 lines, no function over 80, no class over 25 methods."""
    figs = measure()
    assert figs.long_modules == []
    assert figs.long_functions == []
    assert figs.big_classes == []


def test_the_figures_see_what_they_measure(tmp_path: Path) -> None:
    """The measure reads what it claims: a function returning `X | Response`, a stand-in class,
    a parameter typed as the whole `Store`, a mixin."""
    from tests.support import architecture

    src = tmp_path / "corral"
    src.mkdir()
    (src / "__init__.py").write_text("")
    (src / "bad.py").write_text(
        "class StandInThing: ...\n"
        "class Both(AMixin, B): ...\n"
        "def f(store: Store) -> int | Response: ...\n"
        + "class Big:\n"
        + "".join(f"    def m{i}(self) -> None: ...\n" for i in range(26))
        + "def long() -> None:\n"
        + "    x = 1\n" * 81
    )
    (src / "long.py").write_text("x = 1\n" * 601)
    old = architecture.SRC
    architecture.SRC = tmp_path
    try:
        figs = architecture.measure()
    finally:
        architecture.SRC = old
    assert [x.split()[-1] for x in figs.stand_in_classes] == ["StandInThing"]
    assert len(figs.mixin_stacks) == 1
    assert len(figs.whole_store_params) == 1
    assert len(figs.or_response_returns) == 1
    assert [x.split(":")[0].endswith("corral/long.py") for x in figs.long_modules] == [True]
    assert [x.split()[1] for x in figs.long_functions] == ["long:"]
    assert [x.split()[1] for x in figs.big_classes] == ["Big:"]
