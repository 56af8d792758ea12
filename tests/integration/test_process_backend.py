"""The process backend against real subprocesses: start, health, stop, crashes, bad commands."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from corral.backends.logs import LogLimits
from corral.backends.process import (
    BackendError,
    ProcessBackend,
    ProcessSpec,
    cpu_flags,
    exit_reason,
    sigill_hint,
    substitute,
)
from corral.modelfiles.engine_memory import READY_LINE
from tests.helpers import alive

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
PY = shlex.quote(sys.executable)


def sim_cmd(load_s: float = 0.3, port: str = "${PORT}") -> str:
    return f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port {port} --load-s {load_s}"


def script(tmp_path: Path, name: str, body: str) -> str:
    """A Python server script; it serves /health on argv[1] and then does what `body` says."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        textwrap.dedent(
            """
            import http.server, os, signal, sys, threading, time
            port = int(sys.argv[1])
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
                def log_message(self, *a): pass
            def serve():
                http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
            """
        )
        + textwrap.dedent(body)
    )
    return f"{PY} {path} ${{PORT}}"


def test_start_is_ready_soon_after_the_server_and_stop_ends_it(tmp_path: Path) -> None:
    async def main() -> None:
        b = ProcessBackend(ProcessSpec("sim-a", sim_cmd(load_s=0.5)), tmp_path)
        load_s = await b.start()
        # The sim counts its 0.5 s from its process's start time in /proc (10 ms ticks), which
        # can read a tick earlier than the backend's own clock at spawn.
        assert 0.48 <= load_s < 10
        r = httpx.get(f"{b.proxy_url}/v1/models")
        assert r.json()["data"][0]["id"] == "sim-a"  # ${MODEL_ID} was substituted
        pid = b.pid
        assert pid is not None
        assert await b.stop() < 5
        assert not b.running
        assert not alive(pid)
        assert "corral: starting" in b.log_tail()

    asyncio.run(main())


def test_health_timeout_kills_the_server_and_says_so(tmp_path: Path) -> None:
    async def main() -> None:
        spec = ProcessSpec("slow", sim_cmd(load_s=60), health_timeout_s=1.0)
        b = ProcessBackend(spec, tmp_path)
        began = time.monotonic()
        with pytest.raises(BackendError, match=r"model slow: not healthy at .* within 1 s"):
            await b.start()
        assert time.monotonic() - began < 5
        assert not b.running

    asyncio.run(main())


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    cmd = script(
        tmp_path,
        "stubborn",
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve()
        """,
    )

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("stubborn", cmd, stop_grace_s=0.5), tmp_path)
        await b.start()
        pid = b.pid
        assert pid is not None
        took = await b.stop()
        assert 0.5 <= took < 5
        assert not alive(pid)
        assert "SIGKILL" in b.log_tail()

    asyncio.run(main())


def test_a_crash_while_loading_is_an_error_with_the_servers_last_words(tmp_path: Path) -> None:
    cmd = script(
        tmp_path,
        "oom",
        """
        time.sleep(0.3)
        print("fatal: cannot allocate 40 GiB for the weights", file=sys.stderr, flush=True)
        sys.exit(3)
        """,
    )

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("oom", cmd), tmp_path)
        with pytest.raises(BackendError, match="model oom: the server exited with code 3") as err:
            await b.start()
        assert "cannot allocate 40 GiB" in err.value.log_tail
        assert "cannot allocate" not in str(err.value)  # the client's message stays short

    asyncio.run(main())


def test_a_server_killed_by_a_signal_while_loading_is_named_with_a_hint(tmp_path: Path) -> None:
    # What a llama-server built with -march=native does on a CPU without those instructions.
    cmd = script(tmp_path, "sigill", "os.kill(os.getpid(), signal.SIGILL)\n")

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("native", cmd), tmp_path)
        with pytest.raises(BackendError, match=r"was killed by SIGILL \(an instruction this CPU"):
            await b.start()

    asyncio.run(main())


def test_the_sigill_hint_names_amx_and_its_fixes_where_the_cpu_has_it() -> None:
    # A llama.cpp server built -march=native on a CPU with AMX traps at its first AMX tile
    # (release 11434): the hint says so there, and names both ways out.
    amx = sigill_hint(frozenset({"avx512f", "amx_tile", "amx_int8"}))
    assert "This CPU has AMX" in amx
    assert "--no-repack" in amx
    assert "-mno-amx-tile" in amx
    assert "another machine" in sigill_hint(frozenset({"avx2", "fma"}))
    assert "another machine" in sigill_hint(frozenset())  # no /proc/cpuinfo (macOS)
    # exit_reason reads this machine's own flags
    said = exit_reason(-signal.SIGILL)
    assert said.startswith("was killed by SIGILL (an instruction this CPU cannot run")
    assert ("--no-repack" in said) == ("amx_tile" in cpu_flags())


def test_a_crash_of_a_loaded_server_is_reported(tmp_path: Path) -> None:
    cmd = script(
        tmp_path,
        "flaky",
        """
        threading.Thread(target=serve, daemon=True).start()
        time.sleep(0.5)
        os._exit(7)
        """,
    )

    async def main() -> None:
        exits: list[int] = []
        b = ProcessBackend(ProcessSpec("flaky", cmd), tmp_path, on_exit=exits.append)
        await b.start()
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.05)
        assert exits == [7]
        assert not b.running
        await b.start()  # it starts again on the next request
        assert b.running
        await b.stop()
        assert exits == [7]  # a requested stop is not a crash

    asyncio.run(main())


def test_exited_reports_a_crash_before_it_returns(tmp_path: Path) -> None:
    async def main() -> None:
        exits: list[int] = []
        b = ProcessBackend(ProcessSpec("sim-a", sim_cmd(load_s=0)), tmp_path, on_exit=exits.append)
        await b.start()
        assert not await b.exited(timeout_s=0.05)  # alive: a failed request is only that
        assert b.pid is not None
        os.kill(b.pid, signal.SIGKILL)
        assert await b.exited(timeout_s=5)
        assert exits == [-signal.SIGKILL]  # the crash was handled before `exited` returned

    asyncio.run(main())


def test_a_taken_port_and_a_missing_command_are_clear_errors(tmp_path: Path) -> None:
    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            spec = ProcessSpec("clash", sim_cmd(port=str(port)), health_timeout_s=20)
            b = ProcessBackend(spec, tmp_path, port=port)
            with pytest.raises(BackendError, match="model clash: the server exited") as err:
                await b.start()
            assert "address already in use" in err.value.log_tail.lower()
        missing = ProcessBackend(ProcessSpec("ghost", "no-such-server --port ${PORT}"), tmp_path)
        with pytest.raises(BackendError, match="model ghost: command not found: 'no-such-server'"):
            await missing.start()

    asyncio.run(main())


def test_stop_reaches_the_servers_children(tmp_path: Path) -> None:
    """A wrapper shell that starts the real server: stopping kills the whole process group."""
    child_file = tmp_path / "child"
    inner = f"{sim_cmd(load_s=0.1)} & echo $! > {child_file}; wait"
    cmd = f"sh -c {shlex.quote(inner)}"

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("wrapped", cmd), tmp_path)
        await b.start()
        child = int(child_file.read_text())
        assert child != b.pid
        assert alive(child)
        await b.stop()
        for _ in range(100):
            if not alive(child):
                break
            await asyncio.sleep(0.05)
        assert not alive(child)

    asyncio.run(main())


def test_unknown_macros_and_missing_env_vars_are_named() -> None:
    assert substitute("--port ${PORT}", {"PORT": "9"}, "cmd") == "--port 9"
    with pytest.raises(BackendError, match=r"cmd: unknown macro \$\{PROT\}; known: \$\{PORT\}"):
        substitute("--port ${PROT}", {"PORT": "9"}, "cmd")
    with pytest.raises(BackendError, match="environment variable CORRAL_NO_SUCH_VAR is not set"):
        substitute("${env.CORRAL_NO_SUCH_VAR}", {}, "cmd")


def test_what_a_server_wrote_before_its_ready_line_is_logged_however_late_it_is_read(
    tmp_path: Path,
) -> None:
    """`ready_line`: its output is read behind it (on a busy machine by seconds, so a health
    check can pass before Corral has read the load's lines): the lines before its ready line
    are logged whole and readable once it is started, the quiet ones after it left out. Here the
    load's lines come after the health check on purpose. A server that never prints the line
    is ready all the same."""
    cmd = script(
        tmp_path,
        "late",
        """
        asked = threading.Event()
        H.do_GET, answer = lambda self: (answer(self), asked.set()), H.do_GET
        threading.Thread(target=serve, daemon=True).start()
        asked.wait()
        print("T load_tensors: CPU model buffer size = 12.00 MiB", flush=True)
        print("I srv  llama_server: model loaded", flush=True)
        print("T slot update 1", flush=True)
        print("I request 1", flush=True)
        time.sleep(60)
        """,
    )

    async def main() -> None:
        spec = ProcessSpec("late", cmd, quiet_after_ready=r"T ", ready_line=READY_LINE)
        b = ProcessBackend(spec, tmp_path)
        await b.start()
        assert "T load_tensors: CPU model buffer size = 12.00 MiB" in b.output_since_start()
        for _ in range(1000):
            if "I request 1" in b.output_since_start():
                break
            await asyncio.sleep(0.01)
        assert "I request 1" in b.output_since_start()
        assert "T slot update" not in b.log_path.read_text()
        await b.stop()
        never = ProcessBackend(dataclasses.replace(spec, ready_line="never said"), tmp_path)
        await never.start()
        assert never.running
        await never.stop()

    asyncio.run(main())


def test_a_piped_output_keeps_the_load_and_leaves_out_the_quiet_lines_once_ready(
    tmp_path: Path,
) -> None:
    """`quiet_after_ready`: what a verbose server says while it loads (its buffer sizes) is in
    its log and in `output_since_start`; the same kind of line said once it is ready is not;
    every other line is; a crash's last words still reach the log."""
    cmd = script(
        tmp_path,
        "verbose",
        """
        print("T load_tensors: CPU model buffer size = 12.00 MiB", flush=True)
        print("I loading", flush=True)
        asked = threading.Event()
        H.do_GET, answer = lambda self: (answer(self), asked.set()), H.do_GET
        threading.Thread(target=serve, daemon=True).start()
        asked.wait()
        time.sleep(0.5)  # well after its health was answered: it is ready
        for i in range(400):
            time.sleep(0.01)
            print(f"T slot update {i}", flush=True)
            print(f"I request {i}", flush=True)
        print("E dying", file=sys.stderr, flush=True)
        os._exit(5)
        """,
    )

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("verbose", cmd, quiet_after_ready=r"T "), tmp_path)
        codes: list[int] = []
        b.on_exit = codes.append
        await b.start()
        assert "T load_tensors: CPU model buffer size = 12.00 MiB" in b.output_since_start()
        assert await b.exited(30)
        assert codes == [5]
        log = b.log_path.read_text()
        assert "I request 399" in log
        assert "E dying" in log
        assert "T slot update" not in log
        await b.start()  # a second start: its own output, the first one's left behind
        assert b.output_since_start().count("T load_tensors") == 1
        await b.stop()

    asyncio.run(main())


def test_a_servers_log_is_rotated_by_size_and_read_across_the_rotation(tmp_path: Path) -> None:
    """A server that writes far more than its log's limit leaves at most `files` files of about
    `max_bytes` each; its last lines, its first start's load output and a crash's last words are
    still read back (`log_tail` across the rotation)."""
    cmd = script(
        tmp_path,
        "chatty",
        """
        print("I loading", flush=True)
        threading.Thread(target=serve, daemon=True).start()
        time.sleep(0.3)
        for i in range(20000):
            print(f"I request {i:06d} " + "x" * 80, flush=True)
        print("E dying", flush=True)
        os._exit(3)
        """,
    )
    limits = LogLimits(max_bytes=64 * 1024, files=3)

    async def main() -> None:
        b = ProcessBackend(ProcessSpec("chatty", cmd), tmp_path / "logs", log_limits=limits)
        codes: list[int] = []
        b.on_exit = codes.append
        await b.start()
        assert await b.exited(60)
        assert codes == [3]
        files = sorted((tmp_path / "logs").glob("chatty.log*"))
        assert [f.name for f in files] == ["chatty.log", "chatty.log.1", "chatty.log.2"]
        # ~1.9 MB written; what is kept is bounded by the limits (a write may overrun by a read).
        assert sum(f.stat().st_size for f in files) <= 3 * (64 * 1024 + (1 << 16))
        tail = b.log_tail(500).splitlines()
        assert tail[-1] == "E dying"
        assert len(tail) == 500  # more than the current file holds: read across the rotation
        numbers = [int(x.split()[2]) for x in tail[:-1]]
        assert numbers == list(range(numbers[0], 20000))  # in order, none lost at the cuts
        assert b.log.rotations >= 10
        await b.stop()

    asyncio.run(main())
