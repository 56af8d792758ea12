"""Why a restore was not reused (`blame`): pure, from what Corral knows once the request that
followed it ended. Only `model_state` (a model whose state cannot be rolled back: a hybrid or
recurrent one, a sliding-window one without --swa-full) says the model cannot keep its prompt
caches; every other cause is the placement's or the conversation's, and counts without a
verdict on the model.

- `other_slot`: the request ran on another slot than the one restored into (the server placed
  it, or a second request took the slot first);
- `conversation_changed`: the saved conversation is not a beginning of the request's (its
  client rewrote the history): only the common beginning could be reused;
- `cache_full`: the server could not hold the request's tokens beside what its other slots held
  (its unified KV cache, shared by every slot, or the slot's own share of the context, was
  full), so something it held was dropped;
- `model_state`: the server took the state and processed the prompt again, and the model's file
  says it cannot roll its state back;
- `dropped`: none of these: the server dropped what it restored for a reason it does not say."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from corral.cmdline import flag_value

Cause = Literal["other_slot", "conversation_changed", "cache_full", "model_state", "dropped"]
CAUSES: tuple[Cause, ...] = (
    "other_slot",
    "conversation_changed",
    "cache_full",
    "model_state",
    "dropped",
)


def blame(
    placed_slot: int,
    ran_slot: int | None,
    diverged: bool,
    state_explains: bool,
    over_capacity: bool = False,
) -> Cause:
    """The cause of a restore into `placed_slot` that the next answer did not reuse. `ran_slot`:
    the slot the request ran on, as the server says (None: unknown); `diverged`: the restored
    conversation was not a beginning of the request's; `over_capacity`: the request's tokens
    and its server's other slots' did not fit its KV cache (`SlotMap.overflows`);
    `state_explains`: the model cannot roll its state back (`cannot_roll_back`). A full cache
    comes before the model's state: only a failure nothing else explains is the model's."""
    if ran_slot is not None and ran_slot != placed_slot:
        return "other_slot"
    if diverged:
        return "conversation_changed"
    if over_capacity:
        return "cache_full"
    if state_explains:
        return "model_state"
    return "dropped"


@dataclass(frozen=True)
class StateFacts:
    """What the model's file says of its state: recurrent layers, a sliding window."""

    recurrent: bool
    sliding_window: bool


def no_facts(path: Path | None) -> StateFacts | None:
    """Where nothing reads model files: no facts, so no failure is the model's own."""
    return None


def cannot_roll_back(facts: StateFacts | None, argv: list[str]) -> bool:
    """Whether a server run as `argv` on a model with `facts` cannot reuse a restored state past
    its end: a recurrent or hybrid model, or a sliding-window one without --swa-full."""
    if facts is None:
        return False
    return facts.recurrent or (facts.sliding_window and "--swa-full" not in argv)


# The flags that give llama-server a draft model: with one, a lone slot stays a lone slot.
_DRAFT = ("-md", "--model-draft", "-hfd", "-hfrd", "--hf-repo-draft")


def kv_unified(argv: Sequence[str]) -> bool:
    """Whether llama-server run as `argv` keeps one KV cache shared by all its slots (each slot
    may then hold up to the whole `--ctx-size`, all of them together no more), rather than a
    share of `--ctx-size` per slot. Its own rule: `-kvu` asks for it; otherwise a server given
    one slot (no `--parallel`, or 1) and no draft model is turned into four slots over a
    unified cache."""
    if "-kvu" in argv or "--kv-unified" in argv:
        return True
    if "-no-kvu" in argv or "--no-kv-unified" in argv:
        return False
    parallel = flag_value(argv, "-np", "--parallel")
    one = parallel is None or parallel.strip() in ("1", "-1")
    return one and flag_value(argv, *_DRAFT) is None
