"""Idle workers on PostgreSQL: queries per second while idle, and how soon a task submitted by
another process starts, with LISTEN/NOTIFY wake-ups and without (plain polling, as before).

Run: `.venv/bin/python benchmarks/bench_wakeups.py [--idle-s 10] [--submits 20]`
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg

import corral
from corral.store import NewTask, open_store
from corral.worker.runtime import Worker, WorkerSettings

PG = "postgresql://postgres@127.0.0.1:5432/test"


class Counting:
    """A store wrapper that counts calls; `push=False` hides the store's wake-ups (polling)."""

    def __init__(self, store: Any, push: bool) -> None:
        self._store = store
        self.calls = 0
        self.wakes_other_processes = push and store.wakes_other_processes

    def subscribe(self, wake: Any) -> Any:
        if self.wakes_other_processes:
            return self._store.subscribe(wake)
        return lambda: None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def run(push: bool, idle_s: float, submits: int) -> tuple[float, list[float]]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    url = f"{PG}?schema={schema}"
    q = corral.Queue(url)
    started: dict[int, float] = {}
    got = threading.Event()

    @q.handler("job", model="m")
    def job(i: int) -> int:
        started[i] = time.time()
        got.set()
        return i

    store = Counting(q.store, push)
    worker = Worker(store, q.registry, q.config())
    other = open_store(url)
    delays: list[float] = []
    rng = random.Random(1)

    async def main() -> float:
        task = asyncio.ensure_future(worker.run())
        await asyncio.sleep(1.0)  # settle
        before = store.calls
        await asyncio.sleep(idle_s)
        idle_rate = (store.calls - before) / idle_s
        for i in range(submits):
            got.clear()
            other.enqueue(NewTask("job", "m", i))
            submitted = time.time()
            await asyncio.to_thread(got.wait, 10)
            delays.append(started[i] - submitted)
            await asyncio.sleep(rng.uniform(0.05, 0.5))  # land anywhere in the poll cycle
        worker.stop()
        await task
        return idle_rate

    idle_rate = asyncio.run(main())
    other.close()
    q.close()
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
    return idle_rate, delays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--submits", type=int, default=20)
    args = ap.parse_args()
    print(f"defaults: {WorkerSettings()}")
    print("| wake-ups | store calls/s while idle | start delay p50 | start delay max |")
    print("|---|---:|---:|---:|")
    for push, label in ((False, "polling every poll_s (before)"), (True, "LISTEN/NOTIFY")):
        rate, delays = run(push, args.idle_s, args.submits)
        print(
            f"| {label} | {rate:.1f} | {statistics.median(delays) * 1000:.0f} ms "
            f"| {max(delays) * 1000:.0f} ms |"
        )


if __name__ == "__main__":
    main()
