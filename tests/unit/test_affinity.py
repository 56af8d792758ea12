"""Model affinity in a cluster of workers (worker/affinity.py): each worker applies the same rule
to the same table, so that every model is shown to exactly one worker until its backlog is worth
a second copy."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from corral.rendezvous import rendezvous
from corral.store import Residency
from corral.worker.affinity import ModelView, shown

MODELS = ["m0", "m1", "m2", "m3"]
WORKERS = [f"w{i}" for i in range(8)]


def views(waiting: int = 100, task_s: float = 0.05, load_s: float = 0.2) -> dict[str, ModelView]:
    return {m: ModelView(waiting, load_s, task_s) for m in MODELS}


def held(*pairs: tuple[str, str]) -> list[Residency]:
    return [Residency(w, "gpu0", m, "ready", 0.0) for w, m in pairs]


def everyone(workers: list[str]) -> dict[str, list[str]]:
    return {w: list(MODELS) for w in workers}


@given(st.integers(min_value=1, max_value=8))
def test_nobody_holding_anything_each_model_goes_to_exactly_one_worker(n: int) -> None:
    workers = WORKERS[:n]
    got = {w: shown(w, views(), set(), everyone(workers), []) for w in workers}
    for m in MODELS:
        assert sum(m in s for s in got.values()) == 1, (m, got)
        assert m in got[rendezvous(m, workers) or ""]


def test_a_busy_worker_leaves_unheld_models_to_free_ones() -> None:
    live = everyone(WORKERS[:3])
    # w_winner of m1 among all three, once it holds m0 (with work), is busy: another takes m1.
    winner = rendezvous("m1", WORKERS[:3])
    assert winner is not None
    table = held((winner, "m0"))
    got = {w: shown(w, views(), {"m0"} if w == winner else set(), live, table) for w in live}
    assert "m1" not in got[winner]
    assert sum("m1" in s for s in got.values()) == 1
    assert got[winner] == {"m0"}


def test_a_second_copy_only_for_a_backlog_worth_it_and_only_from_a_free_worker() -> None:
    live = everyone(["a", "b", "c", "d", "e"])
    table = held(("a", "m0"), ("b", "m1"), ("c", "m2"), ("d", "m3"))
    # e is free. A small backlog (2 tasks x 50 ms per copy) is not worth a 0.2 s load ...
    assert shown("e", views(waiting=4), set(), live, table) == set()
    # ... a large one is: e takes a second copy of the model with the most work per copy.
    v = views(waiting=100)
    v["m2"] = ModelView(400, 0.2, 0.05)
    assert shown("e", v, set(), live, table) == {"m2"}
    # A busy holder never takes another model's copy (it would evict work).
    assert shown("a", v, {"m0"}, live, table) == {"m0"}


def test_models_nobody_holds_come_before_second_copies() -> None:
    live = everyone(["a", "b"])
    table = held(("a", "m0"))
    v = {"m0": ModelView(1000, 0.2, 0.05), "m1": ModelView(5, 0.2, 0.05)}
    assert shown("b", v, set(), live, table) == {"m1"}


def test_a_dead_workers_rows_are_not_in_the_table_so_its_model_is_nobodys() -> None:
    """The caller passes fresh rows only; with the dead worker's gone, m0 is unheld again."""
    live = everyone(["a", "b"])
    got = {w: shown(w, views(), set(), live, []) for w in live}
    assert sum("m0" in s for s in got.values()) == 1
