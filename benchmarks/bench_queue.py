"""Task queue throughput, side by side with a peer on the same database.

For each system: single enqueue (1,000 calls of its public API; on PostgreSQL, 10 blocks of 100
taken in turns with the other systems, median block: see `single_rates`), bulk enqueue (`--tasks`
in one call, where the system has a bulk API; on PostgreSQL the median of 3, in turns), and
claim+complete with 1 and with 4 worker processes draining `--tasks` no-op tasks (each result
stored). Peers: huey on SQLite (at its default
`synchronous` and with `fsync=False`), procrastinate and pgqueuer (asyncpg; no results kept) on
PostgreSQL.

Drain rates are steady state: workers start on a full queue; the clock runs from 10% done to
100% done, so process start-up (imports, connections) is left out for every system alike.

Run: `make bench-queue` (installs the peers into .venv-bench), or
`.venv-bench/bin/python benchmarks/bench_queue.py [--tasks N] [--only sqlite|postgres]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import json
import os
import platform
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
APPS = HERE / "apps"
BIN = Path(sys.executable).parent
PG = "postgresql://postgres@127.0.0.1:5432/test"


@dataclass
class Row:
    system: str
    store: str
    guarantee: str
    single_enqueue_per_s: float | None = None
    bulk_enqueue_per_s: float | None = None
    drain_per_s: dict[int, float] = field(default_factory=dict)  # workers -> tasks/s


@dataclass
class System:
    """How the benchmark drives one queue: enqueue in-process, drain with worker processes."""

    name: str
    store: str
    guarantee: str
    env: dict[str, str]
    setup: Callable[[], None]  # a fresh, empty queue
    single: Callable[[int], object]  # enqueue one task
    bulk: Callable[[int], object] | None  # enqueue n tasks in one call
    worker: list[str]  # one worker process (concurrency 1)
    done: Callable[[], int]  # tasks completed so far
    teardown: Callable[[], None]


def _rate(n: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t)


@contextlib.contextmanager
def _workers(system: System, count: int) -> Iterator[None]:
    # The apps' folder first, then the caller's path: workers run the code the parent runs
    # (a before/after comparison sets PYTHONPATH to the checkout under test).
    path = os.pathsep.join(p for p in (str(APPS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **system.env, "PYTHONPATH": path}
    procs = [
        subprocess.Popen(
            system.worker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def drain_rate(system: System, n: int, workers: int) -> float:
    system.setup()
    if system.bulk is not None:
        system.bulk(n)
    else:
        for i in range(n):
            system.single(i)
    deadline = time.monotonic() + 600
    t0 = n0 = None
    with _workers(system, workers):
        while time.monotonic() < deadline:
            done = system.done()
            now = time.perf_counter()
            if t0 is None and done >= n // 10:
                t0, n0 = now, done
            if done >= n:
                assert t0 is not None
                assert n0 is not None
                return (n - n0) / (now - t0) if now > t0 else float("nan")
            time.sleep(0.05)  # a light poll: the machine has 2 cores to share
    raise RuntimeError(f"{system.name} did not drain {n} tasks in 600 s")


def _block(system: System, first: int, n: int) -> None:
    for i in range(first, first + n):
        system.single(i)


def single_rates(systems: list[System], rounds: int = 10, block: int = 100) -> dict[str, float]:
    """Single-enqueue rates of several systems on one database, taken in turns: `rounds` blocks
    of `block` enqueues each, the systems alternating, the median block per system. A commit
    waits for the disk's flush, whose latency drifts over minutes (checkpoints, the VM's
    neighbours); in turns, the drift hits every system alike."""
    for system in systems:
        system.setup()
    blocks: dict[str, list[float]] = {s.name: [] for s in systems}
    for r in range(rounds):
        for system in systems:
            one = functools.partial(_block, system, r * block, block)
            blocks[system.name].append(_rate(block, one))
    return {name: statistics.median(rates) for name, rates in blocks.items()}


def bulk_rates(systems: list[System], n: int, rounds: int = 3) -> dict[str, float]:
    """Bulk-enqueue rates (`n` tasks in one call, into an empty queue) in turns, as
    `single_rates`: `rounds` per system, the systems alternating, the median per system."""
    runs: dict[str, list[float]] = {s.name: [] for s in systems if s.bulk is not None}
    for _ in range(rounds):
        for system in systems:
            if system.bulk is not None:
                system.setup()
                runs[system.name].append(_rate(n, functools.partial(system.bulk, n)))
    return {name: statistics.median(rates) for name, rates in runs.items()}


def measure(
    system: System,
    n: int,
    worker_counts: list[int],
    single_per_s: float | None = None,
    bulk_per_s: float | None = None,
) -> Row:
    """`single_per_s`, `bulk_per_s`: measured already, in turns with the other systems of the
    store (`single_rates`, `bulk_rates`)."""
    row = Row(system.name, system.store, system.guarantee)
    if single_per_s is None:
        system.setup()
        row.single_enqueue_per_s = _rate(1000, lambda: [system.single(i) for i in range(1000)])
    else:
        row.single_enqueue_per_s = single_per_s
    if bulk_per_s is not None:
        row.bulk_enqueue_per_s = bulk_per_s
    elif system.bulk is not None:
        system.setup()
        bulk = system.bulk
        row.bulk_enqueue_per_s = _rate(n, lambda: bulk(n))
    for w in worker_counts:
        row.drain_per_s[w] = drain_rate(system, n, w)
        print(f"  {system.name}: {w} worker(s) {row.drain_per_s[w]:,.0f} tasks/s", flush=True)
    system.teardown()
    return row


# --- the systems --------------------------------------------------------------------------------
def corral_system(url: str, store: str, reset: Callable[[], None]) -> System:
    sys.path.insert(0, str(APPS))
    os.environ["BENCH_URL"] = url
    import corral
    from corral.store import NewTask, TaskStatus

    state: dict[str, corral.Queue] = {}

    def setup() -> None:
        if "q" in state:
            state["q"].close()
        reset()
        state["q"] = corral.Queue(url)

    def done() -> int:
        return state["q"].store.counts().get("m", {}).get(TaskStatus.SUCCEEDED, 0)

    return System(
        name="corral",
        store=store,
        guarantee="at-least-once run, exactly-once commit (leases, fencing)",
        env={"BENCH_URL": url},
        setup=setup,
        single=lambda i: state["q"].store.enqueue(NewTask("noop", "m", {"i": i})),
        bulk=lambda n: state["q"].store.enqueue_many(
            [NewTask("noop", "m", {"i": i}) for i in range(n)]
        ),
        worker=[str(BIN / "corral"), "worker", "--app", "corral_app:q"],
        done=done,
        teardown=lambda: state["q"].close(),
    )


def huey_system(path: str, fsync: str) -> System:
    os.environ["BENCH_SQLITE"] = path
    os.environ["BENCH_HUEY_FSYNC"] = fsync
    sys.path.insert(0, str(APPS))
    import huey_app

    importlib.reload(huey_app)  # each configuration has its own file and fsync setting

    def setup() -> None:
        huey_app.huey.storage.flush_queue()
        huey_app.huey.storage.flush_results()

    def done() -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM kv").fetchone()[0])

    return System(
        name=f"huey (fsync={'default' if fsync == 'default' else 'False'})",
        store="SQLite",
        guarantee="at-most-once (a task is deleted when dequeued; a crash loses it)",
        env={"BENCH_SQLITE": path, "BENCH_HUEY_FSYNC": fsync},
        setup=setup,
        single=lambda i: huey_app.noop(i),
        bulk=None,  # huey has no bulk enqueue
        worker=[str(BIN / "huey_consumer"), "huey_app.huey", "-w", "1", "-d", "0.01", "-q"],
        done=done,
        teardown=lambda: None,
    )


def procrastinate_system(schema: str) -> System:
    os.environ["BENCH_PG"] = PG
    os.environ["BENCH_PG_SCHEMA"] = schema
    sys.path.insert(0, str(APPS))
    import procrastinate_app

    app = procrastinate_app.app

    opened: list[bool] = []

    def teardown() -> None:
        if opened:  # connections cache the schema's types: never keep them across a drop
            app.close()
            opened.clear()
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

    def setup() -> None:
        teardown()
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        app.open()
        opened.append(True)
        app.schema_manager.apply_schema()

    def done() -> int:
        with psycopg.connect(PG, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT COUNT(*) FROM {schema}.procrastinate_jobs WHERE status = 'succeeded'"
            ).fetchone()
            return int(row[0]) if row else 0

    def bulk(n: int) -> None:
        procrastinate_app.noop.batch_defer(*[{"i": i} for i in range(n)])

    return System(
        name="procrastinate",
        store="PostgreSQL",
        guarantee="at-least-once (stalled jobs retried once their worker's heartbeat stops)",
        env={"BENCH_PG": PG, "BENCH_PG_SCHEMA": schema},
        setup=setup,
        single=lambda i: procrastinate_app.noop.defer(i=i),
        bulk=bulk,
        worker=[
            str(BIN / "procrastinate"),
            "--app=procrastinate_app.app",
            "--log-level=warning",
            "worker",
            "--concurrency=1",
        ],
        done=done,
        teardown=teardown,
    )


def pgqueuer_system(schema: str) -> System:
    """pgqueuer 1.6.0 through its Python API on asyncpg (its CLI worker crashes at start here),
    with its defaults: durable tables, batch_size 10, no results stored (a finished job is
    deleted and logged)."""
    os.environ["BENCH_PG"] = PG
    os.environ["BENCH_PG_SCHEMA"] = schema
    sys.path.insert(0, str(APPS))
    import pgqueuer_app
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    runner = asyncio.Runner()
    state: dict[str, Any] = {}
    enqueued = [0]

    def drop() -> None:
        if "conn" in state:
            runner.run(state.pop("conn").close())
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

    def setup() -> None:
        drop()
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        os.environ["BENCH_PG_SCHEMA"] = schema  # connect() reads it: the other peers set it too
        state["conn"] = runner.run(pgqueuer_app.connect())
        state["q"] = Queries(AsyncpgDriver(state["conn"]))
        runner.run(state["q"].install())
        enqueued[0] = 0

    def single(i: int) -> None:
        runner.run(state["q"].enqueue("noop", str(i).encode()))
        enqueued[0] += 1

    def bulk(n: int) -> None:
        runner.run(state["q"].enqueue(["noop"] * n, [str(i).encode() for i in range(n)], [0] * n))
        enqueued[0] += n

    def done() -> int:  # a finished job leaves the queue table
        with psycopg.connect(PG, autocommit=True) as conn:
            row = conn.execute(f"SELECT COUNT(*) FROM {schema}.pgqueuer").fetchone()
            return enqueued[0] - (int(row[0]) if row else 0)

    def teardown() -> None:
        drop()
        runner.close()

    return System(
        name="pgqueuer",
        store="PostgreSQL",
        guarantee="at-least-once (a stalled job is re-picked after its heartbeat times out); "
        "no results stored",
        env={"BENCH_PG": PG, "BENCH_PG_SCHEMA": schema},
        setup=setup,
        single=single,
        bulk=bulk,
        worker=[str(BIN / "python"), str(APPS / "pgqueuer_app.py")],
        done=done,
        teardown=teardown,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--only", choices=["sqlite", "postgres"], default=None)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", type=Path, default=Path("out/bench_queue.json"))
    args = ap.parse_args()
    for tool in ("corral", "huey_consumer", "procrastinate"):
        if not (BIN / tool).exists():
            sys.exit(f"{tool} is not installed next to {sys.executable}: run `make bench-queue`")
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    if args.only in (None, "sqlite"):
        db = tmp / "corral.db"

        def reset_sqlite() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)

        print("SQLite", flush=True)
        rows.append(
            measure(
                corral_system(f"sqlite:///{db}", "SQLite", reset_sqlite), args.tasks, args.workers
            )
        )
        for fsync in ("default", "off"):
            rows.append(
                measure(huey_system(str(tmp / f"huey-{fsync}.db"), fsync), args.tasks, args.workers)
            )
    if args.only in (None, "postgres"):
        schema = f"bench_{uuid.uuid4().hex[:8]}"

        def reset_pg() -> None:
            with psycopg.connect(PG, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

        print("PostgreSQL", flush=True)
        pg_systems = [
            corral_system(f"{PG}?schema={schema}", "PostgreSQL", reset_pg),
            procrastinate_system(f"bench_p_{uuid.uuid4().hex[:8]}"),
            pgqueuer_system(f"bench_q_{uuid.uuid4().hex[:8]}"),
        ]
        singles = single_rates(pg_systems)
        bulks = bulk_rates(pg_systems, args.tasks)
        for system in pg_systems:
            rows.append(
                measure(
                    system, args.tasks, args.workers, singles[system.name], bulks.get(system.name)
                )
            )
        reset_pg()
    shutil.rmtree(tmp, ignore_errors=True)
    report(rows, args)


def report(rows: list[Row], args: argparse.Namespace) -> None:
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:,.0f}"

    print(f"\n{args.tasks:,} tasks, no-op handler; {platform.node()}, {os.cpu_count()} CPUs\n")
    head = "| store | system | single enqueue /s | bulk enqueue /s | " + " | ".join(
        f"claim+complete, {w} worker{'s' if w > 1 else ''} /s" for w in args.workers
    )
    print(head + " |")
    print("|" + "---|" * (4 + len(args.workers)))
    for r in rows:
        cells = [r.store, r.system, f(r.single_enqueue_per_s), f(r.bulk_enqueue_per_s)]
        cells += [f(r.drain_per_s.get(w)) for w in args.workers]
        print("| " + " | ".join(cells) + " |")
    print("\nRatios (Corral / peer):")
    for store in dict.fromkeys(r.store for r in rows):
        ours = next(r for r in rows if r.store == store and r.system == "corral")
        for peer in (r for r in rows if r.store == store and r.system != "corral"):
            parts = []
            for label, a, b in [
                ("single", ours.single_enqueue_per_s, peer.single_enqueue_per_s),
                ("bulk", ours.bulk_enqueue_per_s, peer.bulk_enqueue_per_s),
                *[
                    (f"{w}w", ours.drain_per_s.get(w), peer.drain_per_s.get(w))
                    for w in args.workers
                ],
            ]:
                parts.append(f"{label} {a / b:.2f}x" if a and b else f"{label} n/a")
            print(f"- {store}, vs {peer.system}: " + ", ".join(parts))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
