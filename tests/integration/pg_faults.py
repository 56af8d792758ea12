"""Faults to inflict on PostgreSQL, for the resilience tests: a private cluster (so that its
restarts and `pg_terminate_backend` touch no other test) and a TCP proxy that cuts and refuses
connections."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
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


class TcpProxy:
    """<host>:<port> (127.0.0.1 unless said) forwarding to 127.0.0.1:`target_port`. `outage(s)`
    cuts every open connection and refuses new ones (nothing listens) for `s` seconds: a
    dropped network path. `drop_answer_to(marker)`: the next message with `marker` reaches the
    server, which runs it, but its answer is lost and the client's connection cut: an
    ambiguous commit."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target_port = target_port
        self.host = host
        self.port = free_port()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.cuts = 0
        self.drops = 0
        self._marker: bytes | None = None
        self._listen()

    def drop_answer_to(self, marker: bytes) -> None:
        self._marker = marker

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: an outage, or the end
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, upstream}
            dropped = threading.Event()  # this connection's answers are lost from now on
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up, dropped), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, up: bool, dropped: threading.Event
    ) -> None:
        try:
            while data := src.recv(65536):
                if dropped.is_set():
                    continue  # the server's answer, lost on the way
                dst.sendall(data)
                marker = self._marker
                if up and marker is not None and marker in data:
                    self._marker = None
                    self.drops += 1
                    dropped.set()
                    # The client hears nothing more; the server keeps its connection a moment,
                    # so it finishes (and commits) what it was sent.
                    _shut(src)
                    threading.Timer(2.0, _shut, args=(dst,)).start()
                    return
        except OSError:
            pass
        finally:
            for s in (src,) if dropped.is_set() and up else (src, dst):
                _shut(s)
            with self._lock:
                self._socks -= {src, dst}

    def outage(self, seconds: float) -> None:
        assert self._listener is not None
        _shut(self._listener)  # wakes its accept(), which close() alone would not
        self._listener.close()  # new connections: refused
        with self._lock:
            open_now = list(self._socks)
        for s in open_now:  # open ones: cut
            _shut(s)
        self.cuts += len(open_now) // 2
        time.sleep(seconds)
        self._listen()

    def close(self) -> None:
        if self._listener is not None:
            _shut(self._listener)
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()


def _shut(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
