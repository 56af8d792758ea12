"""The store's own cost per operation, in one process: claim one task and finish it, then
enqueue one by one, on a SQLite file (no workers, no peers: what a change to the store's code
costs, apart from the machine's swings between worker processes).

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/bench_store_ops.py [--tasks N]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from corral.store import NewTask, open_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=6000)
    args = ap.parse_args()
    n = args.tasks
    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"sqlite:///{d}/ops.db")
        store.enqueue_many([NewTask("k", "m", {"i": i}) for i in range(n)])
        t = time.perf_counter()
        done = 0
        while done < n:
            for task in store.claim("m", "w", 1, 60.0):
                store.finish(task.id, str(task.lease_token), {"ok": 1})
                done += 1
        claim_finish_hz = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(n // 2):
            store.enqueue(NewTask("k", "m2", {"i": i}))
        enqueue_hz = (n // 2) / (time.perf_counter() - t)
        store.close()
    print(f"claim+finish {claim_finish_hz:,.0f}/s, enqueue {enqueue_hz:,.0f}/s ({n:,} tasks)")


if __name__ == "__main__":
    main()
