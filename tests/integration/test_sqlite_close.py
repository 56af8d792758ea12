"""Closing a SQLite store while other threads still query it must not crash the process.

`corral serve` closes its store on shutdown while a cancelled task's `to_thread` may still be
inside a query (cancelling a task does not stop its thread). Without the connection lock in
`SqliteStore.close` this segfaulted (seen once in CI as `corral serve` exiting with -11; this
script crashed 3 runs out of 3). Run in a subprocess: a segfault must fail the test, not kill
the test runner."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from corral.store import NewTask
    from corral.store.sqlite import SqliteStore

    folder = sys.argv[1]
    for round_ in range(60):
        store = SqliteStore(os.path.join(folder, f"r{round_}.db"))
        store.enqueue_many([NewTask("k", "m", {"i": i}) for i in range(200)])
        stop = False

        def reader():
            while not stop:
                try:
                    store.ready_counts()
                    store.list(limit=200)
                except Exception:  # closed under it: an error is fine, a crash is not
                    return

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        store.close()
        stop = True
        for t in threads:
            t.join()
    print("survived")
    """
)


def test_closing_a_store_under_running_queries_never_crashes(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "survived"
