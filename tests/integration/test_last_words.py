"""A worker killed mid-run, on a real database: its last words (a file on this host) say which
task was running, so only that one counts the attempt and its group keeps running in groups;
a worker that cannot read them (another host) falls back to the group rule."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.store import NewTask, Store, Task, TaskStatus, open_store
from corral.worker.last_words import HEADER, SLOT, SLOTS, LastWords, _records, hear_the_dead

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
APP = """
import os, time
import corral

q = corral.Queue(os.environ["CORRAL_TEST_DB"], config=corral.parse_config(
    "models: {m: {service_s: 0.02}}"))

@q.handler("work", model="m")
def work(p):
    with open(os.environ["CORRAL_TEST_LOG"], "a") as f:
        f.write(f"start {p['i']}\\n")
    time.sleep(0.02)
    return p["i"]
"""
WORKER = [CORRAL, "worker", "--app", "app:q", "--lease-s", "1", "--poll-s", "0.02"]


@pytest.fixture
def app(tmp_path: Path, store_url: str) -> tuple[Path, dict[str, str]]:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "log.txt").write_text("")
    env = {
        **os.environ,
        "CORRAL_TEST_DB": store_url,
        "CORRAL_TEST_LOG": str(tmp_path / "log.txt"),
        "CORRAL_RUN_DIR": str(tmp_path / "run"),
        "PYTHONPATH": str(tmp_path),
    }
    return tmp_path, env


def kill_mid_run(folder: Path, env: dict[str, str], url: str, n: int) -> None:
    """Enqueue n tasks, start a worker and kill -9 it once it is well into a group run."""
    store = open_store(url)
    store.enqueue_many([NewTask("work", "m", {"i": i}) for i in range(n)])
    store.close()
    proc = subprocess.Popen(WORKER, cwd=folder, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while (folder / "log.txt").read_text().count("start") < 30:
        assert time.monotonic() < deadline, "the worker never got going"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def drain(folder: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [*WORKER, "--until-idle"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def tasks_of(url: str, n: int) -> list[Task]:
    store = open_store(url)
    try:
        return store.list(limit=n + 5)
    finally:
        store.close()


def test_a_killed_worker_charges_only_the_task_it_was_running(
    app: tuple[Path, dict[str, str]], store_url: str
) -> None:
    folder, env = app
    n = 200
    kill_mid_run(folder, env, store_url, n)
    words = list((folder / "run").glob("*.words"))
    assert len(words) == 1  # the dead worker's file, left behind
    # What it had started and not committed: the task it was running and the rest of its run
    # (claimed-ahead tasks it had not started have no start mark).
    started = {
        t.id for t in tasks_of(store_url, n) if t.status is TaskStatus.RUNNING and t.started_at
    }
    log = drain(folder, env)
    assert "died while running" in log
    assert not list((folder / "run").glob("*.words"))  # read, then removed (and its own too)
    tasks = tasks_of(store_url, n)
    assert len(tasks) == n
    assert all(t.status is TaskStatus.SUCCEEDED for t in tasks)
    charged = [t for t in tasks if t.attempts == 2]
    assert len(charged) <= 1  # the one it was running (none if killed between two tasks)
    assert all(t.attempts == 1 for t in tasks if t not in charged)
    assert not any(t.run_alone for t in tasks)  # its group was cleared: groups go on
    refunded = [t for t in tasks if any(e.get("counted") is False for e in t.errors)]
    assert {t.id for t in refunded} <= started - {t.id for t in charged}
    if len(started) > 1:  # killed in a run of several (a busy machine can make runs of one)
        assert refunded  # the rest of its group got their attempt back ...
    assert all("not running" in t.errors[0]["error"] for t in refunded)  # ... being idle
    for t in charged:
        assert [e.get("counted", True) for e in t.errors] == [True]


def test_a_worker_on_another_host_falls_back_to_the_group_rule(
    app: tuple[Path, dict[str, str]], store_url: str, tmp_path: Path
) -> None:
    """The file is this host's: a worker elsewhere (here: another run folder) never reads it,
    so the dead worker's groups get their attempts back and run alone."""
    folder, env = app
    n = 200
    kill_mid_run(folder, env, store_url, n)
    drain(folder, {**env, "CORRAL_RUN_DIR": str(tmp_path / "elsewhere")})
    tasks = tasks_of(store_url, n)
    assert all(t.status is TaskStatus.SUCCEEDED for t in tasks)
    assert all(t.attempts == 1 for t in tasks)  # nobody charged ...
    assert any(t.run_alone for t in tasks)  # ... and the suspects ran alone
    assert len(list((folder / "run").glob("*.words"))) == 1  # unread, still there


class _Identity:
    """What `LastWords` needs of a store."""

    def __init__(self, identity: str | None) -> None:
        self.identity = identity


def _task(i: int, task_id: str | None = None) -> Task:
    return Task(
        task_id or f"task{i}", i, "k", "m", {}, 0, None, TaskStatus.RUNNING, 1, 3, 0.0, 0.0,
        lease_token=f"tok{i}",
    )  # fmt: skip


def test_records_are_written_cleared_and_parsed(tmp_path: Path) -> None:
    words = LastWords(_Identity("sqlite:/x"), "w:1", tmp_path)  # type: ignore[arg-type]
    assert words.path is not None
    slots = words.say([_task(1), _task(2)])
    assert _records(words.path.read_bytes()) == [("task1", "tok1"), ("task2", "tok2")]
    words.unsay(slots[:1])
    assert _records(words.path.read_bytes()) == [("task2", "tok2")]
    data = bytearray(words.path.read_bytes())
    data[HEADER + SLOT + 3 : HEADER + SLOT + 6] = b"   "  # torn mid-copy
    assert _records(bytes(data)) is None
    words.close()
    assert not words.path.exists()
    assert not list(tmp_path.iterdir())


def test_words_that_do_not_fit_are_never_used(tmp_path: Path) -> None:
    words = LastWords(_Identity("sqlite:/x"), "w:1", tmp_path)  # type: ignore[arg-type]
    assert words.path is not None
    words.say([_task(i) for i in range(SLOTS)])
    assert len(_records(words.path.read_bytes()) or []) == SLOTS
    assert words.say([_task(-1)]) == []  # no room: the words are incomplete from now on
    assert _records(words.path.read_bytes()) is None
    long = _task(0, "x" * SLOT)
    words.close()
    words = LastWords(_Identity("sqlite:/x"), "w:2", tmp_path)  # type: ignore[arg-type]
    assert words.say([long]) == []
    assert words.path is not None
    assert _records(words.path.read_bytes()) is None
    words.close()


def test_a_store_no_other_process_shares_keeps_no_words(tmp_path: Path) -> None:
    store: Store = open_store("memory://")
    words = LastWords(store, "w", tmp_path)
    assert words.path is None
    assert words.say([_task(1)]) == []
    assert hear_the_dead(store, tmp_path) == 0
    assert not list(tmp_path.iterdir())


def test_a_live_workers_words_are_left_alone(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/tasks.db")
    words = LastWords(store, "w:live", tmp_path / "run")
    try:
        assert hear_the_dead(store, tmp_path / "run") == 0  # its lock is held
        assert words.path is not None
        assert words.path.exists()
    finally:
        words.close()
        store.close()
