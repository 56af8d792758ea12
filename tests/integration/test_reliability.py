"""Reliability with real worker processes on real databases: kill -9 mid-drain, and several
workers on one database."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from corral.store import NewTask, TaskStatus, open_store

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
APP = """
import os, time
import corral

q = corral.Queue(os.environ["CORRAL_TEST_DB"])
LOG = os.environ["CORRAL_TEST_LOG"]

@q.handler("work", model="m")
def work(p):
    with open(LOG, "a") as f:
        f.write(f"start {p['i']} {os.getpid()} {time.time()}\\n")
    time.sleep(0.004)
    with open(LOG, "a") as f:
        f.write(f"end {p['i']} {os.getpid()} {time.time()}\\n")
    return p["i"] * 2
"""
WORKER = ["worker", "--app", "app:q", "--lease-s", "1", "--poll-s", "0.02"]


@pytest.fixture
def url(store_url: str) -> str:
    return store_url


@pytest.fixture
def app(tmp_path: Path, url: str) -> tuple[Path, dict[str, str]]:
    (tmp_path / "app.py").write_text(APP)
    env = {
        **os.environ,
        "CORRAL_TEST_DB": url,
        "CORRAL_TEST_LOG": str(tmp_path / "log.txt"),
        "PYTHONPATH": str(tmp_path),
    }
    (tmp_path / "log.txt").write_text("")
    return tmp_path, env


def enqueue(url: str, n: int) -> None:
    store = open_store(url)
    store.enqueue_many([NewTask("work", "m", {"i": i}) for i in range(n)])
    store.close()


def log_lines(folder: Path) -> list[list[str]]:
    return [line.split() for line in (folder / "log.txt").read_text().splitlines() if line]


def assert_all_succeeded_once(url: str, n: int) -> None:
    store = open_store(url)
    tasks = store.list(limit=n + 10)
    store.close()
    assert len(tasks) == n
    bad = [
        t for t in tasks if t.status is not TaskStatus.SUCCEEDED or t.result != 2 * t.payload["i"]
    ]
    assert not bad, bad[:3]


def drain(folder: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        [CORRAL, *WORKER, "--until-idle"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kills", [5, pytest.param(20, marks=pytest.mark.slow)])
def test_kill_9_mid_drain_loses_nothing_and_commits_once(
    url: str, app: tuple[Path, dict[str, str]], kills: int
) -> None:
    folder, env = app
    n = 40 * kills
    enqueue(url, n)
    rng = random.Random(kills)
    for _ in range(kills):
        before = len(log_lines(folder))
        proc = subprocess.Popen(
            [CORRAL, *WORKER],
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        target = before + rng.randint(5, 40)  # kill at a random point of real progress
        deadline = time.monotonic() + 30
        while len(log_lines(folder)) < target and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()  # SIGKILL: no cleanup, leases stay until they expire
        proc.wait()
    drain(folder, env)
    assert_all_succeeded_once(url, n)
    starts = Counter(line[1] for line in log_lines(folder) if line[0] == "start")
    assert set(starts) == {str(i) for i in range(n)}  # at-least-once ...
    # ... and the store committed each exactly once (assert_all_succeeded_once): a task whose
    # worker died mid-run was run again by another worker, and only one commit stood.
    assert len({line[2] for line in log_lines(folder)}) >= 2  # several processes did the work


POISON_APP = """
import os
import corral

# A tiny service-time prior: the worker claims tasks ahead from its first claim.
q = corral.Queue(os.environ["CORRAL_TEST_DB"], config=corral.parse_config(
    "models: {m: {service_s: 0.001}}"))

@q.handler("work", model="m")
def work(p):
    if p["i"] == 7:
        os._exit(9)  # the handler takes its process down, like a segfault or the OOM killer
    return p["i"] * 2
"""


def test_a_task_that_kills_its_worker_uses_up_its_attempts_and_spares_the_rest(
    url: str, app: tuple[Path, dict[str, str]]
) -> None:
    """The poison task runs from the prefetch buffer; its start is counted before the handler
    runs, so it fails after max_attempts. The tasks claimed ahead with it lose no attempt."""
    folder, env = app
    (folder / "app.py").write_text(POISON_APP)
    n = 60
    enqueue(url, n)
    codes = []
    for _ in range(8):
        done = subprocess.run(
            [CORRAL, *WORKER, "--until-idle"], cwd=folder, env=env, capture_output=True, timeout=60
        )
        codes.append(done.returncode)
        if done.returncode == 0:
            break
    assert codes == [9, 9, 9, 0]  # three attempts killed a worker; the fourth run drained
    store = open_store(url)
    tasks = {t.payload["i"]: t for t in store.list(limit=n)}
    store.close()
    poison = tasks.pop(7)
    assert (poison.status, poison.attempts) == (TaskStatus.FAILED, 3)
    assert [e["attempt"] for e in poison.errors] == [1, 2, 3]
    assert all(t.status is TaskStatus.SUCCEEDED for t in tasks.values())
    assert {t.attempts for t in tasks.values()} == {1}  # claimed ahead, yet no attempt burnt


@pytest.mark.parametrize("workers", [2, 4])
def test_several_workers_on_one_database_never_share_a_task(
    url: str, app: tuple[Path, dict[str, str]], workers: int
) -> None:
    folder, env = app
    n = 400  # enough work (4 ms each) that every worker is up before the queue runs dry
    enqueue(url, n)
    procs = [
        subprocess.Popen(
            [CORRAL, *WORKER, "--until-idle"],
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert_all_succeeded_once(url, n)
    lines = log_lines(folder)
    starts = Counter(line[1] for line in lines if line[0] == "start")
    assert all(c == 1 for c in starts.values())
    assert len(starts) == n
    assert len({line[2] for line in lines}) >= 2  # the work was shared


def test_sqlite_locked_by_another_process_is_retryable_and_loses_nothing(tmp_path: Path) -> None:
    from corral.store import StoreBusy
    from corral.store.sqlite import SqliteStore

    path = tmp_path / "t.db"
    store = SqliteStore(path, busy_timeout_s=0.2)
    store.enqueue(NewTask("work", "m", {"i": 0}))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); time.sleep(1.5)\n"
            "c.execute('ROLLBACK')\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(StoreBusy, match="stayed locked beyond the busy timeout"):
        store.enqueue(NewTask("work", "m", {"i": 1}))
    with pytest.raises(StoreBusy):
        store.claim("m", "w", limit=1, lease_s=30)
    holder.wait(10)
    store.enqueue(NewTask("work", "m", {"i": 1}))  # retried after the lock is gone: it works
    claimed = store.claim("m", "w", limit=5, lease_s=30)
    assert sorted(t.payload["i"] for t in claimed) == [0, 1]  # nothing lost, nothing doubled
    store.close()


def test_tasks_nobody_serves_are_reported_by_the_worker_and_tasks_list(
    app: tuple[Path, dict[str, str]], url: str
) -> None:
    folder, env = app
    enqueue(url, 3)
    store = open_store(url)
    store.enqueue_many([NewTask("summarise", "ghost", {"i": i}) for i in range(2)])
    store.close()
    done = subprocess.run(
        [CORRAL, *WORKER, "--until-idle"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # before: silence, and the two tasks queued for good
    assert "2 task(s) queued for model 'ghost', which no running worker serves" in done.stderr
    assert "tasks left queued for models no running worker serves: ghost (2)" in done.stderr
    listed = subprocess.run(
        [CORRAL, "tasks", "list", "--db", url], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert "queued for models no running worker serves: ghost (2)" in listed.stderr
    assert "no worker seen in the last 60 s" in listed.stderr  # the worker said goodbye
    # a worker that serves `m` only, still running: it is named, and `m` is not reported
    worker = subprocess.Popen(
        [CORRAL, *WORKER], cwd=folder, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            listed = subprocess.run(
                [CORRAL, "tasks", "list", "--db", url], capture_output=True, text=True, timeout=60
            )
            if "serves m)" in listed.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "ghost (2)" in listed.stderr
        assert "serves m)" in listed.stderr
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
