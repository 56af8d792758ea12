"""The devices of this machine: NVIDIA GPUs through NVML (`nvidia-ml-py`), else the
host's memory as one CPU device (`psutil`).

NVML is reached through `Nvml`, a thin adapter with one method per NVML call used, so that the
rest is tested on recorded NVML answers on machines without a GPU (`RecordedNvml` in the tests)
and runs unchanged against the real library where one is present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, cast

import psutil


@dataclass(frozen=True, slots=True)
class Device:
    """One device models can be placed on. `env`: what a server started on it needs (a GPU's
    `CUDA_VISIBLE_DEVICES`)."""

    name: str
    kind: str  # "gpu" or "cpu"
    model: str  # "NVIDIA H100 80GB HBM3", or the CPU's count of cores
    total_bytes: int
    free_bytes: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def total_gb(self) -> float:
        return self.total_bytes / 1e9


class Nvml(Protocol):
    """The NVML calls Corral makes (pynvml's names, without the `nvml` prefix)."""

    def init(self) -> None: ...
    def device_count(self) -> int: ...
    def name(self, index: int) -> str: ...
    def uuid(self, index: int) -> str: ...
    def memory(self, index: int) -> tuple[int, int]:
        """(total, free) bytes."""
        ...

    def utilization(self, index: int) -> int:
        """The percent of the last sample period a kernel ran on the GPU."""
        ...


class PyNvml:
    """`Nvml` over the real library. Raises `RuntimeError` when NVML is missing or fails."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py not installed
            raise RuntimeError(f"nvidia-ml-py is not installed ({exc})") from None
        self._nv = pynvml

    def _call(self, fn: str, *args: object) -> object:
        try:
            return getattr(self._nv, fn)(*args)
        except self._nv.NVMLError as exc:
            raise RuntimeError(f"NVML: {exc}") from None

    def init(self) -> None:
        self._call("nvmlInit")

    def device_count(self) -> int:
        return cast(int, self._call("nvmlDeviceGetCount"))

    def _handle(self, index: int) -> object:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def name(self, index: int) -> str:
        raw = self._call("nvmlDeviceGetName", self._handle(index))
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def uuid(self, index: int) -> str:
        raw = self._call("nvmlDeviceGetUUID", self._handle(index))
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def memory(self, index: int) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return int(info.total), int(info.free)  # type: ignore[attr-defined]

    def utilization(self, index: int) -> int:
        rates = self._call("nvmlDeviceGetUtilizationRates", self._handle(index))
        return int(rates.gpu)  # type: ignore[attr-defined]


def gpus(nvml: Nvml, visible: str | None = None) -> list[Device]:
    """The GPUs NVML reports, as `CUDA_VISIBLE_DEVICES` (`visible`, when set) restricts them:
    one device each, named gpu0, gpu1, ... in the order CUDA will number them."""
    nvml.init()
    count = nvml.device_count()
    indices = list(range(count))
    if visible is not None and visible.strip():
        chosen = []
        for item in visible.split(","):
            item = item.strip()
            if item.isdigit() and int(item) < count:
                chosen.append(int(item))
            else:  # a UUID (or its prefix), as CUDA accepts them
                chosen += [i for i in indices if nvml.uuid(i).startswith(item)][:1]
        indices = chosen
    out = []
    for n, i in enumerate(indices):
        total, free = nvml.memory(i)
        out.append(
            Device(f"gpu{n}", "gpu", nvml.name(i), total, free, {"CUDA_VISIBLE_DEVICES": str(i)})
        )
    return out


def cpu() -> Device:
    mem = psutil.virtual_memory()
    cores = psutil.cpu_count(logical=True) or 1
    return Device("cpu", "cpu", f"{cores} cores", int(mem.total), int(mem.available))


def detect(nvml: Nvml | None = None) -> tuple[list[Device], str | None]:
    """This machine's devices, and why there are no GPUs among them (None when there are)."""
    try:
        found = gpus(nvml or PyNvml(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except RuntimeError as exc:
        return [cpu()], str(exc)
    if not found:
        return [cpu()], "NVML reports no GPU"
    return found, None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU now: what `/metrics` and the dashboard show."""

    device: str  # gpu0, gpu1, ... as `gpus` names them
    model: str
    total_bytes: int
    used_bytes: int
    utilization: float  # 0..1


class GpuWatch:
    """Reads the GPUs `gpus` found, on demand (at each scrape). Made by `watch()`; a GPU that
    stops answering is reported as missing from the readings, never as an error."""

    def __init__(self, nvml: Nvml, devices: list[Device]) -> None:
        self.nvml = nvml
        self.devices = devices

    def read(self) -> list[GpuReading]:
        out = []
        for d in self.devices:
            index = int(d.env["CUDA_VISIBLE_DEVICES"])
            try:
                total, free = self.nvml.memory(index)
                util = self.nvml.utilization(index)
            except RuntimeError:
                continue
            out.append(GpuReading(d.name, d.model, total, total - free, util / 100))
        return out


def watch(nvml: Nvml | None = None) -> GpuWatch | None:
    """A `GpuWatch` over this machine's GPUs, or None where NVML has none to show."""
    try:
        nv = nvml or PyNvml()
        found = gpus(nv, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except RuntimeError:
        return None
    return GpuWatch(nv, found) if found else None
