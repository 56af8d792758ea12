"""How many relay processes `corral serve` runs when none are asked for: none on a small
machine (measured: they cost more than they give on 2 cores), else one per core less one."""

from __future__ import annotations

import os

import pytest

from corral.gateway.relays import supervisor


@pytest.mark.parametrize(("cores", "relays"), [(1, 0), (2, 0), (3, 0), (4, 3), (16, 8)])
def test_the_default_follows_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, relays: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)))
    assert supervisor.default_relays() == relays
