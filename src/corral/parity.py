"""Parity of a live replay and the simulator: the simulator given the times the live run had
(a busy machine starts and runs sim backends late) must make the same decisions, and the figures
that show them (loads, each class's p95 wait) must agree within tolerances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corral.config import Config


def at_live_load_times(config: Config, live: dict[str, Any]) -> Config:
    """`config` with each model's `load_s` as the live run measured it (its mean, in the trace's
    seconds): on a busy machine a sim backend starts later than its `load_s`, and the scheduler,
    which learns load times, decides on the longer ones. The simulator given the same durations
    must make the same decisions; given the configured ones, it answers another question."""
    models = {
        name: m.model_copy(update={"load_s": live["load_s_live"].get(name, m.load_s)})
        for name, m in config.models.items()
    }
    return config.model_copy(update={"models": models})


def slow_loads(config: Config, live: dict[str, Any], margin: float = 0.05) -> list[str]:
    """The models whose live loads took more than `margin` longer than their `load_s`."""
    return [
        f"{name} {got:.2f} s (configured {config.models[name].load_s:g} s)"
        for name, got in live["load_s_live"].items()
        if got > config.models[name].load_s * (1 + margin)
    ]


@dataclass(frozen=True)
class Divergence:
    """One figure, simulated and live, and whether they agree within the tolerance."""

    figure: str
    simulated: float
    live: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.live - self.simulated) <= self.tolerance


def compare(
    simulated: dict[str, Any], live: dict[str, Any], wait_floor_s: float = 1.0
) -> list[Divergence]:
    """The parity figures: loads within max(2, 10%), and each class's p95 wait within
    max(`wait_floor_s`, 15%) (both in the trace's seconds)."""
    out = [
        Divergence(
            "loads",
            simulated["loads"],
            live["loads"],
            max(2.0, 0.10 * simulated["loads"]),
        )
    ]
    for name, sim in simulated["per_class"].items():
        got = live["per_class"].get(name, {}).get("wait_p95_s", float("nan"))
        want = sim["wait_p95_s"]
        out.append(Divergence(f"{name} wait p95 s", want, got, max(wait_floor_s, 0.15 * want)))
    return out
