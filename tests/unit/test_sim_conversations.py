"""Conversations in the simulator and the scheduler: a trace's `context_tokens`, the
prefill a swap throws away, saved states with their speed and budget (sim/engine.py `Prompts`),
and the scheduler's price of a swap (core/conversations.py)."""

from __future__ import annotations

import json

import pytest

from corral.config import parse_config
from corral.errors import TraceError
from corral.sim.engine import simulate
from corral.sim.families import random_conversation_scenario
from corral.sim.trace import parse_trace
from tests.helpers import Harness

# fifo: the steps in arrival order, so that the figures are the engine's rules alone (the cost
# policy may keep a model a while for its next step: its price is tested below).
MODELS = """
devices: [{{name: d}}]
scheduler: {{policy: fifo}}
prompt_cache: {cache}
models:
  a: {{cmd: llama-server -m a.gguf, load_s: 2, unload_s: 0.5, prefill_tok_s: 1000,
       kv_bytes_per_token: 1000}}
  b: {{cmd: llama-server -m b.gguf, load_s: 2, unload_s: 0.5, prefill_tok_s: 1000}}
"""
# One agent loop: a, b, a, b, each conversation growing by 1,000 tokens a step.
LOOP = [
    {"session": "s", "model": "a", "service_s": 1, "context_tokens": 4000},
    {"session": "s", "model": "b", "service_s": 1, "context_tokens": 2000},
    {"session": "s", "model": "a", "service_s": 1, "context_tokens": 5000},
    {"session": "s", "model": "b", "service_s": 1, "context_tokens": 3000},
]


def run(cache: str, lines: list[dict[str, object]] = LOOP) -> list[float]:
    config = parse_config(MODELS.format(cache=cache))
    result = simulate(config, parse_trace(map(json.dumps, lines), config.models), check=True)
    return [r.finished_at or 0.0 for r in result.requests]


def test_a_swap_throws_the_conversation_away_without_saved_states() -> None:
    # Each step: the previous model's unload (0.5 s; none first), the load (2 s), the whole
    # context prefilled at 1,000 tokens/s, then the 1 s of service.
    ends = run("false")
    expected, t = [], 0.0
    for i, line in enumerate(LOOP):
        t += (0.5 if i else 0.0) + 2 + float(line["context_tokens"]) / 1000 + 1  # type: ignore[arg-type]
        expected.append(t)
    assert ends == pytest.approx(expected)


def test_saved_states_are_restored_and_only_the_new_tokens_prefilled() -> None:
    speed = 1e6  # tokens/s a state is written or read back at
    ends = run(f"{{state_tok_s: {speed:g}, min_tokens: 100}}")
    t = 2 + 4.0 + 1  # a: first, whole
    assert ends[0] == pytest.approx(t)
    t += 0.5 + 4000 / speed + 2 + 2.0 + 1  # a saved on the way out; b whole
    assert ends[1] == pytest.approx(t)
    t += 0.5 + 2000 / speed + 2 + 4000 / speed + 1.0 + 1  # b saved; a restored, 1,000 new
    assert ends[2] == pytest.approx(t)
    t += 0.5 + 5000 / speed + 2 + 2000 / speed + 1.0 + 1
    assert ends[3] == pytest.approx(t)


def test_the_budget_drops_the_least_recently_used_state() -> None:
    # a serves two conversations at once (two slots); its states take 1,000 bytes a token, and
    # the budget holds one of 4,000 tokens: when a leaves, x (saved first) is dropped for y.
    text = MODELS.replace("prefill_tok_s: 1000,\n", "prefill_tok_s: 1000, concurrency: 2,\n")
    budget_gb = 4.5e6 / 1024**3
    config = parse_config(text.format(cache=f"{{max_gb: {budget_gb!r}, min_tokens: 10}}"))
    assert config.models["a"].concurrency == 2
    lines = [
        {"session": "x", "model": "a", "service_s": 1, "context_tokens": 4000},
        {"session": "y", "model": "a", "service_s": 1, "context_tokens": 4000, "t": 0.5},
        {"session": "y", "model": "b", "service_s": 1, "context_tokens": 100},
        {"session": "x", "model": "a", "service_s": 1, "context_tokens": 4000, "think_s": 30},
        {"session": "y", "model": "a", "service_s": 1, "context_tokens": 4000},
    ]
    result = simulate(config, parse_trace(map(json.dumps, lines), config.models), check=True)
    prompts = result.prompts
    assert prompts is not None
    assert prompts.saves == 3  # x and y when a left, b's when it left
    assert prompts.restores == 1
    by_line = {r.line: r for r in result.requests}
    assert by_line[5].prefill_tokens == 0  # y: restored whole
    assert by_line[4].prefill_tokens == 4000  # x: its state was dropped for the budget


def test_a_trace_says_what_is_wrong_with_context_tokens() -> None:
    models = {"a"}
    bad = [
        ('{"t": 0, "model": "a", "service_s": 1, "context_tokens": 5}', "needs a 'session'"),
        ('{"session": "s", "model": "a", "service_s": 1, "context_tokens": -1}', "integer"),
        ('{"session": "s", "model": "a", "service_s": 1, "context_tokens": true}', "integer"),
        ('{"session": "s", "model": "a", "service_s": 1, "context_tokens": 1.5}', "integer"),
    ]
    for line, said in bad:
        with pytest.raises(TraceError, match=said):
            parse_trace([line], models)


# Two models on one device, a's prefill speed known (the scheduler's price tests).
TWO = """
devices: [{{name: d}}]
prompt_cache: {cache}
models:
  a: {{cmd: llama-server -m a.gguf, load_s: 2, unload_s: 0.5, service_s: 2,
       prefill_tok_s: 1000}}
  b: {{cmd: llama-server -m b.gguf, load_s: 2, unload_s: 0.5, service_s: 2}}
"""


def test_the_scheduler_prices_what_a_swap_throws_away() -> None:
    for cache, refill_s in (("false", 8.0), ("{state_tok_s: 100000}", 2 * 8000 / 100000)):
        h = Harness(TWO.format(cache=cache))
        r = h.arrive("a1")
        h.loaded("a")
        r.conversation, r.context_tokens = "agent", 8000
        h.finish("a1")
        a = h.s.models["a"]
        assert a.est.refill_s == pytest.approx(refill_s)
        assert a.comeback_s == 2  # a load is a load; leaving now is priced on its own
        # Its next step measures its server's prefill: 2,000 tokens in 4 s.
        r = h.arrive("a2")
        r.conversation, r.context_tokens = "agent", 9000
        r.prefill_tokens, r.prefill_s = 2000, 4.0
        h.finish("a2")
        speed = 1000 + 0.3 * (500 - 1000)
        expected = 9000 / speed if cache == "false" else 2 * 9000 / 100000
        assert a.est.refill_s == pytest.approx(expected)
        h.take()
        h.arrive("b1")  # a leaves for b (once it stops waiting for its next step)
        t = 0.0
        while ("load", "b") not in [c[:2] for c in h.take()]:
            t += 0.05
            assert t < 60, "b never loaded"
            h.at(t).timers_due()
        assert a.state.value == "unloaded"  # what it held is gone (or saved): nothing to price
        assert a.est.refill_s == 0.0


def test_a_model_whose_restores_proved_useless_is_priced_as_its_whole_prefill() -> None:
    """Once its server is found not to reuse what it restored (prompt_cache/caches.py
    tells `Conversations.lost`), a model that keeps its prompt caches by its configuration is
    priced as one that keeps none, and stays so when its settings change."""
    h = Harness(TWO.format(cache="{state_tok_s: 100000}"))
    a = h.s.models["a"]
    r = h.arrive("a1")
    h.loaded("a")
    r.conversation, r.context_tokens = "agent", 8000
    h.finish("a1")
    assert a.est.refill_s == pytest.approx(2 * 8000 / 100000)  # kept: a save and a restore
    h.s.conversations.lost("a")
    r = h.arrive("a2")
    r.conversation, r.context_tokens = "agent", 8000
    h.finish("a2")
    assert a.est.refill_s == pytest.approx(8.0)  # 8,000 tokens at 1,000 a second, again
    h.s.on_model_changed("a", h.s.models["a"].spec.model_copy(update={"priority": 2}))
    r = h.arrive("a3")
    r.conversation, r.context_tokens = "agent", 8000
    h.finish("a3")
    assert a.est.refill_s == pytest.approx(8.0)


def test_a_model_whose_conversations_are_saved_yields_sooner() -> None:
    """A resident with work queued yields to more important work only when that is worth the
    round trip: its conversation's prefill again counts in it, unless it is saved."""
    after: dict[bool, list[tuple[object, ...]]] = {}
    for kept, cache in ((False, "false"), (True, "{state_tok_s: 100000}")):
        h = Harness(TWO.format(cache=cache))
        for i in range(1, 5):
            h.arrive(f"a{i}")
        h.loaded("a")
        r = h.requests["a1"]
        r.conversation, r.context_tokens = "agent", 8000
        h.take()
        h.arrive("b1", priority=1)  # more important, at a's next request boundary
        h.finish("a1")
        after[kept] = [c[:2] for c in h.take()]
    assert after[False] == [("dispatch", "a2")]  # 8 s of prefill again: a goes on
    assert after[True] == [("load", "b")]  # saved: a yields to b


def test_the_conversation_family_runs_every_request_and_saves_prefill() -> None:
    prefilled = {True: 0, False: 0}
    for seed in range(12):
        sc = random_conversation_scenario(seed, 300)
        result = simulate(sc.config, sc.trace, check=True)
        assert all(r.finished_at is not None for r in result.requests), sc.name
        assert not result.rejected
        prompts = result.prompts
        assert prompts is not None
        keeps = sc.config.prompt_cache.enabled
        prefilled[keeps] += prompts.prefill_tokens
        if keeps:
            assert prompts.restored_tokens >= 0
        else:
            assert prompts.restores == 0
            assert prompts.saves == 0
    # Same seeds, caches on and off: keeping them spares prefill.
    for seed in range(6):
        sc = random_conversation_scenario(seed, 300)
        raw = sc.config.model_dump(mode="json", by_alias=True, exclude_none=True)
        for on in (True, False):
            raw["prompt_cache"] = {"enabled": on, "max_gb": 50}
            cfg = type(sc.config).model_validate(raw)
            result = simulate(cfg, sc.trace, check=True)
            assert result.prompts is not None
            prefilled[on] += result.prompts.prefill_tokens
    assert prefilled[True] < prefilled[False]


def test_an_overdue_model_gets_a_device_by_twice_its_bound_when_no_queue_runs_dry() -> None:
    """Two devices kept busy by closed loops whose queues never run dry: a third model's
    requests once waited 646 s under a 120 s bound (the conversation family, seed 5008),
    because nothing decided again when the rule that lets it take a busy device applied."""
    sc = random_conversation_scenario(5008)
    assert len(sc.config.devices) == 2
    run = simulate(sc.config, sc.trace, check=True)
    bound = sc.config.scheduler.max_wait_s
    assert bound is not None
    waits = [r.dispatched_at - r.arrived_at for r in run.requests if r.dispatched_at is not None]
    # Twice the bound, then the round in flight on the device it takes (its longest request
    # there, prefill included, is under a minute).
    assert max(waits) < 2 * bound + 60
