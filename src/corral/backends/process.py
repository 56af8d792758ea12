"""A model server we run ourselves: start its command, wait until healthy, stop its whole process
group, keep its output in a log file, and notice when it dies.

`${PORT}`, `${MODEL_ID}` and `${PID}` (in `cmd_stop`) are substituted. Readiness is polled every
`poll_s` (10 ms by default; llama-swap waits 250 ms and then polls every second), so a ready
server is used within a few milliseconds of its being ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shlex
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import psutil

from corral.backends.logs import LogLimits, Pump, RotatingLog, rotated, tail
from corral.backends.orphans import ServerRecord
from corral.errors import CorralError
from corral.secrets import Redactor, flag_values

logger = logging.getLogger("corral.backends")

# `$${` is a literal `${`: how data (a file's name or path) is written into a command without
# being read as a macro (`escape_macros`).
_MACRO = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


class BackendError(CorralError):
    """A backend failed to start, stop or stay up. The message says which model and why and is
    fit for a client; `log_tail` holds the server's last output, for the operator's log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass(frozen=True)
class ProcessSpec:
    model: str
    cmd: str  # a shell-like command line; ${PORT} and ${MODEL_ID} are substituted
    proxy: str = "http://127.0.0.1:${PORT}"
    env: Mapping[str, str] = field(default_factory=dict)
    check_endpoint: str | None = "/health"  # None: ready as soon as started
    health_timeout_s: float = 120.0
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    cmd_stop: str | None = None  # run instead of SIGTERM; ${PID} is the server's pid
    poll_s: float = 0.01
    served_name: str | None = None  # the model's name in requests to it (default: `model`)
    # Lines of its output left out of its log once it is ready (a pattern, matched at a line's
    # start): what a server says only at a verbosity Corral asked for to read its load.
    quiet_after_ready: str | None = None
    # The line it prints once it serves (a pattern searched in each line): its quiet lines are
    # left out from the next one on, in the order it wrote them, and it is not ready until its
    # log holds it (so its load's lines are there to read). Without it, or when it does not come
    # within a second of the health check, from when the health check passed.
    ready_line: str | None = None


class Hooks(Protocol):
    """What runs beside a server's life (its prompt caches: prompt_cache/server.py)."""

    async def started(self, base_url: str, argv: Sequence[str]) -> None:
        """It is healthy at `base_url`, started as `argv`."""

    async def stopping(self) -> None:
        """It is about to be stopped, still running (must not raise)."""

    def crashed(self) -> None:
        """It died without being asked to."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def exit_reason(code: int) -> str:
    """How a server ended, in words: a negative `returncode` is the signal that killed it."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    hint = sigill_hint(cpu_flags()) if name == "SIGILL" else _SIGNAL_HINTS.get(name, "")
    return f"was killed by {name}{hint}"


_SIGNAL_HINTS = {
    "SIGKILL": " (out of memory, or killed by someone)",
    "SIGSEGV": " (it crashed)",
}


def sigill_hint(flags: frozenset[str]) -> str:
    """Why a server died of SIGILL, given the CPU's flags. On a CPU with AMX the likely cause is
    llama.cpp built with -march=native: it runs AMX tiles without asking Linux for them
    (arch_prctl ARCH_REQ_XCOMP_PERM), and the first one traps (release 11434, 2026-11-26)."""
    if "amx_tile" in flags:
        return (
            " (an instruction this CPU cannot run. This CPU has AMX: a llama.cpp server built "
            "for it runs AMX tiles that Linux has not been asked for. Pass --no-repack to "
            "llama-server, or build it with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)"
        )
    return " (an instruction this CPU cannot run: a binary built for another machine?)"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them; empty where /proc/cpuinfo has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def substitute(text: str, values: Mapping[str, str], what: str) -> str:
    """Replace ${NAME} macros; an unknown one is an error naming it and `what` it was in.
    `$${` stands for a literal `${` (`escape_macros`)."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name is None:
            return "${"
        if name.startswith("env."):
            value = os.environ.get(name[4:])
            if value is None:
                raise BackendError(f"{what}: environment variable {name[4:]} is not set")
            return value
        if name not in values:
            known = ", ".join(f"${{{k}}}" for k in sorted(values))
            raise BackendError(f"{what}: unknown macro ${{{name}}}; known: {known}")
        return values[name]

    return _MACRO.sub(one, text)


def escape_macros(text: str) -> str:
    """`text` as data in a command `substitute` reads: no macro in it is expanded."""
    return text.replace("${", "$${")


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class ProcessBackend:
    """One model server process. Not thread-safe: use it from one event loop.

    `on_exit(code)` is called when the process dies without being asked to (a crash of a loaded
    server); a crash while loading is raised from `start()` instead.
    """

    def __init__(
        self,
        spec: ProcessSpec,
        log_dir: Path,
        on_exit: Callable[[int], None] | None = None,
        port: int | None = None,
        record: ServerRecord | None = None,
        label: str | None = None,
        log_limits: LogLimits = LogLimits(),
    ) -> None:
        """`record`: where the running server's pid is kept, so the next gateway stops it if
        this one is killed before it could. `label`: tells this server's log from the model's
        other copies' (`<model>@<label>.log`)."""
        self.spec = spec
        self._record = record
        name = spec.model if label is None else f"{spec.model}@{label}"
        self.log_path = log_dir / f"{re.sub(r'[^A-Za-z0-9_.@-]', '_', name)}.log"
        self.log = RotatingLog(self.log_path, log_limits)
        # The environment of the device it starts on (set before each start); the model's own
        # `env` wins over it.
        self.device_env: Mapping[str, str] = {}
        self.on_exit = on_exit
        self._fixed_port = port
        self.port: int | None = None
        self.proxy_url = ""
        self.exposed: str | None = None  # a non-loopback address its server answered on
        self.served_name = spec.served_name or spec.model
        self.headers: dict[str, str] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self._heard_ready = asyncio.Event()  # its log holds its `ready_line`
        self._pump: Pump | None = None  # copies its output to its log
        self._pumped: asyncio.Future[None] | None = None  # its output ended
        self.hooks: Hooks | None = None
        # Where its last start's output begins in its log: (the log's rotations then, bytes).
        self._log_from = (0, 0)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> float:
        """Start the server and wait until it is healthy; returns the seconds it took. Raises
        `BackendError` (with the tail of its log) if it cannot start, exits, or stays unhealthy
        past `health_timeout_s`; nothing is left running then."""
        if self.running:
            raise BackendError(f"model {self.spec.model}: already running (pid {self.pid})")
        started = time.monotonic()
        self.port = self._fixed_port or free_port()
        values = {"PORT": str(self.port), "MODEL_ID": self.spec.model}
        what = f"model {self.spec.model}"
        argv = shlex.split(substitute(self.spec.cmd, values, f"{what} cmd"))
        if not argv:
            raise BackendError(f"{what}: cmd is empty")
        self.proxy_url = substitute(self.spec.proxy, values, f"{what} proxy").rstrip("/")
        env = {
            **os.environ,
            **self.device_env,
            **{k: substitute(v, values, f"{what} env {k}") for k, v in self.spec.env.items()},
        }
        proc = await self._spawn(argv, env)
        if self._record is not None:
            self._record.add(proc.pid)
        self._stopping = False
        try:
            await self._wait_healthy(started)
        except BaseException:
            await self._kill()
            raise
        if self.spec.ready_line is not None:
            # Its output is read behind it (on a busy machine by seconds): what it wrote before
            # it answered healthy is logged whole, then it is ready.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard_ready.wait(), timeout=1.0)
        if self._pump is not None:
            # What it wrote while it loaded is in its log (`output_since_start`) and kept whole
            # (its load lines may match `quiet_after_ready`) before its quiet lines go.
            await _caught_up(self._pump)
            self._pump.ready()
        self._watch = asyncio.ensure_future(self._watch_exit())
        if self.hooks is not None:
            await self.hooks.started(self.proxy_url, argv)
        if self.exposed is None:  # once per model: the same command binds the same way
            assert self.port is not None
            self.exposed = await exposed_on(self.port)
            if self.exposed:
                logger.warning(
                    "%s: its server answers on %s:%d too, not only on loopback: anyone who "
                    "can reach this machine can use it there without Corral's keys or "
                    "scheduling. Bind it to loopback (llama-server: --host 127.0.0.1, the "
                    "default; vLLM: --host 127.0.0.1) or firewall the port (docs/security.md)",
                    what,
                    self.exposed,
                    self.port,
                )
        return time.monotonic() - started

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
        """Run `argv` in its own process group, its output piped to its log."""
        what = f"model {self.spec.model}"
        shown = Redactor(flag_values(self.spec.cmd))(shlex.join(argv))
        # A path that is not UTF-8 is written as its own bytes.
        self.log.write(f"--- corral: starting {shown}\n".encode(errors="surrogateescape"))
        self._log_from = (self.log.rotations, self.log.size)
        self._heard_ready.clear()
        loop = asyncio.get_running_loop()
        pumped: asyncio.Future[None] = loop.create_future()
        read_end, write_end = os.pipe()
        try:
            self._proc = proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_end,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop reaches its children
            )
        except FileNotFoundError:
            os.close(read_end)
            raise BackendError(
                f"{what}: command not found: {argv[0]!r} (check `cmd` and PATH)"
            ) from None
        except PermissionError:
            os.close(read_end)
            raise BackendError(f"{what}: {argv[0]!r} is not executable") from None
        finally:
            os.close(write_end)
        # Its output reaches its log through a thread: the serving loop never writes a log.
        self._pump = Pump(
            read_end,
            self.log,
            self.spec.quiet_after_ready,
            self.spec.ready_line,
            lambda: loop.call_soon_threadsafe(self._heard_ready.set),
            lambda: loop.call_soon_threadsafe(_settle, pumped),
        )
        self._pumped = pumped
        return proc

    async def _wait_healthy(self, started: float) -> None:
        proc = self._proc
        assert proc is not None
        what = f"model {self.spec.model}"
        if self.spec.check_endpoint is None:
            return
        url = self.proxy_url + self.spec.check_endpoint
        deadline = started + self.spec.health_timeout_s
        # A plain-HTTP check needs no CA bundle: loading one costs ~25 ms a start here.
        plain = url.startswith("http://")
        async with httpx.AsyncClient(timeout=httpx.Timeout(1.0), verify=not plain) as client:
            while True:
                if proc.returncode is not None:
                    await self._drained()
                    raise BackendError(
                        f"{what}: the server {exit_reason(proc.returncode)} while loading "
                        f"(its log: {self.log_path})",
                        self.log_tail(),
                    )
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() >= deadline:
                    raise BackendError(
                        f"{what}: not healthy at {url} within {self.spec.health_timeout_s:g} s "
                        f"(health_timeout_s; its log: {self.log_path})",
                        self.log_tail(),
                    )
                await asyncio.sleep(self.spec.poll_s)

    async def _drained(self) -> None:
        """A piped output is in its log (its end waited for a second at most: a child of the
        server may hold the pipe open)."""
        if self._pumped is not None:
            await asyncio.wait({self._pumped}, timeout=1.0)

    async def _watch_exit(self) -> None:
        proc = self._proc
        assert proc is not None
        code = await proc.wait()
        await self._drained()
        self.log.close()  # reopened by the next write: a server replaced leaves no file open
        self._forget(proc)
        if not self._stopping and self.hooks is not None:
            self.hooks.crashed()
        if not self._stopping and self.on_exit is not None:
            self.on_exit(code)

    async def exited(self, timeout_s: float) -> bool:
        # The kernel closes a dead server's sockets before asyncio reaps it, so a request can
        # fail before `on_exit` runs; waiting for the watcher keeps the next request off it.
        watch = self._watch
        if watch is None:
            return not self.running
        await asyncio.wait({watch}, timeout=timeout_s)
        return watch.done()

    async def stop(self) -> float:
        """Stop the server and everything it started; returns the seconds it took."""
        started = time.monotonic()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            self._stopping = True
            return 0.0
        if self.hooks is not None:  # while it still runs: what it holds is saved first
            await self.hooks.stopping()
        self._stopping = True
        if self.spec.cmd_stop is not None:
            values = {"PORT": str(self.port), "MODEL_ID": self.spec.model, "PID": str(proc.pid)}
            argv = shlex.split(substitute(self.spec.cmd_stop, values, "cmd_stop"))
            stopper = await asyncio.create_subprocess_exec(*argv)
            await stopper.wait()
        else:
            self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.spec.stop_grace_s)
        except TimeoutError:
            self.log.write(
                f"--- corral: still running {self.spec.stop_grace_s:g} s after the stop "
                "request; SIGKILL\n".encode()
            )
            await self._kill()
        self._signal(signal.SIGKILL)  # whatever of its group is left
        if self._watch is not None:
            await self._watch
        self._forget(proc)
        return time.monotonic() - started

    def _forget(self, proc: asyncio.subprocess.Process) -> None:
        if self._record is not None:
            self._record.remove(proc.pid)

    async def _kill(self) -> None:
        self._stopping = True
        self._signal(signal.SIGKILL)
        if self._proc is not None:
            await self._proc.wait()
            self._forget(self._proc)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def output_since_start(self, limit_bytes: int = 4 << 20) -> str:
        """What the server wrote since its last start began, at most its first `limit_bytes`
        (what it says while it loads: a llama-server's buffer sizes)."""
        rotations, offset = self._log_from
        since = self.log.rotations - rotations
        files = rotated(self.log_path, self.log.limits.files)
        if since >= len(files):
            offset, since = 0, len(files) - 1  # its start was rotated away: what is left
        data = b""
        for p in files[len(files) - 1 - since :]:
            try:
                with p.open("rb") as f:
                    f.seek(offset)
                    data += f.read(limit_bytes - len(data))
            except OSError:
                pass
            offset = 0
        return data.decode(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log (across its rotation)."""
        limit_bytes = min(4 << 20, max(64 << 10, lines * 256))
        text = tail(self.log_path, self.log.limits.files, limit_bytes).decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


async def exposed_on(port: int, timeout_s: float = 0.3) -> str:
    """A non-loopback address of this machine where something accepts connections on `port`
    ("" if none): a server Corral started for loopback that listens on every address."""
    addresses = [
        a.address
        for nic in psutil.net_if_addrs().values()
        for a in nic
        if a.family in (socket.AF_INET, socket.AF_INET6)
        and not a.address.startswith(("127.", "::1", "fe80"))
    ]
    for address in addresses:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(address.split("%")[0], port), timeout_s
            )
        except (OSError, TimeoutError):
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return address
    return ""


async def _caught_up(pump: Pump, limit_s: float = 2.0, every_s: float = 0.02) -> None:
    """Wait (at most `limit_s`) until `pump` has copied what its server wrote so far."""
    deadline = time.monotonic() + limit_s
    before = pump.idle()
    while time.monotonic() < deadline:
        await asyncio.sleep(every_s)
        now = pump.idle()
        if before[0] and now == before:
            return
        before = now
