"""How a worker runs: leases, polling, retries, shutdown, prefetch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSettings:
    lease_s: float = 30.0  # a claimed task is reclaimable this long after the last heartbeat
    poll_s: float = 0.2  # how often the worker looks for new work ...
    # ... where the store wakes it on work from other processes (PostgreSQL's LISTEN/NOTIFY):
    # then polling is only the safety net (and its own retries set a timer for when they are due)
    idle_poll_s: float = 2.0
    retry_base_s: float = 1.0  # backoff after the n-th failed attempt: base * 2**(n-1) ...
    retry_max_s: float = 300.0  # ... capped here
    shutdown_timeout_s: float = 30.0  # on stop, running tasks get this long, then go back
    load_retry_s: float = 30.0  # a model whose load failed is not tried again for this long
    # Claim up to `prefetch` more of the resident model's tasks per claim, enough for about
    # `prefetch_s` of work at the scheduler's measured service time: fewer round trips for short
    # tasks, none for long ones (so a new higher-priority task never waits behind a long buffer).
    # Tasks claimed ahead are reserved, not started: a killed worker burns no attempts on them.
    # A model with plain sync handlers runs its tasks in runs of about `prefetch_s` of work (at
    # most `prefetch` tasks), committed together: one transaction per run (group commit).
    prefetch: int = 128
    prefetch_s: float = 0.1
    # Delete tasks finished (succeeded, failed, cancelled) more than this long ago, checked
    # every lease_s / 2 (a batch's lines once the batch has ended). None: keep them all.
    retention_s: float | None = 7 * 86_400.0
    # Several workers on one database: each model is loaded by one worker (where it costs
    # least), a second copy only when its backlog is worth it (worker/affinity.py). False: each
    # worker schedules its device as if it were alone.
    affinity: bool = True
    # A `corral serve` node's URL, said with its presence: the other nodes forward requests for
    # the models it holds there (gateway/pipeline/cluster.py). None: a plain worker.
    url: str | None = None
