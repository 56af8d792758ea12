"""What a swap throws away (`Conversations`, a part the scheduler owns): the conversations each
model copy's server holds in its prompt cache, as the requests that ended say (their
`conversation` and `context_tokens`), and the model's prefill speed, measured from the
requests' own prefill (`prefill_tokens`, `prefill_s`) or configured (`prefill_tok_s`).

A copy that leaves its device loses what its server holds, unless its prompt caches are kept
(saved before it stops, restored when its conversations come back). The price of
leaving is then the prefill of every held conversation again, or only their save and restore;
`refill_s` keeps it on the copy's estimates (`Estimates.refill_s`). It is the price of
leaving now, and the rule that weighs leaving now against more important work counts it
(should a resident with work queued yield: core/policies.py). Two rules do not, measured on
the conversation family (docs/benchmarks.md): how long an idle model waits for its next
request (in a loop over several models its next step waits for the others': counted there,
the family's p95 and max got worse), and the long-run placement of models on devices
(core/traffic.py: what a server holds at one moment says nothing of the traffic's switches)."""

from __future__ import annotations

from corral.config import Config, ModelConfig
from corral.config.server import keeps_prompt_cache
from corral.core.state import ModelRecord
from corral.core.types import Request

_EWMA_PREFILL = 0.3
_MIN_PREFILL_TOKENS = 64  # shorter prefills say more about overheads than about speed


class Conversations:
    """Per model copy: conversation -> its context tokens (least recently used first, at most
    the model's `concurrency` of them: one per slot); per model: tokens prefilled per second."""

    def __init__(self, config: Config) -> None:
        self._settings = config.prompt_cache
        self._state_tok_s = config.prompt_cache.state_tok_s
        self._configured: dict[str, bool] = {}  # what the model's settings say of its caches
        self._lost: set[str] = set()  # models whose restores proved useless (`lost`)
        self._prefill: dict[str, float | None] = {}
        self._held: dict[int, dict[str, int]] = {}  # by id() of a copy's record
        for name, spec in config.models.items():
            self.add_model(name, spec)

    def add_model(self, name: str, spec: ModelConfig) -> None:
        """A model (new, or with new settings: its measured speed stays)."""
        self._configured[name] = keeps_prompt_cache(spec, self._settings)
        if self._prefill.get(name) is None:
            self._prefill[name] = spec.prefill_tok_s

    def lost(self, model: str) -> None:
        """`model`'s prompt caches are not kept after all (its server did not reuse what it
        restored: prompt_cache/caches.py): from now on what leaving throws away is priced as
        its whole prefill again (each copy's price is set anew at its next finished request)."""
        self._lost.add(model)

    def found(self, model: str) -> None:
        """`model`'s prompt caches are kept again (a probe's restore was reused): leaving is
        priced as its settings say again."""
        self._lost.discard(model)

    def finished(self, copy: ModelRecord, r: Request) -> None:
        """`r` ended on `copy`: its server holds `r`'s conversation now; its prefill is one
        more measure of the model's speed."""
        if r.prefill_tokens >= _MIN_PREFILL_TOKENS and r.prefill_s > 0:
            speed = r.prefill_tokens / r.prefill_s
            known = self._prefill.get(r.model)
            self._prefill[r.model] = (
                speed if known is None else known + _EWMA_PREFILL * (speed - known)
            )
        if r.conversation is None or r.context_tokens <= 0:
            return
        held = self._held.setdefault(id(copy), {})
        held.pop(r.conversation, None)
        held[r.conversation] = r.context_tokens
        while len(held) > max(1, copy.concurrency):
            del held[next(iter(held))]
        copy.est.refill_s = self.refill_s(copy)

    def left(self, copy: ModelRecord) -> None:
        """`copy` left its device (unloaded or asleep): its server holds nothing now."""
        self._held.pop(id(copy), None)
        copy.est.refill_s = 0.0

    def refill_s(self, copy: ModelRecord) -> float:
        """Seconds that leaving now costs its conversations when they come back: their
        prefill again, or their save and restore where the model keeps its prompt caches."""
        tokens = sum(self._held.get(id(copy), {}).values())
        if not tokens:
            return 0.0
        if self._configured.get(copy.name, False) and copy.name not in self._lost:
            return 2.0 * tokens / self._state_tok_s
        speed = self._prefill.get(copy.name)
        return tokens / speed if speed else 0.0

    def prefill_tok_s(self, model: str) -> float | None:
        """The model's prefill speed as measured (or configured); None if unknown."""
        return self._prefill.get(model)
