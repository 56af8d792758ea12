"""Devices from NVML answers. NVML cannot run on this machine, so the adapter is
driven by answers in NVML's shapes (names, UUIDs, memory in bytes as nvmlDeviceGetMemoryInfo
gives them); `corral devices` runs for real on the CPU path."""

from __future__ import annotations

import subprocess
from typing import ClassVar

import psutil
import pytest
from prometheus_client import generate_latest

from corral.gateway.servers.metrics import Metrics
from corral.machine import GpuWatch, Nvml, detect, gpus, watch
from tests.support.gateway import CORRAL


class RecordedNvml:
    """Two GPUs as NVML reports them."""

    GPUS: ClassVar[list[tuple[str, str, int, int]]] = [
        ("NVIDIA H100 80GB HBM3", "GPU-4f2a1c3e-0000-1111-2222-3333", 85520809984, 84700000000),
        ("NVIDIA L4", "GPU-9b8e7d6c-aaaa-bbbb-cccc-dddd", 24152899584, 20000000000),
    ]

    def __init__(self) -> None:
        self.inited = False

    def init(self) -> None:
        self.inited = True

    def device_count(self) -> int:
        assert self.inited
        return len(self.GPUS)

    def name(self, index: int) -> str:
        return self.GPUS[index][0]

    def uuid(self, index: int) -> str:
        return self.GPUS[index][1]

    def memory(self, index: int) -> tuple[int, int]:
        return self.GPUS[index][2], self.GPUS[index][3]

    def utilization(self, index: int) -> int:
        return (87, 0)[index]  # nvmlDeviceGetUtilizationRates(h).gpu, a percent


class BrokenNvml(RecordedNvml):
    def init(self) -> None:
        raise RuntimeError("NVML: NVML Shared Library Not Found")


def test_each_gpu_is_a_device_that_pins_its_servers_to_it() -> None:
    nvml: Nvml = RecordedNvml()
    found = gpus(nvml)
    assert [(d.name, d.model, d.env) for d in found] == [
        ("gpu0", "NVIDIA H100 80GB HBM3", {"CUDA_VISIBLE_DEVICES": "0"}),
        ("gpu1", "NVIDIA L4", {"CUDA_VISIBLE_DEVICES": "1"}),
    ]
    assert found[0].total_gb == pytest.approx(85.52, abs=0.01)
    assert found[1].free_bytes == 20000000000


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("1", ["NVIDIA L4"]), ("1,0", ["NVIDIA L4", "NVIDIA H100 80GB HBM3"]),
     ("GPU-9b8e", ["NVIDIA L4"]), ("7", []), ("", ["NVIDIA H100 80GB HBM3", "NVIDIA L4"])],
)  # fmt: skip
def test_cuda_visible_devices_narrows_and_orders_them(visible: str, expected: list[str]) -> None:
    found = gpus(RecordedNvml(), visible)
    assert [d.model for d in found] == expected
    assert [d.name for d in found] == [f"gpu{i}" for i in range(len(expected))]


def test_without_nvml_the_host_is_one_cpu_device() -> None:
    found, why = detect(BrokenNvml())
    assert why == "NVML: NVML Shared Library Not Found"
    (d,) = found
    assert (d.name, d.kind, d.env) == ("cpu", "cpu", {})
    assert d.total_bytes == psutil.virtual_memory().total


def test_corral_devices_on_this_machine() -> None:
    out = subprocess.run([CORRAL, "devices"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cpu" in out.stdout
    assert "no GPU: NVML" in out.stderr


class FailingGpu(RecordedNvml):
    """The second GPU fell off the bus after start: NVML raises for it."""

    def memory(self, index: int) -> tuple[int, int]:
        if index == 1:
            raise RuntimeError("NVML: GPU is lost")
        return super().memory(index)


def test_gpu_memory_and_utilisation_reach_metrics_at_each_scrape() -> None:
    gpus = watch(RecordedNvml())
    assert gpus is not None
    metrics = Metrics(lambda: {"models": {}}, gpus)
    text = generate_latest(metrics.registry).decode()
    h100 = 'device="gpu0",name="NVIDIA H100 80GB HBM3"'
    assert f"corral_gpu_memory_total_bytes{{{h100}}} 8.5520809984e+10" in text
    assert f"corral_gpu_memory_used_bytes{{{h100}}} 8.20809984e+08" in text
    assert f"corral_gpu_utilization_ratio{{{h100}}} 0.87" in text
    assert 'corral_gpu_utilization_ratio{device="gpu1",name="NVIDIA L4"} 0.0' in text
    lost = GpuWatch(FailingGpu(), gpus.devices)  # found at start, lost since
    assert [g.device for g in lost.read()] == ["gpu0"]


def test_without_nvml_there_is_no_gpu_watch_and_no_gpu_metrics() -> None:
    assert watch(BrokenNvml()) is None
    text = generate_latest(Metrics(lambda: {"models": {}}).registry).decode()
    assert "corral_gpu" not in text
