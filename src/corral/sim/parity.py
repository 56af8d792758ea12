"""Parity of a live replay and the simulator: the simulator given the times the live run had
(a busy machine starts and runs sim backends late, and sends requests late) must make the same
decisions, and the figures that show them (loads, each class's p95 wait) must agree within
tolerances. A short trace's p95 wait is chaotic: services a few percent longer or shorter move
it by a quarter (the Poisson trace's, 41-54 s in the simulator alone), so the live figure is held
to the range of simulations under the timing noise the live run had, not to one of them."""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corral.config import Config
from corral.sim.engine import Run, simulate
from corral.sim.metrics import summarize
from corral.sim.trace import Trace


def at_live_load_times(config: Config, live: dict[str, Any]) -> Config:
    """`config` with each model's `load_s` and `unload_s` as the live run measured them (their
    means, in the trace's seconds; an unload where a swap evicted that model alone): on a busy
    machine a sim backend starts later than its `load_s`, a real server stops in its own time,
    and the scheduler, which learns both, decides on them. The simulator given the same
    durations must make the same decisions; given the configured ones, it answers another
    question."""
    stops = live.get("unload_s_live", {})
    models = {
        name: m.model_copy(
            update={
                "load_s": live["load_s_live"].get(name, m.load_s),
                "unload_s": stops.get(name, m.unload_s),
            }
        )
        for name, m in config.models.items()
    }
    return config.model_copy(update={"models": models})


def at_live_times(run: Run) -> Trace:
    """`run`'s trace with each open-loop interactive line arriving when the live run sent it, and
    the `service_s` of each line that was served alone (no other request answered meanwhile) as
    the live run took it (dispatch to answer; both in the trace's seconds): on a busy machine a
    request leaves late and a sim backend answers later than its tokens say, and the waits
    behind them grow with them; the simulator given the same times must make the same
    decisions. A line served
    beside others keeps its own: its live time measures the sharing, which the simulator models
    itself (each slot at its solo speed). So do a conversation's line (the simulator adds its
    prefill, which the live figure holds), a batch line (its times are its task's, claimed
    before a slot is free) and a line with no answer."""
    spans = sorted(
        (r.dispatched_at, r.finished_at, r.line)
        for r in run.requests
        if r.dispatched_at is not None and r.finished_at is not None
    )
    alone: dict[int, float] = {}
    edge = -float("inf")  # the latest end among the spans that start before this one
    for k, (start, end, line) in enumerate(spans):
        starts_next = spans[k + 1][0] if k + 1 < len(spans) else float("inf")
        if edge <= start and end <= starts_next:
            alone[line] = max(0.0, end - start)
        edge = max(edge, end)
    sent = {r.line: r.arrived_at for r in run.requests if r.finished_at is not None}
    lines = []
    for x in run.trace.lines:
        if x.line in alone and not (x.context_tokens or x.background):
            x = dataclasses.replace(x, service_s=alone[x.line])
        if x.t is not None and x.session is None and not x.background and x.line in sent:
            x = dataclasses.replace(x, t=max(0.0, sent[x.line]))
        lines.append(x)
    return Trace(lines, run.trace.source)


def at_engine_times(config: Config, run: Run, live: dict[str, Any]) -> tuple[Config, Trace]:
    """For a replay on real servers (`live["engine"]`: each answer's own `timings`), the
    configuration and trace the simulator is given. Each line's conversation is as many tokens
    as the server counted (`prompt_n` + `cache_n`). Each model's `prefill_tok_s` is its fastest
    prefill of at least 64 tokens, and each line's service what the live run took (dispatch to
    answer) less its prefill at that speed: a real prefill slows with the context before it
    (attention), which one speed does not model, so the simulator that prefills what the
    server did gets the live time exactly, and one that decides otherwise (restores, what a
    swap threw away) is off by that prefill. Prompt caches are not kept where the live run
    found them not kept (`live["prompt_cache"]`). Each step of a closed loop thinks as long as
    it did live (its previous step's answer to its own arrival): a client on a busy machine
    sends late, and two loops' next steps that arrive a moment apart are served in the order
    they arrived, which decides what a server's one slot holds next. Lines without the
    server's figures keep the trace's."""
    engine: dict[Any, dict[str, float]] = live["engine"]
    by_line = {int(k): v for k, v in engine.items()}
    fastest: dict[str, float] = {}
    for x in run.trace.lines:
        e = by_line.get(x.line)
        if e is not None and e.get("prompt_n", 0) >= 64 and e.get("prompt_ms", 0) > 0:
            speed = e["prompt_n"] / (e["prompt_ms"] / 1000)
            fastest[x.model] = max(fastest.get(x.model, 0.0), speed)
    lines = []
    answered: dict[str, float | None] = {}  # session -> its previous step's answer, live
    for x, r in zip(run.trace.lines, run.requests, strict=True):
        if x.session is not None:
            before = answered.get(x.session)
            answered[x.session] = r.finished_at
            if before is not None and x.t is None:
                x = dataclasses.replace(x, think_s=max(0.0, r.arrived_at - before))
        e = by_line.get(x.line)
        if e is None or r.dispatched_at is None or r.finished_at is None:
            lines.append(x)
            continue
        top = fastest.get(x.model)
        prefill_s = e.get("prompt_n", 0) / top if top else 0.0
        context = int(e.get("prompt_n", 0) + e.get("cache_n", 0)) if x.context_tokens else 0
        service_s = max(0.0, r.finished_at - r.dispatched_at - prefill_s)
        lines.append(dataclasses.replace(x, context_tokens=context, service_s=service_s))
    verdicts: dict[str, str] = live.get("prompt_cache", {})
    models = {}
    for name, m in config.models.items():
        update: dict[str, Any] = {}
        if name in fastest:
            update["prefill_tok_s"] = fastest[name]
        if verdicts.get(name, "").startswith("not kept"):
            update["prompt_cache"] = False
        models[name] = m.model_copy(update=update)
    return config.model_copy(update={"models": models}), Trace(lines, run.trace.source)


def _engine_spread(trace: Trace) -> float:
    """The relative spread of each model's services (their coefficient of variation, the
    models' mean), between 2% and 20%: the noise to simulate on real servers."""
    by_model: dict[str, list[float]] = {}
    for x in trace.lines:
        by_model.setdefault(x.model, []).append(x.service_s)
    cvs = [
        statistics.stdev(v) / statistics.mean(v)
        for v in by_model.values()
        if len(v) >= 2 and statistics.mean(v) > 0
    ]
    return min(0.2, max(0.02, statistics.mean(cvs))) if cvs else 0.02


def _spread(run: Run, live: Trace) -> float:
    """The relative spread of the live services of the lines served alone against the trace's
    (their ratios' coefficient of variation), between 2% and 20%: the noise to simulate."""
    ratios = [
        y.service_s / x.service_s
        for x, y in zip(run.trace.lines, live.lines, strict=True)
        if x.service_s > 0 and y.service_s != x.service_s
    ]
    if len(ratios) < 2:
        return 0.02
    return min(0.2, max(0.02, statistics.stdev(ratios) / statistics.mean(ratios)))


def _jittered(trace: Trace, spread: float, rng: random.Random) -> Trace:
    """`trace` with each service time off by up to `spread` either way."""
    return Trace(
        [
            dataclasses.replace(x, service_s=x.service_s * rng.uniform(1 - spread, 1 + spread))
            for x in trace.lines
        ],
        trace.source,
    )


def slow_services(run: Run, margin: float = 0.05, live: Trace | None = None) -> float | None:
    """How much longer the live services took than the trace's (the ratio of their sums), when it
    is more than `margin`; else None. `live`: `at_live_times(run)`, if the caller has it."""
    want = sum(x.service_s for x in run.trace.lines)
    got = sum(x.service_s for x in (live or at_live_times(run)).lines)
    return got / want if want > 0 and got > want * (1 + margin) else None


def slow_loads(config: Config, live: dict[str, Any], margin: float = 0.05) -> list[str]:
    """The models whose live loads took more than `margin` longer than their `load_s`."""
    return [
        f"{name} {got:.2f} s (configured {config.models[name].load_s:g} s)"
        for name, got in live["load_s_live"].items()
        if got > config.models[name].load_s * (1 + margin)
    ]


@dataclass(frozen=True)
class Divergence:
    """One figure, simulated and live, and whether they agree within the tolerance: around the
    simulated figure or, given `low` and `high`, around the range of several simulations."""

    figure: str
    simulated: float
    live: float
    tolerance: float
    low: float | None = None
    high: float | None = None

    @property
    def ok(self) -> bool:
        low = self.simulated if self.low is None else self.low
        high = self.simulated if self.high is None else self.high
        return low - self.tolerance <= self.live <= high + self.tolerance


def compare(
    simulated: dict[str, Any], live: dict[str, Any], wait_floor_s: float = 1.0
) -> list[Divergence]:
    """The parity figures: loads within max(2, 10%), each class's p95 wait within
    max(`wait_floor_s`, 15%) (both in the trace's seconds), and where both say it (real
    servers), the tokens prefilled within max(64, 10%): what the swaps threw away and what the
    restores kept, decided alike."""
    out = [
        Divergence(
            "loads",
            simulated["loads"],
            live["loads"],
            max(2.0, 0.10 * simulated["loads"]),
        )
    ]
    if "prefill_tokens" in simulated and "prefill_tokens" in live:
        want = float(simulated["prefill_tokens"])
        out.append(
            Divergence("prefill tokens", want, live["prefill_tokens"], max(64.0, 0.10 * want))
        )
    for name, sim in simulated["per_class"].items():
        got = live["per_class"].get(name, {}).get("wait_p95_s", float("nan"))
        want = sim["wait_p95_s"]
        out.append(Divergence(f"{name} wait p95 s", want, got, max(wait_floor_s, 0.15 * want)))
    return out


ENSEMBLE = 8  # simulations under the live run's timing noise (the first without noise)
# On real servers at 1x: the zoo's tiny files swap and answer in tenths of a second, where
# the sim backends' traces wait for seconds.
ENGINE_WAIT_FLOOR_S = 0.25


def simulated_beside(
    config: Config,
    run: Run,
    live: dict[str, Any],
    warn: Callable[[str], None] | None = None,
    seed: int = 0,
) -> tuple[dict[str, Any], list[Divergence]]:
    """The simulation of `run`'s trace given the times the live run had (`at_live_load_times`,
    `at_live_times`), its figures, and their parity with `live`: each figure within its
    tolerance of the range of `ENSEMBLE` simulations whose service times are off by the live
    services' own spread (the same decisions under the same noise), whatever this machine's
    speed. On real servers (`live["engine"]`) the times and context are the servers' own
    (`at_engine_times`), the noise their services' spread, and the tokens prefilled a figure
    too. `warn` hears which times were longer live than configured."""
    measured = at_live_load_times(config, live)
    if "engine" in live:  # real servers: their own figures (`at_engine_times`)
        measured, trace = at_engine_times(measured, run, live)
        spread = _engine_spread(trace)
        return _ensemble(measured, trace, spread, seed, live, ENGINE_WAIT_FLOOR_S)
    slow = slow_loads(config, live)
    trace = at_live_times(run)
    ratio = slow_services(run, live=trace)
    if warn is not None and slow:
        warn(f"loads took longer live than configured on this machine: {', '.join(slow)}")
    if warn is not None and ratio is not None:
        warn(f"services took {ratio:.2f}x the trace's live on this machine")
    if warn is not None and (slow or ratio is not None):
        warn("the simulation uses the live times")
    return _ensemble(measured, trace, _spread(run, trace), seed, live)


def _ensemble(
    measured: Config,
    trace: Trace,
    spread: float,
    seed: int,
    live: dict[str, Any],
    wait_floor_s: float = 1.0,
) -> tuple[dict[str, Any], list[Divergence]]:
    """`ENSEMBLE` simulations of `trace` (the first as it is, the others with services off by
    `spread` and loads and stops as long as live ones were, `_drawn_load_times`), the first's
    figures and each parity figure against the range of them all."""
    rng = random.Random(seed)
    traces = [trace] + [_jittered(trace, spread, rng) for _ in range(ENSEMBLE - 1)]
    configs = [measured] + [_drawn_load_times(measured, live, k, rng) for k in range(1, ENSEMBLE)]
    runs = []
    for c, t in zip(configs, traces, strict=True):
        sim = simulate(c, t, check=True)
        runs.append(summarize(sim))
        if sim.prompts is not None:
            runs[-1]["prefill_tokens"] = sim.prompts.prefill_tokens
    simulated = runs[0]
    simulated["mode"] = "simulated"
    out = []
    for d in compare(simulated, live, wait_floor_s):
        values = [_figure(r, d.figure) for r in runs]
        out.append(dataclasses.replace(d, low=min(values), high=max(values)))
    return simulated, out


def _drawn_load_times(config: Config, live: dict[str, Any], k: int, rng: random.Random) -> Config:
    """`config` with each model's `load_s` and `unload_s` within the range the live run measured
    (`load_s_live_range`, `unload_s_live_range`): for `k` 1 the slowest, 2 the fastest, else
    drawn between. A short trace's p95 wait is its slowest few waits, and those wait behind
    its slowest swaps (one load a busy machine started late), which the means hide."""
    loads: dict[str, list[float]] = live.get("load_s_live_range", {})
    stops: dict[str, list[float]] = live.get("unload_s_live_range", {})

    def pick(span: list[float] | None, default: float) -> float:
        if span is None:
            return default
        low, high = span
        return high if k == 1 else low if k == 2 else rng.uniform(low, high)

    models = {
        name: m.model_copy(
            update={
                "load_s": pick(loads.get(name), m.load_s),
                "unload_s": pick(stops.get(name), m.unload_s),
            }
        )
        for name, m in config.models.items()
    }
    return config.model_copy(update={"models": models})


def _figure(figures: dict[str, Any], name: str) -> float:
    """A parity figure by its `Divergence.figure` name."""
    if name == "loads":
        return float(figures["loads"])
    if name == "prefill tokens":
        return float(figures["prefill_tokens"])
    cls = name.removesuffix(" wait p95 s")
    return float(figures["per_class"].get(cls, {}).get("wait_p95_s", float("nan")))
