"""Peers' schedulers as simulator baselines, run by Corral's scheduler with their rules as its
policy (never the live system: the gateway and the worker run Corral's policies only).

`llama-swap`: llama-swap's default FIFO scheduler (`internal/router/scheduler/fifo.go`). A
request for the ready model is served at once, ahead of older requests for other models (its
fast path); a request that needs a swap waits in arrival order, and the swap starts only when
the models it would evict have nothing in flight; every queued request for the incoming model
joins that swap. So the resident model is served exhaustively, then the model of the oldest
waiting request comes in. No wait bound, no service classes. Left out: its per-model
concurrency cap (10 by default), past which llama-swap answers 429 instead of queueing, and its
per-model `priority` (none by default).

`fifo` (Corral's own, core/policies.py) is Ollama's scheduler (`server/sched.go`): one pending
queue in arrival order; a request at its head whose model is loaded is served, one that needs
room makes the head wait for the unload, and every request behind it waits too, "even if they
were for a different model that's loaded".
"""

from __future__ import annotations

from corral.core.policies import Policy


class LlamaSwap(Policy):
    """llama-swap's FIFO scheduler (the module docstring)."""

    name = "llama-swap"
    bounded_wait = False
    classes = False
