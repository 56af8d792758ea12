"""Writing a zoo model: a GGUF file of an architecture of `archs.py` with random weights, sized
to a target, deterministic from a seed. Large matrices are quantized (Q4_0 by default, as most
local models are 4-bit) and written block by block without quantizing anything: the blocks'
scales are set and their quants drawn at random, so an 8 GB file takes seconds of CPU; norms,
biases, routers and the recurrent layers' small tensors are F32, as converters leave them."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corral.zoo.archs import ARCHS, Arch, Dims, Shape
from corral.zoo.tokenizer import CHAT_TEMPLATE, vocabulary

TINY_EMBD, TINY_LAYERS, TINY_VOCAB = 256, 4, 1024
ALIGN = 32  # GGUF's default alignment of the tensors' data
# Quantized types: (GGUF's file type, bytes per block of 32 weights, the quants' spread).
QUANTS = {"q4_0": (2, 18, 4.6), "q8_0": (7, 34, 73.9), "f16": (1, 64, 1.0)}
WEIGHT_STD = 0.02  # of a random weight; norms are 1 + this
# Tensors a converter keeps in F32 whatever the file's type (llama.cpp's quantizer skips them).
F32_PARTS = (
    "norm",
    "ssm_conv1d",
    "ssm_a",
    "ssm_d",
    "ssm_dt",
    "ssm_alpha",
    "ssm_beta",
    "ffn_gate_inp",
    "exp_probs_b",
    "attn_sinks",
    ".bias",
)


@dataclass(frozen=True, slots=True)
class ZooFile:
    path: Path
    arch: str
    dims: Dims
    quant: str
    weights_bytes: int

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for _, s in ARCHS[self.arch].tensors(self.dims))


def tiny_dims(arch: Arch) -> Dims:
    return arch.dims(TINY_EMBD, TINY_LAYERS, TINY_VOCAB)


WIDTHS = (1024, 2048, 2560, 4096, 5120)  # Qwen3's 0.6B, 1.7B, 4B, 8B and 14B-32B widths


def sized_dims(arch: Arch, target_bytes: int, quant: str = "q4_0") -> Dims:
    """The family's shape whose file is nearest `target_bytes`: the width a model of that many
    parameters has, then the depth (at least 4 layers) that comes nearest; a narrower width
    where 4 layers already overshoot by more than 10% (a wide MoE at 1 GB)."""
    billions = target_bytes / (QUANTS[quant][1] / 32) / 1e9
    limits = (1.0, 2.5, 6.0, 12.0)
    start = next((i for i, b in enumerate(limits) if billions <= b), len(limits))
    best = arch.dims(WIDTHS[0], 4, arch.vocab)
    for embd in reversed(WIDTHS[: start + 1]):
        for layers in range(4, 257):
            dims = arch.dims(embd, layers, arch.vocab)
            if _off(arch, dims, quant, target_bytes) < _off(arch, best, quant, target_bytes):
                best = dims
            if _bytes(arch, dims, quant) > target_bytes:
                break
        if _off(arch, best, quant, target_bytes) <= 0.1:
            break
    return best


def _off(arch: Arch, dims: Dims, quant: str, target_bytes: int) -> float:
    return abs(_bytes(arch, dims, quant) / target_bytes - 1)


def _aligned(n: int) -> int:
    return n + -n % ALIGN


def _bytes(arch: Arch, dims: Dims, quant: str) -> int:
    return sum(_layout(name, shape, quant)[1] for name, shape in arch.tensors(dims))


def _layout(name: str, shape: Shape, quant: str) -> tuple[str, int]:
    """(the type written, its bytes) for one tensor."""
    n = math.prod(shape)
    if len(shape) < 2 or shape[0] % 32 or any(p in name for p in F32_PARTS):
        return "f32", 4 * n
    if quant == "f16":
        return "f16", 2 * n
    return quant, n // 32 * QUANTS[quant][1]


def write(
    arch_name: str,
    path: Path,
    dims: Dims,
    *,
    seed: int = 0,
    quant: str = "q4_0",
    progress: Callable[[int, int], None] | None = None,
    weights: bool = True,
    template: bool = True,
) -> ZooFile:
    """Writes the model to `path` (replaced whole: written beside it, then renamed).
    `weights` False leaves the tensors' data a hole of its size (a sparse file): a header for
    readers of metadata (estimates from the file), nothing a server can load. `template`
    False: no chat template (as many converted GGUFs carry none)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    arch = ARCHS[arch_name]
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    tensors = arch.tensors(dims)
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(str(part), arch.name)
    _metadata(writer, arch, dims, quant, path.stem, template)
    kinds = {
        "f32": GGMLQuantizationType.F32,
        "f16": GGMLQuantizationType.F16,
        "q4_0": GGMLQuantizationType.Q4_0,
        "q8_0": GGMLQuantizationType.Q8_0,
    }
    total = 0
    for name, shape in tensors:
        kind, size = _layout(name, shape, quant)
        numpy_shape = list(reversed(shape))
        if kind in ("q4_0", "q8_0"):
            numpy_shape[-1] = shape[0] // 32 * QUANTS[kind][1]
            writer.add_tensor_info(
                name, numpy_shape, np.dtype(np.uint8), size, raw_dtype=kinds[kind]
            )
        else:
            dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
            writer.add_tensor_info(name, numpy_shape, dtype, size)
        total += size
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    if not weights:  # the tensors' data left a hole: the header is all a reader sees
        assert writer.fout is not None
        out = writer.fout[0]
        start = out.tell() + -out.tell() % ALIGN
        out.truncate(start + sum(_aligned(_layout(n, s, quant)[1]) for n, s in tensors))
        tensors = []
    for name, shape in tensors:
        kind, size = _layout(name, shape, quant)
        writer.write_tensor_data(_data(name, shape, kind, seed))
        done += size
        if progress is not None:
            progress(done, total)
    writer.close()
    part.replace(path)
    return ZooFile(path, arch.name, dims, quant, total)


def _metadata(
    writer: object, arch: Arch, dims: Dims, quant: str, name: str, template: bool = True
) -> None:
    from gguf import GGUFValueType, GGUFWriter

    assert isinstance(writer, GGUFWriter)
    writer.add_name(name)
    writer.add_file_type(QUANTS[quant][0])
    for key, value in arch.metadata(dims).items():
        full = f"{arch.name}.{key}"
        if isinstance(value, list):
            sub = GGUFValueType.FLOAT32 if isinstance(value[0], float) else GGUFValueType.UINT32
            writer.add_key_value(full, value, GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    vocab = vocabulary(dims.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_eot_token_id(vocab.eos)
    writer.add_pad_token_id(vocab.bos)
    writer.add_add_bos_token(False)
    if template:
        writer.add_chat_template(CHAT_TEMPLATE)


def _data(name: str, shape: Shape, kind: str, seed: int) -> np.ndarray:
    """A tensor's random contents, from `seed` and its name alone."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = math.prod(shape)
    if kind in ("q4_0", "q8_0"):
        blocks, size, spread = n // 32, QUANTS[kind][1], QUANTS[kind][2]
        raw = np.frombuffer(rng.bytes(blocks * size), dtype=np.uint8).reshape(blocks, size).copy()
        scale = np.float16(WEIGHT_STD / spread).tobytes()
        raw[:, 0], raw[:, 1] = scale[0], scale[1]
        return raw.reshape(-1)
    values = rng.standard_normal(n, dtype=np.float32) * np.float32(WEIGHT_STD)
    if "norm" in name:
        values += 1.0
    elif name.endswith("ssm_a"):  # a recurrent state's decay: negative
        values = -np.abs(values) - np.float32(0.5)
    return values.astype(np.float16 if kind == "f16" else np.float32)
