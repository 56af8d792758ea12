"""Which slot a request goes to, and which saved states a fresh server restores
(prompt_cache/slotmap.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.prompt_cache.keys import chat_keys
from corral.prompt_cache.slotmap import SlotMap, restore_plan
from corral.prompt_cache.states import SavedState, SavedStates


def talk(who: str, turns: int) -> list[str]:
    return chat_keys([{"role": "user", "content": f"{who} {i}"} for i in range(turns)])


def test_a_request_goes_to_the_slot_holding_its_conversation() -> None:
    m = SlotMap(3)
    assert m.place(talk("orchestrator", 1), now=1.0) == (0, 0)
    m.done(0, talk("orchestrator", 2), tokens=900)
    assert m.place(talk("coder", 1), now=2.0) == (1, 0)  # not slot 0: it holds a conversation
    m.done(1, talk("coder", 2), tokens=700)
    # The orchestrator's next turn: the slot holding its first two messages.
    assert m.place(talk("orchestrator", 3), now=3.0) == (0, 2)
    # Busy slots are never given; a new conversation takes the least recently used free one.
    assert m.place(talk("explorer", 1), now=4.0) == (2, 0)
    assert m.place(talk("coder", 3), now=5.0) == (1, 2)
    assert m.place(talk("someone", 1), now=6.0) is None
    m.done(2, talk("explorer", 2), tokens=50)
    m.done(0, talk("orchestrator", 4), tokens=1_300)
    assert m.worth_saving(min_tokens=100) == [0]  # slot 1 is busy; slot 2 is too short
    m.lost(0)
    assert m.worth_saving(min_tokens=100) == []
    with pytest.raises(ValueError, match="at least one slot"):
        SlotMap(0)


def test_a_fresh_server_restores_the_states_its_queue_will_use(tmp_path: Path) -> None:
    states = SavedStates(tmp_path, max_bytes=10**6)
    states.load()
    for i, (who, turns) in enumerate([("orchestrator", 6), ("coder", 4), ("orchestrator", 3)]):
        name = f"s{i}.state"
        (tmp_path / name).write_bytes(b"x" * 10)
        states.add(SavedState(name, "m", "fp", talk(who, turns), 100, 10, float(i)))
    queued = [talk("coder", 5), talk("orchestrator", 7), talk("orchestrator", 4), talk("new", 1)]
    plan = restore_plan([1, 0], queued, states, "m", "fp")
    assert [(slot, s.file, n) for slot, s, n in plan] == [(1, "s1.state", 4), (0, "s0.state", 6)]
    # One free slot: the oldest queued request's state; none for another fingerprint.
    assert [s.file for _, s, _ in restore_plan([0], queued, states, "m", "fp")] == ["s1.state"]
    assert restore_plan([0, 1], queued, states, "m", "other") == []
    # Each state restores once: the third request shares a prefix with s0 (taken) and s2.
    plan = restore_plan([0, 1, 2], queued, states, "m", "fp")
    assert [s.file for _, s, _ in plan] == ["s1.state", "s0.state", "s2.state"]
