"""Task queue throughput on one database: bulk and single enqueue, claim+complete with a no-op
handler and one worker (issue 3). The peer comparison (huey, procrastinate) is still to come.

Run: `.venv/bin/python benchmarks/bench_queue.py [--db URL] [--tasks N] [--prefetch K]`
(default: a fresh SQLite file; for PostgreSQL use postgresql://postgres@127.0.0.1/test).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

import psycopg

import corral
from corral.store import NewTask
from corral.worker.runtime import WorkerSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=None, help="store URL (default: a new SQLite file)")
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--prefetch", type=int, default=0)
    args = ap.parse_args()
    schema = None
    if args.db is None:
        url = f"sqlite:///{tempfile.mkdtemp()}/bench.db"
    elif args.db.startswith("postgres"):
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        url = f"{args.db}?schema={schema}"
    else:
        url = args.db
    q = corral.Queue(url)

    @q.handler("noop", model="m")
    def noop(payload: object) -> None:
        return None

    n = args.tasks
    t = time.perf_counter()
    q.store.enqueue_many([NewTask("noop", "m", {"i": i}) for i in range(n)])
    bulk = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(1000):
        q.submit("noop", {"i": i})
    single = 1000 / (time.perf_counter() - t)
    t = time.perf_counter()
    q.run_worker(until_idle=True, settings=WorkerSettings(prefetch=args.prefetch))
    drain = (n + 1000) / (time.perf_counter() - t)
    q.close()
    if schema is not None:
        with psycopg.connect(args.db, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    print(
        f"{url.split(':')[0]}, {n:,} tasks, prefetch {args.prefetch}: bulk enqueue {bulk:,.0f}/s, "
        f"single enqueue {single:,.0f}/s, claim+complete (1 worker) {drain:,.0f}/s"
    )


if __name__ == "__main__":
    main()
