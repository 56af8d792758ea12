"""What llama.cpp itself says a model takes, read from its own tables instead of
estimated from the file.

llama-server, at verbosity 4, prints a memory breakdown per device twice: the projection it
makes with its own flags before it reads any weight (`common_fit_params`, the figure its `--fit`
acts on), and what it held, when it stops. `llama-fit-params --fit-print on` prints a projection
too, but configures the context as a batch tool does, not as the server: it reserves logits for
every token of a micro-batch (`n_outputs`), which the server never does, so its compute figure is
the vocabulary times 512 tokens larger (527 MiB against the server's 28 for gemma-3-270m: see
docs/benchmarks.md, "Memory against the engine's own figures"). Corral reads the server's."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from corral.cmdline import model_file
from corral.config import Config, data_dir
from corral.modelfiles.gguf import MIB, RUNTIME_BYTES

# `self = model + context + compute`, in MiB, as common_memory_breakdown_print writes a row (a
# GPU's row wraps it: `total = free + (self = model + context + compute) + unaccounted`).
_ROW = re.compile(r"common_memory_breakdown_print: \|\s+- (?P<device>.+?)\s+\|(?P<figures>.*)\|")
_SUM = re.compile(r"(\d+)\s*=\s*(\d+)\s*\+\s*(\d+)\s*\+\s*(\d+)")
VERBOSE = ("-lv", "4")
_PAST_THE_FIT = (
    "common_params_fit_impl: projected",
    "common_fit_params:",
    "load_tensors:",
)  # the verbosity at which llama-server prints its tables


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's row as llama.cpp prints it, in its unit (MiB); `device_bytes` gives the
    figure Corral keeps."""

    model_mib: int
    context_mib: int
    compute_mib: int

    @property
    def total_mib(self) -> int:
        return self.model_mib + self.context_mib + self.compute_mib


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """One breakdown: each device's model, context and compute memory, in MiB."""

    devices: dict[str, DeviceMemory] = field(default_factory=dict)

    @property
    def total_mib(self) -> int:
        return sum(d.total_mib for d in self.devices.values())


def breakdowns(lines: Iterable[str]) -> list[EngineMemory]:
    """Every memory breakdown in a llama-server log, in order: the first is its projection, a
    later one (at exit) what it held. Rows that do not parse are passed over."""
    out: list[EngineMemory] = []
    current: dict[str, DeviceMemory] | None = None
    for line in lines:
        if "common_memory_breakdown_print: | memory breakdown" in line:
            current = {}
            out.append(EngineMemory(current))
            continue
        row = _ROW.search(line)
        if row is None or current is None:
            continue
        figures = _SUM.search(row["figures"])
        if figures is not None:
            _, model, context, compute = (int(x) for x in figures.groups())
            current[row["device"].strip()] = DeviceMemory(model, context, compute)
    return [b for b in out if b.devices]


# What llama-server says as it allocates, at verbosity 4 (`-lv 4`): one line per buffer, e.g.
# `load_tensors:   CPU_Mapped model buffer size =   241.41 MiB`, `llama_kv_cache:  CUDA0 KV
# buffer size = 72.00 MiB`, `llama_memory_recurrent: CPU RS buffer size`, `... compute buffer`.
_BUFFER = re.compile(
    r"\b\w+:\s+(?P<device>\S+)\s+(?P<kind>model|KV|RS|output|compute)\s+buffer size\s*=\s*"
    r"(?P<mib>\d+(?:\.\d+)?) MiB"
)
_KINDS = {"model": 0, "KV": 1, "RS": 1, "output": 2, "compute": 2}


def allocated(lines: Iterable[str]) -> EngineMemory | None:
    """What a llama-server's load allocated, from its buffer lines (one start's output, at
    verbosity 4): per device, its model (weights), context (KV and recurrent state) and
    compute (compute and output buffers), in MiB rounded to the nearest; None when it printed
    none. On a CPU, weights llama.cpp repacks (`CPU_REPACK`) are also in the mapped file
    (`CPU_Mapped` spans all of its tensors), where their pages are clean page cache the kernel
    takes back: the mapping counts as the weights left in it, the host row of the projection
    the same start printed before its load (`breakdowns`); without one, as the whole mapping
    (the server's own figure at exit)."""
    lines = list(lines)
    sums: dict[str, list[float]] = {}
    for line in lines:
        found = _BUFFER.search(line)
        if found is not None:
            row = sums.setdefault(found["device"], [0.0, 0.0, 0.0])
            row[_KINDS[found["kind"]]] += float(found["mib"])
    if not sums:
        return None
    if "CPU_Mapped" in sums and "CPU_REPACK" in sums:
        projected = breakdowns(lines)
        host = projected[0].devices.get("Host") if projected else None
        if host is not None:
            sums["CPU_Mapped"][0] = min(sums["CPU_Mapped"][0], host.model_mib)
    return EngineMemory({d: DeviceMemory(*(round(x) for x in v)) for d, v in sums.items()})


def fit_params(binary: Path, flags: list[str], timeout_s: float = 120) -> EngineMemory | None:
    """`llama-fit-params --fit-print on` with `flags` (the model's and the context's): its rows
    of `device model context compute` (MiB); None when it fails."""
    try:
        done = subprocess.run(
            [str(binary), *flags, "--fit-print", "on"],
            capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    devices: dict[str, DeviceMemory] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            devices[parts[0]] = DeviceMemory(*(int(p) for p in parts[1:]))
    return EngineMemory(devices) if done.returncode == 0 and devices else None


def server_projection(argv: list[str], timeout_s: float = 120) -> EngineMemory | None:
    """The projection llama-server makes for `argv` (its whole command, port included) before
    it reads a weight: the server is started at verbosity 4 and stopped once its first table is
    printed, so nothing is loaded. None when it prints none (a build without `--fit`, a model it
    refuses, a timeout)."""
    try:
        proc = subprocess.Popen(
            [*argv, *VERBOSE],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            errors="replace",  # token texts it logs need not be UTF-8
            start_new_session=True,
        )
    except OSError:
        return None
    lines: list[str] = []
    # A server that hangs without a word is stopped all the same (the read below then ends).
    watchdog = threading.Timer(timeout_s, _kill_group, (proc,))
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if any(mark in line for mark in _PAST_THE_FIT):  # projected, or no projection
                break
    finally:
        watchdog.cancel()
        _kill_group(proc)
        proc.wait()
    found = breakdowns(lines)
    return found[0] if found else None


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop the server and whatever it started (a wrapper's child): its own process group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def split_command(cmd: str, port: int) -> list[str]:
    """A model's command as argv, `${PORT}` given."""
    return [a.replace("${PORT}", str(port)) for a in shlex.split(cmd)]


# Flags whose values change nothing the server allocates (a port, a name, where states are
# saved, how much it logs): left out of a model's fingerprint, and `--slot-save-path` out of a
# projection run (a folder that does not exist yet would stop the server before it projects).
_NOT_MEMORY = frozenset(
    ["--port", "--alias", "-a", "--slot-save-path", "--host", "--api-key", "-lv", "--verbosity"]
)
_VERBOSITY = ("-lv", "--verbosity", "--log-verbosity", "-v", "--verbose")
# What llama-server says at verbosity 4 and not at its default 3 once it serves: about 45 lines
# a request (its slots' every step) against 6. Corral asks for verbosity 4 to read the buffer
# lines of a load, and leaves these out of the server's log once it is ready (`ProcessSpec.
# quiet_after_ready`); a warning or an error (`W`, `E`) always stays.
QUIET = (
    r"\d+\.\d+\.\d+\.\d+ I (?!.*(?:selected slot|processing task|print_timing|"
    r"stop processing|cleaning up|listening on|all slots are idle))"
)
# What llama-server says once it serves (`srv  llama_server: model loaded`; `main: model
# loaded` in older builds): its quiet lines are left out from the next line on, and its load's
# buffer lines are in its log before Corral reads them (`ProcessSpec.ready_line`).
READY_LINE = r"\bmodel loaded\s*$"


def reporting(cmd: str) -> str | None:
    """`cmd` at the verbosity where llama-server prints the buffers a load allocates (`-lv
    4`, `allocated`); None when it names no model file (not a llama-server) or sets its own
    verbosity (its log is then the operator's choice, and read all the same)."""
    argv = shlex.split(cmd)
    if model_file(argv) is None or any(a.split("=", 1)[0] in _VERBOSITY for a in argv):
        return None
    return f"{cmd} {shlex.join(VERBOSE)}"


def without(argv: list[str], flags: frozenset[str]) -> list[str]:
    """`argv` less each of `flags` and its value (`--flag value` or `--flag=value`)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


def fingerprint(argv: list[str]) -> str | None:
    """What a model's memory depends on: its file (path, size, modified time), the server and
    the flags it runs with (less `_NOT_MEMORY`'s), as the prompt caches fingerprint what made
    a saved state; None when no file is named (`-m`) or it is not there."""
    from corral.prompt_cache.states import fingerprint as made_by

    path = model_file(argv)
    if path is None or not path.is_file():
        return None
    return made_by(path, without(argv, _NOT_MEMORY))


def on_host(device: str) -> bool:
    """A device name of llama.cpp's that is the host's memory: its table's `Host` and `CPU`
    rows, a buffer's `CPU_Mapped` or `CPU_REPACK`, a GPU's pinned `CUDA_Host`."""
    return device.startswith(("Host", "CPU")) or device.endswith("_Host")


def device_bytes(e: EngineMemory) -> int:
    """What a breakdown puts on the device a model is placed on, in bytes: its GPUs' rows where
    it has any (the host's rows hold what stays in RAM: the embeddings), else every row (a CPU)
    and the process itself (`RUNTIME_BYTES`: no table counts it). (A GPU's own CUDA context is
    not in its rows either.)"""
    gpus = [d for name, d in e.devices.items() if not on_host(name)]
    if gpus:
        return sum(d.total_mib for d in gpus) * MIB
    return e.total_mib * MIB + RUNTIME_BYTES


@dataclass(slots=True)
class Figures:
    """One fingerprint's figures, in bytes on its device: llama-server's projection, and what
    it reported it allocated after its last load."""

    projected_bytes: int | None = None
    measured_bytes: int | None = None
    at: float = 0.0


class EngineFigures:
    """The engine's figures per model fingerprint, kept in a JSON file so that they outlive a
    restart (a projection is asked once per file and flags; a measurement replaces the last).
    A file that cannot be read is started over; one that cannot be written is left (the
    figures are then asked again at the next start). At most `MAX_ENTRIES`, the oldest go.
    Files written in MiB (`projected_mib`, `measured_mib`) are read too."""

    MAX_ENTRIES = 4096

    def __init__(self, path: Path) -> None:
        import json

        self.path = path
        self._data: dict[str, Figures] = {}
        try:
            raw = json.loads(path.read_text())
            for key, value in raw.items():
                if isinstance(key, str) and isinstance(value, dict):
                    at = value.get("at")
                    self._data[key] = Figures(
                        _bytes(value, "projected"),
                        _bytes(value, "measured"),
                        float(at) if isinstance(at, int | float) else 0.0,
                    )
        except (OSError, ValueError, AttributeError):
            self._data = {}

    def get(self, key: str | None) -> Figures | None:
        return None if key is None else self._data.get(key)

    def record(self, key: str | None, *, projected_bytes: int | None = None,
               measured_bytes: int | None = None) -> None:  # fmt: skip
        if key is None:
            return
        f = self._data.setdefault(key, Figures())
        if projected_bytes is not None:
            f.projected_bytes = projected_bytes
        if measured_bytes is not None:
            f.measured_bytes = measured_bytes
        f.at = time.time()
        self._save()

    def after_load(self, argv: list[str], output: str) -> int | None:
        """What the llama-server started as `argv` reported its load allocated in `output` (that
        start's), in bytes on its device (`device_bytes`), kept as its fingerprint's measured
        figure; None when it reported nothing (another server, a wrapper that hides its output)."""
        found = allocated(output.splitlines())
        if found is None:
            return None
        size = device_bytes(found)
        self.record(fingerprint(argv), measured_bytes=size)
        return size

    def _save(self) -> None:
        import json

        from corral.atomic import replace_text

        while len(self._data) > self.MAX_ENTRIES:
            del self._data[min(self._data, key=lambda k: self._data[k].at)]
        body = {
            k: {"projected_bytes": f.projected_bytes, "measured_bytes": f.measured_bytes,
                "at": f.at}
            for k, f in self._data.items()
        }  # fmt: skip
        with contextlib.suppress(OSError):  # asked again at the next start
            replace_text(self.path, json.dumps(body))


_MAX_BYTES = 1 << 50  # 1 PiB: past it a figure is damage, not a model


def _bytes(entry: dict[str, object], name: str) -> int | None:
    """`entry`'s `<name>_bytes` (or an older file's `<name>_mib`), when plausible."""
    for key, scale in ((f"{name}_bytes", 1), (f"{name}_mib", MIB)):
        value = entry.get(key)
        size = value * scale if isinstance(value, int) and not isinstance(value, bool) else 0
        if 0 < size < _MAX_BYTES:
            return size
    return None


def engine_figures_path(config: Config) -> Path:
    """Where llama-server's memory figures per model are kept (`EngineFigures`)."""
    return Path(config.server.data_dir or data_dir()) / "engine-memory.json"
