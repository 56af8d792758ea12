"""A throwaway PostgreSQL cluster for the tests that need one of their own."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (initdb in a temporary folder; as the
    `postgres` user when run as root, since the server refuses to run as root)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="corral-pg-"))
        self.port = free_port()
        self.data = self.root / "data"
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync")  # fmt: skip
        self.start()

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self._as, *cmd], check=True, capture_output=True, timeout=60)

    def _ctl(self, *args: str) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                  str(self.root / "log"), "-w", *args)  # fmt: skip

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")

    def url(self, db: str = "postgres", port: int | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{db}"

    def new_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return name

    def terminate_all(self, db: str) -> int:
        """`pg_terminate_backend` every other connection to `db`; returns how many."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (db,),
            ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
