"""The models folder's estimate from a file against llama-server's own projection,
over every zoo architecture: the projections below are what llama-server (the `llama` extra,
release 11434, x86 with AVX2) printed for the command `corral serve --models` runs, at 4K and
32K context, for the zoo's 1 GB files (`make bench-zoo-memory`, docs/benchmarks.md). The
estimate must stay within 10% of them and never under them by more than 5%. The files here are
the same headers with their data left a hole: the estimate reads nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.modelfiles.gguf import estimate_memory, read_gguf
from corral.zoo import make

pytestmark = pytest.mark.unit

MIB = 1 << 20
# (architecture, context, the server's projection in MiB): model + context + compute, every
# device row (Host and CPU_REPACK) added.
PROJECTED = [
    ("qwen3", 4096, 1206), ("qwen3", 32768, 2578),
    ("qwen3moe", 4096, 1055), ("qwen3moe", 32768, 1475),
    ("gemma3", 4096, 1647), ("gemma3", 32768, 3943),
    ("gpt-oss", 4096, 1013), ("gpt-oss", 32768, 1251),
    ("deepseek2", 4096, 990), ("deepseek2", 32768, 1207),
    ("qwen35", 4096, 1084), ("qwen35", 32768, 1280),
    ("qwen35moe", 4096, 1015), ("qwen35moe", 32768, 1099),
    ("granitehybrid", 4096, 1426), ("granitehybrid", 32768, 1790),
]  # fmt: skip


@pytest.fixture(scope="module")
def headers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("zoo-headers")
    for arch in sorted({a for a, _, _ in PROJECTED}):
        make(arch, folder, size_gb=1, weights=False)
    return folder


@pytest.mark.parametrize(("arch", "context", "projected_mib"), PROJECTED)
def test_the_estimate_is_within_10_percent_of_the_servers_projection(
    headers: Path, arch: str, context: int, projected_mib: int
) -> None:
    info = read_gguf(headers / f"{arch}-1GB.gguf")
    estimate = estimate_memory(info, context, swa_full=True).total_bytes / MIB
    assert -0.05 <= estimate / projected_mib - 1 <= 0.10, (estimate, projected_mib)


def test_what_the_hybrids_and_mla_cache_is_counted_as_llama_cpp_counts_it(headers: Path) -> None:
    """The parts once 1.5-2x off: a hybrid's KV only on its attention layers plus a fixed
    recurrent state per slot; an MLA model's latent alone."""
    qwen35 = read_gguf(headers / "qwen35-1GB.gguf")
    assert (qwen35.layers, qwen35.attention_layers) == (14, 3)  # one in four: 3, 7, 11
    granite = read_gguf(headers / "granitehybrid-1GB.gguf")
    assert (granite.layers, granite.attention_layers) == (33, 6)  # 0, 6, ..., 30
    # Mamba-2: (conv - 1) * (inner + 2 * groups * state) + state * inner, F32, per slot.
    assert granite.recurrent_state == 27 * (3 * (4096 + 2 * 128) + 128 * 4096)
    deepseek = read_gguf(headers / "deepseek2-1GB.gguf")
    assert deepseek.mla
    assert estimate_memory(deepseek, 32768).kv_bytes == deepseek.layers * 32768 * 576 * 2
    gemma = read_gguf(headers / "gemma3-1GB.gguf")  # tied output, Q4_0: repacked, a 2nd copy
    assert gemma.tied_copy_bytes == 262144 * 2048 // 32 * 18
