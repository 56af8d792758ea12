"""A large batch's file is checked, and its lines stored, in a process of its own at a lower
priority (`batch/checker.py`), on real SQLite and PostgreSQL stores: what it finds is what the
tick would have found, and a check killed midway loses and doubles nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from corral.batch import checker as checker_module
from corral.batch.checker import NICE, Checker
from corral.batch.files import FileStorage
from corral.batch.service import BatchService
from corral.config import BatchConfig
from corral.config.schema import Names
from corral.store import Store, TaskStatus, open_store

NAMES = Names({"m": "m", "alias-of-m": "m", "n:latest": "n"})


def _setup(url: str, tmp_path: Path, limits: BatchConfig) -> tuple[BatchService, Checker, Store]:
    store = open_store(url)
    files = FileStorage(tmp_path / "files")
    svc = BatchService(store, files, limits, NAMES)
    check = Checker(url, files.root, limits, svc.max_line_bytes, lambda: NAMES)
    svc.elsewhere = check
    return svc, check, store


def _upload(svc: BatchService, lines: list[dict[str, object]]) -> str:
    file_id = svc.files.new_id()
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    svc.files.write(file_id, [data])
    svc.add_file(file_id, "in.jsonl", "batch", len(data))
    return file_id


def _line(i: int, model: str = "m") -> dict[str, object]:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_the_check_runs_elsewhere_and_finds_what_the_tick_would(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Every file is large (validate_inline_mb 0): each batch waits for the tick's check.
    svc, check, store = _setup(store_url, tmp_path, BatchConfig(validate_inline_mb=0))
    try:
        lines = [_line(i, ("m", "alias-of-m", "n")[i % 3]) for i in range(300)]
        good = svc.create(_upload(svc, lines), "/v1/chat/completions")
        bad_lines = [*lines[:10], _line(10, "nope"), _line(3)]
        bad = svc.create(_upload(svc, bad_lines), "/v1/chat/completions")
        assert good.status == bad.status == "validating"
        with caplog.at_level(logging.INFO, logger="corral.batch"):
            svc.tick()
        good, bad = store.batches.get(good.id), store.batches.get(bad.id)
        assert good.status == "in_progress"
        assert good.data["models"] == {"m": 200, "n": 100}  # an alias and `:latest` resolved
        assert store.batches.counts(good.id) == {TaskStatus.QUEUED: 300}
        assert bad.status == "failed"
        found = [(e["line"], e["code"]) for e in bad.data["errors"]]
        assert found == [(11, "model_not_found"), (12, "duplicate_custom_id")]
        # Each was checked by another process, at the lower priority.
        said = re.findall(r"batch (\S+) is (\w+): .* by process (\d+) \(nice (\d+)\)", caplog.text)
        by_batch = {b: (status, int(pid), int(nice)) for b, status, pid, nice in said}
        assert by_batch.keys() == {good.id, bad.id}
        assert [by_batch[good.id][0], by_batch[bad.id][0]] == ["in_progress", "failed"]
        for _, pid, nice in by_batch.values():
            assert pid != os.getpid()
            assert nice == min(19, os.nice(0) + NICE)
    finally:
        check.close()
        store.close()


def test_a_check_killed_midway_loses_and_doubles_nothing(
    store_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checker_module, "RESTART_S", 0.05)  # the next try, soon
    svc, check, store = _setup(store_url, tmp_path, BatchConfig(validate_inline_mb=0))
    try:
        n = 40_000  # 20 transactions of lines: time to find the check between two of them
        b = svc.create(_upload(svc, [_line(i) for i in range(n)]), "/v1/chat/completions")
        errors: list[BaseException] = []

        def tick() -> None:
            try:
                svc.tick()
            except BaseException as exc:
                errors.append(exc)

        first = threading.Thread(target=tick)
        first.start()
        # Its first lines are stored, held back, and the batch is still validating: kill it.
        deadline = time.monotonic() + 120
        while not (store.batches.counts(b.id) and check.running()):
            assert time.monotonic() < deadline, "the check never stored a line"
            time.sleep(0.005)
        (pid,) = check.running()
        os.kill(pid, signal.SIGKILL)
        first.join(60)
        assert len(errors) == 1
        assert "died" in str(errors[0])
        assert store.batches.get(b.id).status == "validating"
        time.sleep(0.1)  # past RESTART_S
        svc.tick()
        assert store.batches.get(b.id).status == "in_progress"
        # Every line once: the killed attempt's held lines are gone.
        assert store.batches.counts(b.id) == {TaskStatus.QUEUED: n}
        ids: set[str] = set()
        seq = 0
        while page := store.batches.tasks(b.id, after_seq=seq):
            ids.update(t.payload["custom_id"] for t in page)
            seq = page[-1].seq
        assert len(ids) == n
    finally:
        check.close()
        store.close()
