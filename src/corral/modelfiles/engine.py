"""What llama.cpp itself says a model takes (issue 47), read from its own tables instead of
estimated from the file.

llama-server, at verbosity 4, prints a memory breakdown per device twice: the projection it
makes with its own flags before it reads any weight (`common_fit_params`, the figure its `--fit`
acts on), and what it held, when it stops. `llama-fit-params --fit-print on` prints a projection
too, but configures the context as a batch tool does, not as the server: it reserves logits for
every token of a micro-batch (`n_outputs`), which the server never does, so its compute figure is
the vocabulary times 512 tokens larger (527 MiB against the server's 28 for gemma-3-270m: see
docs/benchmarks.md, "The engine's memory figures"). Corral reads the server's."""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
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

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MIB


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


def fit_params(binary: Path, flags: list[str], timeout_s: float = 120) -> EngineMemory | None:
    """`llama-fit-params --fit-print on` with `flags` (the model's and the context's): its rows
    of `device model context compute` (MiB); None when it fails."""
    try:
        done = subprocess.run(
            [str(binary), *flags, "--fit-print", "on"],
            capture_output=True, text=True, timeout=timeout_s, check=False,
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
    proc = subprocess.Popen(
        [*argv, *VERBOSE], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            # Its projection printed, or the weights being read (no projection to come).
            if any(mark in line for mark in _PAST_THE_FIT) or time.monotonic() > deadline:
                break
    finally:
        proc.kill()
        proc.wait()
    found = breakdowns(lines)
    return found[0] if found else None


def split_command(cmd: str, port: int) -> list[str]:
    """A model's command as argv, `${PORT}` given."""
    return [a.replace("${PORT}", str(port)) for a in shlex.split(cmd)]
