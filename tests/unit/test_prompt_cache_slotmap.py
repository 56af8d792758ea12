"""Which slot a request goes to, and which saved states a fresh server restores
(prompt_cache/slotmap.py)."""

from __future__ import annotations

import pytest

from corral.prompt_cache.keys import chat_keys
from corral.prompt_cache.slotmap import SlotMap


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
    assert [h.tokens for h in m.slots] == [1_300, 700, 50]
    m.lost(0)
    assert (m.slots[0].keys, m.slots[0].tokens, m.slots[0].used_at) == ([], 0, 3.0)
    with pytest.raises(ValueError, match="at least one slot"):
        SlotMap(0)


def test_a_unified_cache_overflows_on_what_every_slot_holds_a_split_one_on_the_slots_own() -> None:
    shared = SlotMap(4, n_ctx=8_192, unified=True)
    shared.done(0, talk("orchestrator", 2), tokens=3_000)
    shared.done(1, talk("coder", 2), tokens=3_000)
    assert not shared.overflows(2, 2_192)  # 8,192 exactly: it fits
    assert shared.overflows(2, 2_193)
    assert not shared.overflows(0, 5_192)  # its own earlier tokens are what it replaces
    split = SlotMap(4, n_ctx=2_048, unified=False)
    split.done(0, talk("orchestrator", 2), tokens=2_000)
    assert not split.overflows(1, 2_048)  # the other slots' share is their own
    assert split.overflows(1, 2_049)
    assert not SlotMap(4).overflows(0, 10**9)  # a context not known is never called full


def test_conversations_sharing_only_a_system_prompt_keep_their_own_slots() -> None:
    system = {"role": "system", "content": "You are a careful agent."}

    def agent(who: str, turns: int) -> list[str]:
        return chat_keys(
            [system, *[{"role": "user", "content": f"{who} {i}"} for i in range(turns)]]
        )

    m = SlotMap(2)
    assert m.place(agent("planner", 1), now=1.0) == (0, 0)
    m.done(0, agent("planner", 1), tokens=500)
    # The coder shares the system prompt only: an empty slot, not the planner's.
    assert m.place(agent("coder", 1), now=2.0) == (1, 0)
    m.done(1, agent("coder", 1), tokens=500)
    assert m.place(agent("planner", 2), now=3.0) == (0, 2)  # goes on with its own
    m.done(0, agent("planner", 2), tokens=600)
    # No slot empty: a third conversation takes the one sharing the longest beginning (the
    # system prompt's cache is reused), the least recently used among equals.
    assert m.place(agent("tester", 1), now=4.0) == (1, 1)
