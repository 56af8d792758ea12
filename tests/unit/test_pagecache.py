"""Loads priced by the page cache: the estimates' warm and cold figures, the
scheduler's choice between a cached and a cold model, the simulator's page cache, and the
live measure (`mincore`) over real files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from corral.config import Config, parse_config
from corral.core import Lifecycle, Scheduler
from corral.core.estimates import Estimates
from corral.modelfiles.mincore import cached, drop, parts, resident_bytes
from corral.sim.engine import Simulation, simulate
from corral.sim.pagecache import SimPageCache
from corral.sim.trace import Trace, TraceLine
from tests.helpers import Harness

pytestmark = pytest.mark.unit


def parse(doc: dict[str, object]) -> Config:
    return parse_config(json.dumps(doc))


def estimates(load_s: float = 5.0, cold_load_s: float | None = None) -> Estimates:
    config = parse({"models": {"a": {"load_s": load_s, "cold_load_s": cold_load_s}}})
    return Estimates(config.models["a"])


def test_a_load_is_priced_between_its_warm_and_cold_figures_by_the_fraction_cached() -> None:
    est = estimates(5.0, 25.0)
    assert est.load_s == 5.0  # never measured: priced as cached
    for fraction, price in [(0.0, 25.0), (0.5, 15.0), (1.0, 5.0)]:
        est.cached = fraction
        assert est.load_s == pytest.approx(price)
    no_cold = estimates(5.0)
    no_cold.cached = 0.0
    assert no_cold.load_s == 5.0  # no cold load seen nor configured: the measured loads'


def test_a_cold_load_sets_the_cold_figure_and_a_warm_one_refines_the_warm_figure() -> None:
    est = estimates(5.0)
    est.cached = 0.0
    est.load_begins()
    est.cached = 1.0  # the load read the file in: measured after it began
    est.observe_swap(30.0, None)
    assert est.cold_load_s == 30.0  # the first cold load, outright
    assert est.warm_load_s == 5.0
    est.load_begins()
    est.observe_swap(7.0, None)
    assert est.warm_load_s == 7.0  # the first warm load replaces the configured guess
    assert est.cold_load_s == 30.0
    est.load_begins()
    est.observe_swap(8.0, None)
    assert 7.0 < est.warm_load_s < 8.0  # later ones refine it
    # Mostly cached (80%): the warm figure is read less the uncached share of the difference.
    warm = est.warm_load_s
    est.cached = 0.8
    est.load_begins()
    est.observe_swap(warm + 0.2 * (30.0 - warm), None)
    assert est.warm_load_s == pytest.approx(warm)
    # Mostly cold (20% cached): the cold figure, less the cached share of the warm one.
    est.cached = 0.2
    est.load_begins()
    est.observe_swap(0.2 * warm + 0.8 * 40.0, None)
    assert est.cold_load_s == pytest.approx(30.0 + 0.3 * 10.0)


def test_a_cold_load_below_a_guessed_warm_figure_brings_it_down() -> None:
    est = estimates(10.0)
    est.cached = 0.0
    est.load_begins()
    est.observe_swap(4.0, None)
    assert est.cold_load_s == 4.0
    assert est.warm_load_s == 4.0  # the guess was too high: a warm load is no slower
    est.cached = 1.0
    est.load_begins()
    est.observe_swap(2.0, None)
    assert est.warm_load_s == 2.0


def test_the_scheduler_measures_are_clamped_and_bad_ones_ignored() -> None:
    h = Harness("devices: [{name: d, memory_gb: 10}]\nmodels: {a: {memory_gb: 10}}")
    files = h.s.files
    assert files.cached("a") is None
    files.measured("a", 1.7)
    assert files.cached("a") == 1.0
    files.measured("a", -1)
    assert files.cached("a") == 0.0
    files.measured("a", math.nan)
    assert files.cached("a") == 0.0
    files.measured("nobody", 0.5)  # a model removed meanwhile: ignored
    assert files.cached("nobody") is None


TWO_WAITING = """
devices: [{name: d, memory_gb: 10}]
models:
  busy: {memory_gb: 10, load_s: 5}
  a: {memory_gb: 10, load_s: 5, cold_load_s: 100}
  b: {memory_gb: 10, load_s: 5, cold_load_s: 100}
scheduler: {max_wait_s: null}
"""


@pytest.mark.parametrize("cold", ["a", "b"])
def test_of_two_models_with_equal_work_the_one_whose_file_is_cached_loads_first(
    cold: str,
) -> None:
    h = Harness(TWO_WAITING)
    warm = "b" if cold == "a" else "a"
    h.s.files.measured(cold, 0.0)
    h.s.files.measured(warm, 1.0)
    h.at(0).arrive("busy1")
    h.loaded("busy")
    h.at(1).arrive(f"{cold}1")  # the cold one waits longer: arrival order would take it
    h.at(2).arrive(f"{warm}1")
    h.take()
    h.at(3).finish("busy1")
    loads = [c for c in h.take() if c[0] == "load"]
    assert loads[0][1] == warm
    assert h.s.models[warm].state is Lifecycle.LOADING


def test_the_simulated_page_cache_reads_what_is_missing_and_drops_the_least_recent() -> None:
    config = parse(
        {
            "host": {"page_cache_gb": 10, "disk_read_gb_s": 2},
            "models": {"a": {"file_gb": 6}, "b": {"file_gb": 6}, "c": {}},
        }
    )
    told: list[tuple[str, float]] = []
    pc = SimPageCache(config, lambda m, f: told.append((m, f)))
    assert told == [("a", 0.0), ("b", 0.0)]  # files start cold
    assert pc.load("a") == pytest.approx(3.0)  # 6 GB at 2 GB/s
    assert pc.fraction("a") == 1.0
    assert pc.load("b") == pytest.approx(3.0)
    # a is resident: held, so b gets only what is left beside it.
    assert pc.fraction("a") == 1.0
    assert pc.fraction("b") == pytest.approx(4 / 6)
    pc.leave("a")
    pc.leave("b")
    assert pc.load("a") == 0.0  # still cached
    pc.leave("a")
    assert pc.load("b") == pytest.approx(1.0)  # its missing 2 GB
    assert pc.fraction("b") == 1.0
    assert pc.fraction("a") == pytest.approx(4 / 6)  # a gave up 2 GB: least recently read
    assert told[-2:] == [("a", pytest.approx(4 / 6)), ("b", 1.0)]  # both told
    assert pc.cold_loads == 2
    assert pc.read_gb == pytest.approx(14.0)
    assert pc.fraction("c") == 1.0  # no file size: not modelled
    assert pc.load("c") == 0.0


def alternating(n: int, gap_s: float) -> Trace:
    return Trace(
        [TraceLine(i, "ab"[i % 2], 1.0, t=i * gap_s) for i in range(n)], source="alternating"
    )


def test_a_simulated_run_learns_each_models_cold_and_warm_loads() -> None:
    """Two 4 GB files, one device: with room for both files every load after the first two is
    warm; with room for one, every load is mostly cold. The scheduler learns both figures from what
    the simulator measured."""
    base = {
        "devices": [{"name": "d", "memory_gb": 10}],
        "models": {m: {"memory_gb": 10, "load_s": 2, "file_gb": 4} for m in "ab"},
        "scheduler": {"max_wait_s": None},
    }
    swaps = {}
    for room_gb in (10, 5):
        config = parse({**base, "host": {"page_cache_gb": room_gb, "disk_read_gb_s": 1}})
        run = simulate(config, alternating(12, 30.0), check=True)
        assert run.files is not None
        swaps[room_gb] = sum(run.swap_s.values())
        assert sum(run.loads.values()) == 12
        assert run.files.cold_loads == (2 if room_gb == 10 else 12)
    assert swaps[10] == pytest.approx(12 * 2 + 2 * 4 + 11 * 1.0)  # loads, reads, unloads
    # Room for 5 GB: each load keeps 1 GB of the other file, so reads 3 GB after the first two.
    assert swaps[5] == pytest.approx(12 * 2 + (4 + 4 + 10 * 3) + 11 * 1.0)
    config = parse({**base, "host": {"page_cache_gb": 10, "disk_read_gb_s": 1}})
    from corral.sim.engine import Simulation

    sim = Simulation(config, alternating(12, 30.0))
    sim.run()
    a = sim.scheduler.models["a"]
    assert a.est.cold_load_s == pytest.approx(6.0)  # 2 s + 4 GB at 1 GB/s
    assert a.est.warm_load_s == pytest.approx(2.0)
    assert a.est.cached == 1.0


def test_without_a_page_cache_budget_the_simulator_is_as_before() -> None:
    config = parse(
        {
            "devices": [{"name": "d", "memory_gb": 10}],
            "models": {m: {"memory_gb": 10, "load_s": 2, "file_gb": 4} for m in "ab"},
        }
    )
    run = simulate(config, alternating(6, 30.0))
    assert run.files is not None
    assert not run.files.enabled
    assert sum(run.swap_s.values()) == pytest.approx(6 * 2 + 5 * 1.0)


def written(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the kernel may drop them
    return path


def test_mincore_sees_a_file_dropped_and_read_back(tmp_path: Path) -> None:
    f = written(tmp_path / "m.gguf", 32 << 20)
    drop([f])
    cold = cached([f])
    assert cold is not None
    assert cold < 0.2
    f.read_bytes()
    warm = cached([f])
    assert warm is not None
    assert warm > 0.9
    got = resident_bytes(f)
    assert got is not None
    assert got[1] == 32 << 20
    assert cached([tmp_path / "missing.gguf"]) is None
    assert cached([]) is None
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert cached([empty]) is None


def test_a_measure_spans_windows_and_split_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import corral.modelfiles.mincore as pagecache

    monkeypatch.setattr(pagecache, "WINDOW_BYTES", 1 << 20)  # 8 windows over an 8 MiB file
    one = written(tmp_path / "big-00001-of-00002.gguf", 8 << 20)
    two = written(tmp_path / "big-00002-of-00002.gguf", 8 << 20)
    assert parts(two) == [one, two]
    assert parts(tmp_path / "plain.gguf") == [tmp_path / "plain.gguf"]
    drop([one, two])
    one.read_bytes()
    both = cached(parts(one))
    assert both is not None
    assert 0.4 < both < 0.6


def cycle(n: int, gap_s: float) -> Trace:
    return Trace([TraceLine(i, "abc"[i % 3], 1.0, t=i * gap_s) for i in range(n)], source="cycle")


def test_preparation_reads_the_predicted_file_in_while_the_device_serves_another() -> None:
    """Three 4 GB files in a loop, room for the resident model's file and one more: without
    preparation each load finds its file pushed out by the last one's; with it, the learned
    successor is read in while the device serves, and loads find it cached."""
    base: dict[str, object] = {
        "devices": [{"name": "d", "memory_gb": 10}],
        "host": {"page_cache_gb": 9, "disk_read_gb_s": 1},
        "models": {m: {"memory_gb": 10, "load_s": 2, "file_gb": 4} for m in "abc"},
    }
    runs = {}
    for prepare in (False, True):
        config = parse({**base, "scheduler": {"max_wait_s": None, "prepare": prepare}})
        sim = Simulation(config, cycle(30, 30.0), check=True)
        assert isinstance(sim.scheduler, Scheduler)
        runs[prepare] = (sim.run(), sim.scheduler)
    off, on = runs[False][0], runs[True][0]
    assert off.files is not None
    assert on.files is not None
    assert off.files.cold_loads == 30
    assert off.files.prepared_gb == 0
    assert on.files.cold_loads <= 7  # until each transition has been seen twice
    assert on.files.prepared_gb > 0
    # Without, each load reads 3 GB of its 4 (1 GB survives); with, none after the 7th.
    assert sum(on.swap_s.values()) == pytest.approx(sum(off.swap_s.values()) - 23 * 3)
    prediction = runs[True][1].files.prediction
    assert prediction.hits == 23  # every load from the 8th on
    assert prediction.misses == 0


def test_the_predictor_learns_transitions_and_counts_its_hits() -> None:
    h = Harness(
        "devices: [{name: d, memory_gb: 10}]\n"
        "models: {a: {memory_gb: 10}, b: {memory_gb: 10}, c: {memory_gb: 10}}\n"
    )
    files = h.s.files
    for i, rid in enumerate(["a1", "b1", "a2", "b2", "a3"]):
        h.at(i * 10).arrive(rid)
        if h.s.models[rid[0]].state is not Lifecycle.READY:
            h.loaded(rid[0])
        h.finish(rid)
    assert files.prediction.last == "a"
    assert files.prediction.next == {"b": 1.0}
    assert files.wanted(50) == ["b"]  # a is resident: b is what comes next
    hits = files.prediction.hits
    h.at(59).arrive("a4")  # served now: the device stays busy
    h.at(60).arrive("c1")  # not what was predicted
    assert files.prediction.misses == 1
    assert files.prediction.hits == hits
    # Waiting work comes first, ahead of any prediction.
    assert files.wanted(61)[0] == "c"


# docs/benchmarks.md, "Load modes": the 2-core VM, qwen3 zoo files, medians of two rounds.
MEASURED_LOAD_S = {  # (GB, mode) -> (cold, warm)
    (1, "mmap"): (1.07, 0.79), (1, "none"): (1.93, 1.45), (1, "dio"): (1.79, 1.89),
    (4, "mmap"): (6.48, 3.62), (4, "none"): (6.29, 4.99), (4, "dio"): (6.63, 9.22),
    (8, "mmap"): (15.41, 7.64), (8, "none"): (21.24, 16.82), (8, "dio"): (14.75, 25.51),
}  # fmt: skip


@pytest.mark.parametrize("gb", [1, 4, 8])
def test_the_load_mode_rule_keeps_what_was_measured(gb: int) -> None:
    """Cached: mmap (None, the server's default) loaded fastest at every size. Cold with room
    to stay cached: mmap, within 10% of the fastest cold mode (two rounds' noise), and the
    file stays cached. Cold without room: direct I/O, within 10% of the fastest cold mode (it
    leaves nothing cached, which costs nothing when nothing could stay)."""
    from corral.gateway.servers.file_cache import MARGIN_BYTES, load_mode_for

    size = gb * 10**9
    plenty = 4 * size + MARGIN_BYTES
    short = size // 2
    fastest_warm = min(MEASURED_LOAD_S[gb, m][1] for m in ("mmap", "none", "dio"))
    fastest_cold = min(MEASURED_LOAD_S[gb, m][0] for m in ("mmap", "none", "dio"))
    assert load_mode_for(1.0, size, plenty) is None
    assert load_mode_for(1.0, size, short) is None  # cached: no read to save memory on
    assert MEASURED_LOAD_S[gb, "mmap"][1] == fastest_warm
    assert load_mode_for(0.0, size, plenty) is None
    if gb >= 4:  # 1 GB: the fixed costs dominate, and mmap is fastest cold too
        assert MEASURED_LOAD_S[gb, "mmap"][0] <= 1.1 * fastest_cold
    assert load_mode_for(0.0, size, short) == "dio"
    if gb >= 4:
        assert MEASURED_LOAD_S[gb, "dio"][0] <= 1.1 * fastest_cold


def test_a_models_own_load_flags_or_env_win(tmp_path: Path) -> None:
    from corral.backends.process import ProcessBackend
    from corral.config import ModelConfig
    from corral.core.pagecache import PageCache
    from corral.gateway.servers.file_cache import Files
    from corral.gateway.servers.fleet import process_spec

    f = written(tmp_path / "m.gguf", 1 << 20)
    cache = PageCache({}, lambda ms, now: ms)
    cmds = {
        "plain": f"llama-server -m {f} --port ${{PORT}}",
        "flag": f"llama-server -m {f} --load-mode none --port ${{PORT}}",
        "eq": f"llama-server -m {f} --load-mode=mlock",
        "nommap": f"llama-server --no-mmap -m {f}",
    }
    backends = {
        n: ProcessBackend(process_spec(n, ModelConfig(cmd=c), c), tmp_path) for n, c in cmds.items()
    }
    env = ModelConfig(cmd=cmds["plain"], env={"LLAMA_ARG_LOAD_MODE": "none"})
    backends["env"] = ProcessBackend(process_spec("env", env, cmds["plain"]), tmp_path)
    files = Files(backends, lambda: cache, lambda: 0.0)
    files.fractions = dict.fromkeys(backends, 0.0)
    assert files.paths("plain") == [f]
    # Cold, and no memory for it to stay cached: direct I/O, unless the model sets its own.
    got = {n: files.load_mode(n, available_bytes=0) for n in backends}
    assert got == {"plain": "dio", "flag": None, "eq": None, "nommap": None, "env": None}
    assert files.load_mode("plain", available_bytes=1 << 40) is None  # room: mmap
    files.fractions["plain"] = 1.0
    assert files.load_mode("plain", available_bytes=0) is None  # cached: mmap
    assert files.load_mode("unknown") is None


AHEAD = """
devices: [{name: d, memory_gb: 10}]
models:
  a: {memory_gb: 5, load_s: 10, ttl_s: 5}
  b: {memory_gb: 5, load_s: 10}
scheduler: {max_wait_s: null, prepare: PREPARE}
"""


def step(h: Harness, rid: str, t: float) -> list[tuple[object, ...]]:
    """`rid` arrives at `t`; its model loads if it must; it is served; timers due run."""
    h.at(t).arrive(rid)
    if h.s.models[rid[0]].state is Lifecycle.LOADING:
        h.loaded(rid[0])
    h.finish(rid)
    calls = h.take()
    h.at(t + 6).timers_due()  # a's idle timeout (5 s) unloads it
    return calls + h.take()


def test_the_predicted_next_model_loads_ahead_into_free_room_once_per_arrival() -> None:
    """a unloads 5 s after each use; b stays. Once a is learned to follow b, b's arrival loads
    a ahead into the free half of the device: a's next request finds it ready. Never twice for
    one arrival (a's timeout then unloads it for good), and never with `prepare: false`."""
    for prepare in (True, False):
        h = Harness(AHEAD.replace("PREPARE", str(prepare).lower()))
        for i, rid in enumerate(["a1", "b1", "a2", "b2", "a3"]):
            step(h, rid, 20.0 * i)
        assert h.s.models["a"].state is Lifecycle.UNLOADED  # its timeout
        calls = step(h, "b3", 100.0)  # a follows b: predicted, and half the device is free
        ahead = [c for c in calls if c[0] == "load" and c[1] == "a"]
        assert len(ahead) == (1 if prepare else 0), calls
        if prepare:
            assert h.s.decisions[-1].reason == "predicted next"
            h.loaded("a")  # at 106: ready, idle
            h.at(112).timers_due()  # loaded ahead, then idle past its timeout: unloaded
            assert h.s.models["a"].state is Lifecycle.UNLOADED
            h.take()
            h.at(130).timers_due()
            assert not [c for c in h.take() if c[0] == "load"]  # not again for that arrival
            assert h.s.models["a"].state is Lifecycle.UNLOADED


def test_a_model_that_left_since_the_last_arrival_is_not_loaded_back_ahead() -> None:
    """All the work at once (b, a, b, a, b, b), on a device that holds both: b's last arrival
    predicts a, which was not on the device yet (b was loading). a is loaded, served and
    unloaded by its `ttl_s` while b works on: a left for a reason since that arrival, so it is
    not loaded back once the work is done, and each model loads once (hypothesis found
    this)."""
    config = parse(
        {
            "devices": [{"name": "g0", "memory_gb": 8}],
            "models": {m: {"load_s": 1.0, "memory_gb": 4, "ttl_s": 2} for m in ("a", "b")},
        }
    )
    shape = [("b", 1.0), ("a", 1.0), ("b", 1.0), ("a", 1.0), ("b", 10.0), ("b", 10.0)]
    lines = [TraceLine(line=i, model=m, service_s=s, t=0.0) for i, (m, s) in enumerate(shape)]
    for policy in ("grouped", "fifo-plus", "cost"):
        sim = Simulation(config.with_policy(policy), Trace(lines=lines), check=True)
        run = sim.run()
        assert isinstance(sim.scheduler, Scheduler)
        assert sim.scheduler.files.prediction.next == {"a": 1.0}  # a is predicted after b
        assert dict(run.loads) == {"a": 1, "b": 1}, policy
