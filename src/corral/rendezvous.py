"""Rendezvous (highest random weight) hashing: every node that knows the same members picks the
same one for a key, and the pick moves only when that member leaves. Workers of one database use
it to choose who loads a model (worker/affinity.py); gateways of a cluster, which node serves a
model (gateway/pipeline/cluster.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def rendezvous(model: str, workers: Sequence[str]) -> str | None:
    """The worker with the highest hash of (model, worker): every worker computes the same."""

    def score(w: str) -> bytes:
        return hashlib.blake2b(f"{model}\0{w}".encode(), digest_size=8).digest()

    return max(workers, key=score, default=None)
