"""The package's import graph has no cycle: a room imports only the rooms after it.
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
    """A request carries its own grant and the batch worker is composed in
    batch/attached.py, so no gateway module routes by who submitted a request."""
    assert measure().gateway_imports_worker == []


def test_no_mixin_stack() -> None:
    assert measure().mixin_stacks == []


def test_no_stand_ins_no_value_or_response_and_parts_take_their_store_role() -> None:
    """The scheduler holds the worker's backlog (no stand-in requests); no function
    returns a value or an error response; at most three parameters take the whole `Store` (the
    worker, the Batch API's runtime and the CLI's maintenance compose the others)."""
    figs = measure()
    assert figs.stand_in_classes == []
    assert figs.or_response_returns == []
    assert len(figs.whole_store_params) <= 3, figs.whole_store_params


def test_no_module_function_or_class_over_its_size_bound() -> None:
    """No module over 600 lines, no function over 80, no class over 25 methods."""
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


def _room(module: str) -> str:
    """The room a module lives in: its folder under `corral` (the gateway's sub-packages are
    rooms of their own), or `corral` for a top-level module."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "gateway":
        return f"gateway.{parts[2]}"
    return parts[1] if len(parts) > 1 else "corral"


def room_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(room, room it imports) for every import that crosses rooms."""
    return {(_room(m), _room(d)) for m, deps in graph.items() for d in deps if _room(m) != _room(d)}


def test_no_two_rooms_import_each_other() -> None:
    edges = room_edges(import_graph())
    assert ("gateway.doors", "gateway.pipeline") in edges  # the rooms were told apart
    assert sorted((a, b) for a, b in edges if (b, a) in edges) == []


def test_the_gateway_layers_import_only_downward() -> None:
    """relays -> doors -> pipeline -> servers: a relay process passes requests on and carries
    granted answers, a door parses and answers, the pipeline carries a call, the server side
    runs the model servers; none reaches up a layer."""
    order = {"gateway.relays": -1, "gateway.doors": 0, "gateway.pipeline": 1, "gateway.servers": 2}
    upward = [
        (a, b)
        for a, b in room_edges(import_graph())
        if a in order and b in order and order[b] < order[a]
    ]
    assert upward == []


def test_config_and_backends_stay_leaves_of_what_they_describe() -> None:
    """The configuration imports none of the parts it configures, and `backends/` (what starts
    and talks to a model server) imports neither the servers Corral ships nor the prompt cache."""
    edges = room_edges(import_graph())
    config_out = sorted(b for a, b in edges if a == "config")
    assert not {"gateway.doors", "gateway.pipeline", "gateway.servers", "modelfiles", "store",
                "llamaswap", "compose"} & set(config_out), config_out  # fmt: skip
    backends_out = sorted(b for a, b in edges if a == "backends")
    assert "bundled" not in backends_out, backends_out
    assert "prompt_cache" not in backends_out, backends_out


def test_room_edges_see_a_pair_of_rooms_importing_each_other() -> None:
    graph = {"corral.a.x": {"corral.b.y"}, "corral.b.y": {"corral.a.z"}, "corral.a.z": set()}
    edges = room_edges(graph)
    assert ("a", "b") in edges
    assert ("b", "a") in edges
