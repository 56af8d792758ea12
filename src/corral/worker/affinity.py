"""Model affinity for a cluster of workers on one database: which of a model's waiting tasks a
worker shows its own scheduler, so that each model is loaded once, where it costs least, and a
second time only when its backlog is worth the load. Decentralised: every worker reads the same
residency table (`Store.residency`) and the same live-worker list, and applies the same rule,
so they agree without talking to each other.

For a model this worker does not hold:
- nobody holds it: it is shown only to its *rendezvous winner* (the highest hash of model and
  worker id) among the live workers that serve it and are free (hold no model with ready work);
  if none is free, among all that serve it. So one worker loads it, not all of them, and the
  choice moves only when that worker dies or gets busy;
- others hold it (loading or ready): it is shown only if its backlog per holder is worth more
  than `replica_factor` loads of it (a hot model gets a second copy), and then only to the
  rendezvous winner among the free workers that do not hold it.
A model this worker holds is always shown. A dead worker's rows age out of the table after the
presence window, and its models are then nobody's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corral.rendezvous import rendezvous
from corral.store import Residency

REPLICA_FACTOR = 10.0  # a copy more when each copy would still have this many loads' work


@dataclass(frozen=True)
class ModelView:
    """What this worker knows of one model: its waiting tasks, and its measured costs."""

    waiting: int
    load_s: float
    task_s: float  # one task's service time over the model's concurrency


_IDLE = ModelView(0, 0.0, 0.0)


def shown(
    me: str,
    models: Mapping[str, ModelView],
    mine: set[str],
    live: Mapping[str, Sequence[str]],
    residency: Sequence[Residency],
    replica_factor: float = REPLICA_FACTOR,
) -> set[str]:
    """The models of `models` whose waiting tasks worker `me` should show its scheduler.
    `mine`: the models it holds; `live`: live workers (me included) and the models each
    serves; `residency`: the table's fresh rows."""
    held: dict[str, set[str]] = {}
    for r in residency:  # fresh rows: their workers live, even if not yet in `live`
        if r.worker_id != me:
            held.setdefault(r.worker_id, set()).add(r.model)
    holders: dict[str, set[str]] = {}
    for w, ms in held.items():
        for m in ms:
            holders.setdefault(m, set()).add(w)
    busy = {w for w, ms in held.items() if any(models.get(m, _IDLE).waiting for m in ms)} | (
        {me} if any(models.get(m, _IDLE).waiting for m in mine) else set()
    )
    out = {m for m in models if m in mine}
    unheld: list[str] = []
    copies: list[tuple[float, str]] = []  # (backlog per copy, model) worth a copy more here
    for model, view in models.items():
        if model in mine or not view.waiting:
            continue
        serving = [w for w, ms in live.items() if model in ms]
        if me not in serving:
            serving.append(me)
        others = holders.get(model, set())
        if not others:
            free = [w for w in serving if w not in busy]
            if rendezvous(model, free or serving) == me:
                unheld.append(model)
            continue
        # Worth a copy more if, shared with it, each copy still has that many loads' work;
        # it comes from a free worker, never by evicting work.
        backlog_s = view.waiting * view.task_s / (len(others) + 1)
        if backlog_s <= replica_factor * view.load_s or me in busy:
            continue
        free = [w for w in serving if w not in busy and w not in others]
        if rendezvous(model, free) == me:
            copies.append((backlog_s, model))
    # Models nobody holds before second copies; of those, the one with the most work.
    if unheld:
        out.update(unheld)
    elif copies:
        out.add(max(copies)[1])
    return out
