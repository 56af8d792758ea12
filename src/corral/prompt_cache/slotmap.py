"""What each slot of one llama-server holds, as Corral sent it (`SlotMap`), and the two
choices made from it: which slot a request goes to (`place`: the one holding its conversation
so far, else an empty one, else the one sharing the longest beginning with it or the least
recently used); a saved state is restored into the
slot chosen when it shares more of the conversation than the slot holds (server.py).

llama-server keeps one prompt cache per slot and reuses it for a request sent to that slot
(`id_slot`, `cache_prompt`) as far as the two prompts agree; a request it places itself may
land on a slot holding another conversation and process its own again. Pure bookkeeping: no
I/O, no clock of its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from corral.prompt_cache.keys import shared


@dataclass
class Held:
    """One slot: the conversation its cache holds (keys; empty: nothing worth naming), the
    tokens it holds, whether a request runs there now, and when it last took one."""

    keys: list[str] = field(default_factory=list)
    tokens: int = 0
    busy: bool = False
    used_at: float = 0.0


class SlotMap:
    """The slots `0 .. n_slots - 1` of one server, each of context `n_ctx` tokens (0: not
    known), over one KV cache of `n_ctx` tokens that they share (`unified`) or each its own."""

    def __init__(self, n_slots: int, n_ctx: int = 0, unified: bool = False) -> None:
        if n_slots < 1:
            raise ValueError(f"a server has at least one slot; got {n_slots}")
        self.slots = [Held() for _ in range(n_slots)]
        self.n_ctx = max(0, n_ctx)
        self.unified = unified

    def overflows(self, slot: int, tokens: int) -> bool:
        """Whether `tokens` in `slot` do not fit beside what the other slots hold: over the
        slot's context, or with a unified cache over what is left of it; never when the
        context is not known."""
        if self.n_ctx <= 0:
            return False
        others = sum(s.tokens for i, s in enumerate(self.slots) if i != slot)
        return tokens + (others if self.unified else 0) > self.n_ctx

    def place(self, keys: Sequence[str], now: float) -> tuple[int, int] | None:
        """The free slot for a request whose conversation is `keys`, and how many of its keys
        that slot's cache already holds; None if every slot is busy. It is marked busy. A slot
        whose conversation the request goes on with comes first; then an empty one, so that
        two conversations sharing only a system prompt do not end each other."""
        free = [i for i, s in enumerate(self.slots) if not s.busy]
        if not free:
            return None
        share = {i: shared(self.slots[i].keys, keys) for i in free}
        # Its own conversation, to go on with (every key the slot holds is the request's).
        going_on = [i for i in free if self.slots[i].keys and share[i] == len(self.slots[i].keys)]
        empty = [i for i in free if not self.slots[i].keys]
        if going_on:
            best = max(going_on, key=lambda i: (share[i], -self.slots[i].used_at))
        elif empty:  # rather than end another conversation that shares only a beginning
            best = min(empty, key=lambda i: (self.slots[i].used_at, i))
        else:  # the longest shared beginning, else the least recently used gives its up
            best = min(free, key=lambda i: (-share[i], self.slots[i].used_at, i))
        held = self.slots[best]
        reused = share[best]
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
