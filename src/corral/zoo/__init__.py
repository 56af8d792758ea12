"""The model zoo: GGUF files of the architectures people run locally in 2026 (dense,
MoE, sliding-window, MLA, Gated-DeltaNet and Mamba-2 hybrids), with random weights, a working
tokenizer and a chat template, made on the machine: no download, deterministic from a seed.
Their answers are noise; their memory, load and prefill costs are a real model's of that shape.

`make_zoo(folder)` writes the tiny zoo the tests serve (a few MB a file); `size_gb` writes the
files benchmarks measure (1-30 GB). `corral zoo DIR` is the same from the command line."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from corral.zoo.archs import ARCHS, Arch, Dims
from corral.zoo.writer import QUANTS, ZooFile, sized_dims, tiny_dims, write

__all__ = ["ARCHS", "QUANTS", "Arch", "Dims", "ZooFile", "file_name", "make", "make_zoo"]


def file_name(arch: str, size_gb: float | None) -> str:
    """`qwen35-tiny.gguf`, `qwen35-2GB.gguf`: the architecture and the size asked for."""
    return f"{arch}-{'tiny' if size_gb is None else f'{size_gb:g}GB'}.gguf"


def make(
    arch: str,
    folder: Path,
    *,
    size_gb: float | None = None,
    seed: int = 0,
    quant: str = "q4_0",
    progress: Callable[[int, int], None] | None = None,
    weights: bool = True,
    template: bool = True,
) -> ZooFile:
    """One zoo model in `folder`: tiny (`size_gb` None) or near `size_gb` GB; `weights` False:
    its header alone, the data a hole; `template` False: no chat template (see `write`)."""
    if arch not in ARCHS:
        raise ValueError(f"no zoo architecture {arch!r}; there are: {', '.join(ARCHS)}")
    if size_gb is not None and not 0.05 <= size_gb <= 200:
        raise ValueError(f"size_gb must be within 0.05..200, not {size_gb}")
    a = ARCHS[arch]
    dims = tiny_dims(a) if size_gb is None else sized_dims(a, int(size_gb * 1e9), quant)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(arch, size_gb)
    return write(
        arch, path, dims, seed=seed, quant=quant, progress=progress, weights=weights,
        template=template,
    )  # fmt: skip


def make_zoo(
    folder: Path,
    archs: Iterable[str] = tuple(ARCHS),
    *,
    size_gb: float | None = None,
    seed: int = 0,
    quant: str = "q4_0",
) -> list[ZooFile]:
    """Every architecture of `archs` in `folder`, one file each."""
    return [make(a, folder, size_gb=size_gb, seed=seed, quant=quant) for a in archs]
