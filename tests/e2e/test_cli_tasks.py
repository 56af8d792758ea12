"""`corral db` and `corral tasks` as real processes on real SQLite and PostgreSQL stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.store import NewTask, TaskStatus, open_store
from corral.store.migrations import migrations
from corral.store.sqlite import DIALECT as SQLITE_DIALECT
from tests.e2e.test_cli import corral


@pytest.fixture
def db(store_url: str) -> str:
    return store_url


def seed(db: str) -> list[str]:
    store = open_store(db)
    ids = store.enqueue_many(
        [NewTask("cover_letter", "cover-writer", {"job": i}) for i in range(3)]
        + [NewTask("research", "research-8b", {"job": 9})]
    )
    (t,) = store.claim("cover-writer", "w1", 1, 30)
    store.fail(t.id, t.lease_token or "", "model timed out", None)
    store.close()
    return ids


def test_db_upgrade_applies_then_reports_up_to_date(db: str) -> None:
    latest = migrations(SQLITE_DIALECT)[-1][0]
    applied = ", ".join(str(v) for v in range(1, latest + 1))
    assert (
        f"schema version {latest} (applied {applied})" in corral("db", "upgrade", "--db", db).stdout
    )
    assert "(already up to date)" in corral("db", "upgrade", "--db", db).stdout


def test_tasks_list_filters_and_json(db: str) -> None:
    ids = seed(db)
    table = corral("tasks", "list", "--db", db).stdout
    assert "model timed out" in table
    assert "cover-writer: 1 failed 2 queued" in table
    rows = [
        json.loads(x)
        for x in corral(
            "tasks", "list", "--db", db, "--json", "--model", "cover-writer", "--status", "queued"
        ).stdout.splitlines()
    ]
    assert [r["id"] for r in rows] == [ids[2], ids[1]]  # newest first
    env_rows = corral("tasks", "list", "--json", env={"CORRAL_DB": db}).stdout.splitlines()
    assert len(env_rows) == 4


def test_tasks_show_cancel_retry(db: str) -> None:
    ids = seed(db)
    shown = json.loads(corral("tasks", "show", ids[0], "--db", db, "--json").stdout)
    assert shown["status"] == "failed"
    assert shown["errors"][0]["error"] == "model timed out"
    assert "model timed out" in corral("tasks", "show", ids[0], "--db", db).stdout
    assert f"{ids[1]}: cancelled" in corral("tasks", "cancel", ids[1], "--db", db).stdout
    assert f"{ids[0]}: queued" in corral("tasks", "retry", ids[0], "--db", db).stdout
    store = open_store(db)
    assert store.get(ids[1]).status is TaskStatus.CANCELLED
    assert store.get(ids[0]).attempts == 0
    store.close()


def test_tasks_purge_deletes_old_finished_tasks(db: str) -> None:
    ids = seed(db)  # one failed (just now), three queued
    out = corral("tasks", "purge", "--older-than-s", "3600", "--db", db).stdout
    assert "deleted 0 finished task(s) older than 3600 s" in out
    out = corral("tasks", "purge", "--older-than-s", "0", "--db", db).stdout
    assert "deleted 1 finished task(s)" in out
    store = open_store(db)
    assert {t.id for t in store.list()} == set(ids[1:])
    store.close()


def test_tasks_errors_are_clear(db: str, tmp_path: Path) -> None:
    seed(db)
    p = corral("tasks", "show", "nope", "--db", db, ok=False)
    assert p.returncode == 2
    assert "no task with id 'nope'" in p.stderr
    p = corral("tasks", "list", "--status", "lost", "--db", db, ok=False)
    assert p.returncode == 2
    assert "lost" in p.stderr
    p = corral("tasks", "list", "--db", "redis://x", ok=False)
    assert p.returncode == 2
    assert "unknown store URL 'redis://x'" in p.stderr
    (tmp_path / "f").write_text("")
    p = corral("tasks", "list", "--db", f"sqlite:///{tmp_path}/f/x.db", ok=False)
    assert p.returncode == 2
    assert "no database at" in p.stderr  # read-only commands never create one
    assert os.environ.get("CORRAL_DB") is None


def test_read_only_commands_never_create_a_database(tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "dir" / "tasks.db"
    for args in (("tasks", "list"), ("tasks", "show", "x"), ("tasks", "cancel", "x")):
        r = corral(*args, "--db", f"sqlite:///{typo}", ok=False)
        assert r.returncode == 2
        assert "no database at" in r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "typo").exists()


def test_a_read_only_database_is_readable_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    seed(f"sqlite:///{path}")
    path.chmod(0o444)
    before = path.read_bytes()
    r = corral("tasks", "list", "--db", f"sqlite:///{path}", "--json")
    assert len(r.stdout.splitlines()) == 4
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"this is not a database, it is a text file" * 100, "file is not a database"),
        (None, "no such table: corral_schema"),  # SQLite, but not Corral's
    ],
)
def test_a_malformed_database_is_a_clean_error(
    tmp_path: Path, content: bytes | None, says: str
) -> None:
    path = tmp_path / "tasks.db"
    if content is None:
        import sqlite3

        sqlite3.connect(path).execute("CREATE TABLE other (a)").connection.close()
    else:
        path.write_bytes(content)
    r = corral("tasks", "list", "--db", f"sqlite:///{path}", ok=False)
    assert r.returncode == 2
    assert says in r.stderr
    assert r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr


def test_an_old_schema_is_read_after_an_upgrade_only(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    old = open_store(f"sqlite:///{path}", migrate=False)
    old.close()
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE corral_schema (version INTEGER NOT NULL)")
    for statement in filter(str.strip, migrations(SQLITE_DIALECT)[0][1].split(";")):
        conn.execute(statement)
    conn.execute("INSERT INTO corral_schema (version) VALUES (1)")
    conn.commit()
    conn.close()
    r = corral("tasks", "list", "--db", f"sqlite:///{path}", ok=False)
    assert r.returncode == 2
    assert "run `corral db upgrade` first" in " ".join(r.stderr.split())
    corral("db", "upgrade", "--db", f"sqlite:///{path}")
    assert corral("tasks", "list", "--db", f"sqlite:///{path}").returncode == 0


def peak_rss_mb(*args: str) -> float:
    """`corral ARGS` in a child process that reports its own peak RSS (Linux: KB)."""
    code = (
        "import resource, sys\n"
        "from corral.cli import main\n"
        f"sys.argv = ['corral', *{list(args)!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stderr.strip().splitlines()[-1]) / 1024


def test_tasks_list_never_reads_payloads_or_results(tmp_path: Path) -> None:
    small, big = f"sqlite:///{tmp_path / 'small.db'}", f"sqlite:///{tmp_path / 'big.db'}"
    for url, size in ((small, 10), (big, 10 * 1048576)):
        store = open_store(url)
        store.enqueue_many([NewTask("k", "m", {"blob": "x" * size}) for _ in range(10)])
        store.close()
    baseline = peak_rss_mb("tasks", "list", "--db", small)
    listed = peak_rss_mb("tasks", "list", "--db", big)
    # before: +250 MB for 100 MB of payloads (each read, parsed and copied)
    assert listed - baseline < 30, (baseline, listed)
    rows = [
        json.loads(x) for x in corral("tasks", "list", "--db", big, "--json").stdout.splitlines()
    ]
    assert len(rows) == 10
    assert "payload" not in rows[0]
    assert "result" not in rows[0]
    shown = corral("tasks", "show", rows[0]["id"], "--db", big).stdout
    assert "xxxxxxxx" in shown  # the table shows the payload's start (rich took 35 s for all)
    assert f"more characters; `corral tasks show {rows[0]['id']} --json` prints it all" in shown
    full = json.loads(corral("tasks", "show", rows[0]["id"], "--db", big, "--json").stdout)
    assert len(full["payload"]["blob"]) == 10 * 1048576  # `show --json` still has it all
