"""llama-server's own memory tables read back: the rows of its breakdown, a CPU's
and a GPU's, as llama.cpp's common/fit.cpp prints them; a log without one gives none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.modelfiles.engine_memory import (
    QUIET,
    DeviceMemory,
    EngineFigures,
    allocated,
    breakdowns,
    device_bytes,
    fingerprint,
    reporting,
    split_command,
    without,
)
from corral.modelfiles.gguf import MIB, RUNTIME_BYTES

pytestmark = pytest.mark.unit

# As llama-server printed them for gemma-3-270m at -c 8192 -lv 4 (projection, then at exit).
CPU_LOG = """\
0.00.463.716 I common_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
0.00.463.773 I common_memory_breakdown_print: |   - Host               |                  312 =   222 +      61 +      28                |
0.00.463.788 I common_memory_breakdown_print: |   - CPU_REPACK         |                   12 =    12 +       0 +       0                |
0.00.514.673 I common_params_fit_impl: projected to use 312 MiB of host memory vs. 24105 MiB
0.04.999.153 I common_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
0.04.999.173 I common_memory_breakdown_print: |   - Host               |                  325 =   235 +      61 +      28                |
0.04.999.186 I common_memory_breakdown_print: |   - CPU_REPACK         |                   12 =    12 +       0 +       0                |
"""  # noqa: E501
# A GPU row, as common/fit.cpp writes it:
# total = free + (self = model + context + compute) + unaccounted.
GPU_LOG = """\
I common_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
I common_memory_breakdown_print: |   - CUDA0 (NVIDIA H100 80GB HBM3) | 81079 = 79800 + (1210 = 954 + 192 + 64) +  69 |
I common_memory_breakdown_print: |   - Host               |                  167 =   167 +       0 +       0                |
"""  # noqa: E501


def test_the_projection_and_the_figures_at_exit_are_read_in_order() -> None:
    projected, held = breakdowns(CPU_LOG.splitlines())
    assert projected.devices == {
        "Host": DeviceMemory(222, 61, 28),
        "CPU_REPACK": DeviceMemory(12, 0, 0),
    }
    assert projected.total_mib == 323
    assert held.devices["Host"] == DeviceMemory(235, 61, 28)
    assert held.total_mib == 336


def test_a_gpus_row_is_read_from_its_parenthesis() -> None:
    (table,) = breakdowns(GPU_LOG.splitlines())
    assert table.devices["CUDA0 (NVIDIA H100 80GB HBM3)"] == DeviceMemory(954, 192, 64)
    assert table.devices["Host"] == DeviceMemory(167, 0, 0)


def test_a_log_without_a_table_or_with_broken_rows_gives_none() -> None:
    assert breakdowns(["load_model: loading model 'x.gguf'", "no table here"]) == []
    broken = [
        "common_memory_breakdown_print: | memory breakdown [MiB] | total |",
        "common_memory_breakdown_print: |   - Host | 12 = 1e9 + x + 3 |",
    ]
    assert breakdowns(broken) == []


def test_a_command_is_split_with_its_port_given() -> None:
    cmd = "llama-server -m '/models/my model.gguf' --port ${PORT} --alias 'a b'"
    assert split_command(cmd, 8123) == [
        "llama-server", "-m", "/models/my model.gguf", "--port", "8123", "--alias", "a b",
    ]  # fmt: skip


def test_a_fingerprint_is_the_file_and_the_flags_that_size_its_memory(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    base = ["llama-server", "-m", str(model), "--ctx-size", "8192"]
    key = fingerprint([*base, "--port", "1234", "--alias", "a", "--slot-save-path", "/x"])
    assert key == fingerprint([*base, "--port=999", "--alias", "b"])  # nothing it allocates
    assert key != fingerprint(["llama-server", "-m", str(model), "--ctx-size", "4096"])
    assert key != fingerprint([*base, "--swa-full"])
    model.write_bytes(b"GGUF" + bytes(61))  # another file at the same path
    assert key != fingerprint(base)
    assert fingerprint(["llama-server", "--ctx-size", "8192"]) is None  # no file named
    assert fingerprint(["llama-server", "-m", str(tmp_path / "gone.gguf")]) is None
    assert without(["a", "--port", "1", "b", "--alias=x"], frozenset({"--port", "--alias"})) == [
        "a", "b",
    ]  # fmt: skip


def test_the_figures_outlive_a_restart_and_a_damaged_file_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "corral" / "engine-memory.json"
    figures = EngineFigures(path)
    figures.record("k1", projected_bytes=412 * MIB)
    figures.record("k1", measured_bytes=430 * MIB)
    figures.record(None, projected_bytes=1)  # no fingerprint: nothing kept
    again = EngineFigures(path)
    known = again.get("k1")
    assert known is not None
    assert (known.projected_bytes, known.measured_bytes) == (412 * MIB, 430 * MIB)
    for damaged in ("{", "[]", '{"k": 3}', '{"k": {"projected_bytes": "412"}}', "\\x00"):
        path.write_text(damaged)
        f = EngineFigures(path)
        assert f.get("k1") is None
        k = f.get("k")
        assert k is None or (k.projected_bytes, k.measured_bytes) == (None, None)
    path.write_text(json.dumps({"k": {"projected_bytes": 10**18, "measured_bytes": True}}))
    k = EngineFigures(path).get("k")
    assert k is not None
    assert (k.projected_bytes, k.measured_bytes) == (None, None)  # implausible values are dropped


def test_a_file_written_in_mib_is_read_in_bytes(tmp_path: Path) -> None:
    path = tmp_path / "engine-memory.json"
    path.write_text(json.dumps({"k": {"projected_mib": 412, "measured_mib": 430, "at": 1.0}}))
    known = EngineFigures(path).get("k")
    assert known is not None
    assert (known.projected_bytes, known.measured_bytes) == (412 * MIB, 430 * MIB)
    EngineFigures(path).record("k", measured_bytes=431 * MIB)  # written back in bytes
    assert json.loads(path.read_text())["k"]["measured_bytes"] == 431 * MIB


def test_the_oldest_figures_go_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EngineFigures, "MAX_ENTRIES", 3)
    figures = EngineFigures(tmp_path / "f.json")
    for i in range(5):
        figures.record(f"k{i}", projected_bytes=i + 1)
    kept = EngineFigures(tmp_path / "f.json")
    assert [k for k in ("k0", "k1", "k2", "k3", "k4") if kept.get(k)] == ["k2", "k3", "k4"]


# The buffer lines of the same load (gemma-3-270m, -c 8192, -lv 4), and a GPU's as llama.cpp
# names its buffers there (weights on CUDA0, the embeddings in mapped host memory, a hybrid's
# recurrent state).
BUFFERS = """\
0.01.345.143 I load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
0.01.345.207 I load_tensors:   CPU_REPACK model buffer size =    12.66 MiB
0.01.364.772 I llama_context:        CPU  output buffer size =     4.00 MiB
0.01.364.913 I llama_kv_cache:        CPU KV buffer size =    24.00 MiB
0.01.378.203 I llama_kv_cache:        CPU KV buffer size =    37.50 MiB
0.01.406.005 I sched_reserve:        CPU compute buffer size =    28.78 MiB
"""
GPU_BUFFERS = """\
load_tensors:        CUDA0 model buffer size =  4403.50 MiB
load_tensors:   CPU_Mapped model buffer size =   315.30 MiB
llama_context:  CUDA_Host  output buffer size =     0.58 MiB
llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB
llama_memory_recurrent:      CUDA0 RS buffer size =    62.81 MiB
llama_context:      CUDA0 compute buffer size =   300.75 MiB
llama_context:  CUDA_Host compute buffer size =    24.01 MiB
"""


def test_a_loads_buffers_are_what_it_allocated_with_repacked_weights_counted_once() -> None:
    # The same start's projection says which of the mapped weights stay in use (222 MiB).
    e = allocated([*CPU_LOG.splitlines()[:4], *BUFFERS.splitlines()])
    assert e is not None
    assert e.devices == {
        "CPU_Mapped": DeviceMemory(222, 0, 0),  # the rest of the mapping: repacked, reclaimable
        "CPU_REPACK": DeviceMemory(13, 0, 0),
        "CPU": DeviceMemory(0, 62, 33),
    }
    assert device_bytes(e) == 330 * MIB + RUNTIME_BYTES
    # Within 2% of the server's own projection for the same command (323 MiB, above).
    assert abs(device_bytes(e) - (323 * MIB + RUNTIME_BYTES)) <= 0.02 * device_bytes(e)
    # Without a projection: the whole mapping, as the server counts it at exit.
    alone = allocated(BUFFERS.splitlines())
    assert alone is not None
    assert alone.devices["CPU_Mapped"] == DeviceMemory(235, 0, 0)


def test_on_a_gpu_the_gpus_buffers_are_the_devices_figure() -> None:
    e = allocated(GPU_BUFFERS.splitlines())
    assert e is not None
    assert e.devices["CUDA0"] == DeviceMemory(4404, 575, 301)
    assert device_bytes(e) == (4404 + 575 + 301) * MIB  # CUDA_Host and CPU_Mapped stay in RAM


def test_a_log_without_buffer_lines_reports_nothing() -> None:
    assert allocated(["srv load_model: loading model 'x.gguf'"]) is None
    assert allocated(["load_tensors: CPU model buffer size = lots MiB"]) is None


def test_a_llama_server_command_is_run_at_the_verbosity_that_prints_its_buffers() -> None:
    assert reporting("llama-server -m /m/x.gguf --port ${PORT}") == (
        "llama-server -m /m/x.gguf --port ${PORT} -lv 4"
    )
    assert reporting("llama-server -m x.gguf -lv 2") is None  # the operator's choice stays
    assert reporting("llama-server --model=x.gguf --verbose") is None
    assert reporting("vllm serve org/model") is None  # names no model file
    # The verbosity changes nothing it allocates: the same fingerprint.
    assert without(split_command("s -m x -c 8 -lv 4", 1), frozenset({"-lv"})) == split_command(
        "s -m x -c 8", 1
    )


@pytest.mark.parametrize(
    ("line", "quiet"),
    [
        ("0.08.006.809 I slot get_availabl: id  0 | task -1 |  - skipping, slot is empty", True),
        ("0.08.007.163 I slot   operator(): id  3 | task 0 | new prompt, n_ctx_slot = 8192", True),
        ("0.08.001.265 I slot get_availabl: id  3 | task -1 | selected slot by LRU", False),
        ("0.08.218.800 I slot print_timing: id  3 | task 0 | prompt eval time = 154 ms", False),
        (
            "0.08.218.859 I slot      release: id  3 | task 0 | stop processing: n_tokens = 28",
            False,
        ),
        ("0.08.300.000 W srv  some warning", False),
        ("0.08.300.000 E srv  some error", False),
        ("plain line without a prefix", False),
    ],
)
def test_what_verbosity_4_adds_once_serving_is_left_out_and_what_3_says_stays(
    line: str, quiet: bool
) -> None:
    import re

    assert bool(re.match(QUIET, line)) is quiet
