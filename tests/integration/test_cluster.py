"""A cluster of real `corral worker` processes on one database, with model affinity: each model
loaded once rather than by every worker, and a killed worker's model and tasks taken over."""

from __future__ import annotations

import os
import shutil
import signal
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

MODELS = int(os.environ["T_MODELS"])
LOG = os.environ["T_LOG"]
q = corral.Queue(os.environ["T_DB"], config=corral.parse_config(
    "models: {" + ", ".join(f"m{i}: {{load_s: 0.2, service_s: 0.03}}" for i in range(MODELS))
    + "}"))

def loader(name):
    def load():
        time.sleep(0.2)
        with open(LOG, "a") as f:
            f.write(f"load {name} {os.getpid()}\\n")
    return load

def work(p):
    time.sleep(0.03)
    with open(LOG, "a") as f:
        f.write(f"task {p['i']} {os.getpid()}\\n")
    return p["i"]

for i in range(MODELS):
    q.model(f"m{i}", load=loader(f"m{i}"))
    q.handler(f"k{i}", model=f"m{i}")(work)
"""


def setup(folder: Path, url: str, models: int, n: int) -> dict[str, str]:
    (folder / "app.py").write_text(APP)
    (folder / "log.txt").write_text("")
    store = open_store(url)
    store.enqueue_many([NewTask(f"k{i % models}", f"m{i % models}", {"i": i}) for i in range(n)])
    store.close()
    return {
        **os.environ,
        "T_DB": url,
        "T_MODELS": str(models),
        "T_LOG": str(folder / "log.txt"),
        "PYTHONPATH": str(folder),
    }


def lines(folder: Path, kind: str) -> list[list[str]]:
    return [x.split() for x in (folder / "log.txt").read_text().splitlines() if x.startswith(kind)]


def all_done_once(url: str, n: int) -> None:
    store = open_store(url)
    tasks = store.list(limit=n + 1)
    store.close()
    assert len(tasks) == n
    assert all(t.status is TaskStatus.SUCCEEDED and t.result == t.payload["i"] for t in tasks)


def drain(folder: Path, env: dict[str, str], workers: int, *extra: str) -> None:
    cmd = [CORRAL, "worker", "--app", "app:q", "--until-idle", "--lease-s", "2", *extra]
    procs = [subprocess.Popen(cmd, cwd=folder, env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(workers)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


@pytest.mark.parametrize("affinity", [True, False])
def test_four_workers_on_four_models_load_each_model_once(
    tmp_path: Path, store_url: str, affinity: bool
) -> None:
    n = 4 * 60
    env = setup(tmp_path, store_url, 4, n)
    drain(tmp_path, env, 4, *([] if affinity else ["--no-affinity"]))
    all_done_once(store_url, n)
    loads = lines(tmp_path, "load")
    if affinity:
        assert len(loads) <= 5  # one per model (a start-up race may cost one more)
        workers_used = Counter(x[2] for x in loads)
        assert len(workers_used) >= 3  # spread over the workers, not one worker swapping
    else:
        assert len(loads) >= 8  # each worker loads most models: what affinity is for


def test_a_killed_workers_model_and_tasks_are_taken_over(tmp_path: Path, store_url: str) -> None:
    n = 2 * 150
    env = setup(tmp_path, store_url, 2, n)
    cmd = [CORRAL, "worker", "--app", "app:q", "--lease-s", "1"]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    second = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len({x[2] for x in lines(tmp_path, "load")}) < 2:  # each took one model
            assert time.monotonic() < deadline, lines(tmp_path, "load")
            time.sleep(0.05)
        assert len(lines(tmp_path, "load")) == 2
        victim_model = next(x[1] for x in lines(tmp_path, "load") if x[2] == str(first.pid))
        first.send_signal(signal.SIGKILL)
        first.wait()
        # The survivor takes its model over once the dead worker's rows age out (a lease)
        # and its tasks once their leases expire.
        while not any(x[1] == victim_model and x[2] == str(second.pid)
                      for x in lines(tmp_path, "load")):  # fmt: skip
            assert time.monotonic() < deadline, lines(tmp_path, "load")
            time.sleep(0.05)
    finally:
        first.kill()
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    drain(tmp_path, env, 1)
    all_done_once(store_url, n)
