"""What each slot of one llama-server holds, as Corral sent it (`SlotMap`), and the two
choices made from it: which slot a request goes to (`place`: the one holding the longest prefix
of its conversation, else the least recently used free one) and which saved states to restore
into the free slots of a server that just started (`restore_plan`).

llama-server keeps one prompt cache per slot and reuses it for a request sent to that slot
(`id_slot`, `cache_prompt`) as far as the two prompts agree; a request it places itself may
land on a slot holding another conversation and process its own again. Pure bookkeeping: no
I/O, no clock of its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from corral.prompt_cache.keys import shared
from corral.prompt_cache.states import SavedState, SavedStates


@dataclass
class Held:
    """One slot: the conversation its cache holds (keys; empty: nothing worth naming), the
    tokens it holds, whether a request runs there now, and when it last took one."""

    keys: list[str] = field(default_factory=list)
    tokens: int = 0
    busy: bool = False
    used_at: float = 0.0


class SlotMap:
    """The slots `0 .. n_slots - 1` of one server."""

    def __init__(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError(f"a server has at least one slot; got {n_slots}")
        self.slots = [Held() for _ in range(n_slots)]

    def place(self, keys: Sequence[str], now: float) -> tuple[int, int] | None:
        """The free slot for a request whose conversation is `keys`, and how many of its keys
        that slot's cache already holds; None if every slot is busy. It is marked busy."""
        free = [i for i, s in enumerate(self.slots) if not s.busy]
        if not free:
            return None
        best = max(free, key=lambda i: (shared(self.slots[i].keys, keys), -self.slots[i].used_at))
        held = self.slots[best]
        reused = shared(held.keys, keys)
        if not reused:  # the least recently used free slot gives up its conversation
            best = min(free, key=lambda i: (self.slots[i].used_at, i))
            held = self.slots[best]
        held.busy = True
        held.used_at = now
        return best, reused

    def done(self, slot: int, keys: Sequence[str], tokens: int) -> None:
        """The request on `slot` ended: its cache now holds `keys`' conversation (`tokens`
        tokens, the prompt and the answer)."""
        held = self.slots[slot]
        held.busy = False
        held.keys = list(keys)
        held.tokens = tokens

    def lost(self, slot: int) -> None:
        """The slot's cache no longer holds what Corral thinks (a failed restore erases it)."""
        self.slots[slot] = Held(used_at=self.slots[slot].used_at)

    def worth_saving(self, min_tokens: int) -> list[int]:
        """Idle slots holding a conversation of at least `min_tokens` tokens."""
        return [
            i
            for i, s in enumerate(self.slots)
            if s.keys and not s.busy and s.tokens >= max(1, min_tokens)
        ]


def restore_plan(
    free_slots: Sequence[int],
    queued: Sequence[Sequence[str]],
    states: SavedStates,
    model: str,
    fingerprint: str,
) -> list[tuple[int, SavedState, int]]:
    """Which saved states to restore into `free_slots` before the `queued` requests (their
    conversations' keys, oldest first) are sent: for each request in turn, the state sharing
    the longest prefix with it, each state and slot used once; (slot, state, keys shared)."""
    plan: list[tuple[int, SavedState, int]] = []
    slots = list(free_slots)
    taken: list[str] = []
    for keys in queued:
        if not slots:
            break
        found = states.best(model, fingerprint, keys, exclude=taken)
        if found is None:
            continue
        state, n = found
        plan.append((slots.pop(0), state, n))
        taken.append(state.file)
    return plan
