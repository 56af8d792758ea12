"""The scheduler's process keeps its relay processes running (`corral serve --workers N`).

It binds the public socket itself (so a port in use is said once, before anything starts),
starts N relay processes that inherit it, and starts another whenever one exits (its grants
end as lost: `pipeline/grants.py`). Each relay watches for this process to go and then exits
too. Starting and waiting for a process happen in threads: never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral.config import ServerConfig

log = logging.getLogger("corral.gateway")

_QUICK_EXIT_S = 2.0  # a relay that exits sooner than this after its start waits before the next
_MAX_BACKOFF_S = 10.0


# Below this many cores the relays share them with the scheduler, the model servers and often
# the clients, and cost more than they give (docs/benchmarks.md, "Relaying streams").
MIN_CORES = 4
MAX_DEFAULT_RELAYS = 8


def default_relays() -> int:
    """Relay processes when none are asked for: one per core this process may run on, less
    one for the scheduler's own process, up to `MAX_DEFAULT_RELAYS`; none below `MIN_CORES`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 0 if cores < MIN_CORES else min(MAX_DEFAULT_RELAYS, cores - 1)


def bind(listen: str) -> socket.socket:
    """The public listening socket for `host:port`; `OSError` says why it cannot be had."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family, kind, proto, _, address = socket.getaddrinfo(
        host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def private_socket_path() -> Path:
    """A path for the scheduler's local socket, in a folder only this user can enter (and
    short: a Unix socket's path has at most 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="corral-")) / "scheduler.sock"


@dataclass
class Relays:
    """`count` relay processes serving `sock`, passing requests to the local socket `main`."""

    count: int
    sock: socket.socket
    main: Path
    server: ServerConfig
    on_restart: Callable[[], None] | None = None  # counts a restart
    pids: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _stopping: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        """Start every relay and keep each running (on the running loop)."""
        for i in range(self.count):
            self._tasks.append(asyncio.ensure_future(self._keep(f"r{i}")))

    def _command(self, relay_id: str) -> list[str]:
        srv = self.server
        return [
            sys.executable, "-m", "corral.gateway.relays.process",
            "--fd", str(self.sock.fileno()), "--main", str(self.main), "--id", relay_id,
            "--send-timeout-s", str(srv.stream_send_timeout_s),
            "--header-timeout-s", str(srv.header_timeout_s),
            "--keep-alive-s", str(srv.keep_alive_s),
            "--max-connections", str(srv.max_connections),
            "--shutdown-grace-s", str(srv.shutdown_grace_s),
        ]  # fmt: skip

    async def _keep(self, relay_id: str) -> None:
        backoff_s = 0.0
        while not self._stopping:
            started = time.monotonic()
            proc = await asyncio.to_thread(
                subprocess.Popen, self._command(relay_id), pass_fds=(self.sock.fileno(),)
            )
            self._procs[relay_id] = proc
            self.pids[relay_id] = proc.pid
            code = await asyncio.to_thread(proc.wait)
            if self._stopping:
                return
            self.restarts += 1
            if self.on_restart is not None:
                self.on_restart()
            quick = time.monotonic() - started < _QUICK_EXIT_S
            backoff_s = min(_MAX_BACKOFF_S, backoff_s * 2 or 0.5) if quick else 0.0
            log.warning(
                "relay %s (pid %d) exited with %s; starting another%s",
                relay_id, proc.pid, code, f" in {backoff_s:g} s" if backoff_s else "",
            )  # fmt: skip
            if backoff_s:
                await asyncio.sleep(backoff_s)

    def status(self) -> dict[str, object]:
        """For `/api/status`: the relay processes, their pids, and restarts so far."""
        return {"processes": self.count, "pids": dict(self.pids), "restarts": self.restarts}

    def stop(self) -> None:
        """Ask every relay to finish its answers and exit (SIGTERM); starts no more. The local
        socket's path goes now (its connections stay): uvicorn ends the process with the
        signal that stopped it, after its shutdown, before any later cleanup runs."""
        self._stopping = True
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        self.main.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.main.parent.rmdir()

    def wait(self, timeout_s: float = 30.0) -> None:
        """Wait for every relay to exit, killing those still running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sock.close()
