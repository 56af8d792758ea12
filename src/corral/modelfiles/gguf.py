"""What a GGUF file says about its model, and how much memory llama-server will take to serve it
(issue 27): read with the `gguf` package (llama.cpp's own reader), never by loading the model.

The header is walked with `gguf`'s constants (see `_header` for why not its reader).

The estimate is what llama-server holds once loaded:
- **weights**: the tensors' bytes (mapped from the file);
- **KV cache** at the context chosen: per layer, cells x KV heads x (key + value length) x the
  cache type's bytes (f16: 2). Layers with a sliding window (gemma2, gemma3, ...) keep only
  their window for each parallel sequence plus one micro-batch, as llama.cpp sizes them;
- **compute and runtime**: the graph's buffers for one micro-batch, the output logits and the
  vocabulary, and the server process itself.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
# llama.cpp's defaults, as `llama-server` starts without flags.
UBATCH = 512  # tokens per micro-batch
PARALLEL = 4  # slots (sequences) sharing one unified KV cache
CACHE_BYTES = 2  # f16 keys and values
RUNTIME_BYTES = 24 * MIB  # the server process: code, threads, HTTP, tokenizer tables' fixed part
# Which layers keep only a sliding window: architecture -> every n-th layer is a full one.
SWA_FULL_EVERY = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "llama4": 4}


@dataclass(frozen=True, slots=True)
class GgufModel:
    """The facts of one GGUF file that naming, serving and placing its model need."""

    path: Path
    architecture: str
    name: str
    parameters: int
    quantization: str
    context_length: int  # what the model was trained for
    layers: int
    embedding: int
    feed_forward: int
    heads: int
    kv_heads: int
    key_length: int
    value_length: int
    vocab: int
    sliding_window: int | None
    chat_template: str | None
    weights_bytes: int

    @property
    def size_label(self) -> str:
        """`270M`, `3.2B`: the parameters, as model cards write them."""
        p = self.parameters
        return f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M"


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def total_gb(self) -> float:
        return self.total_bytes / 1e9


def read_gguf(path: Path) -> GgufModel:
    """The model facts of the GGUF file at `path` (its metadata and tensor table only).
    Raises ValueError naming the file and the key for a file that is not a usable GGUF."""
    from gguf import LlamaFileType

    try:
        fields, tensors = _header(path)
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a GGUF file llama.cpp can read ({exc})") from None

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    arch = str(get("general.architecture", ""))
    if not arch:
        raise ValueError(f"{path}: no general.architecture in its metadata")

    def need(key: str) -> int:
        value = get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: no {arch}.{key} in its metadata")
        return int(_scalar(value))

    heads = need("attention.head_count")
    embedding = need("embedding_length")
    kv_heads = int(_scalar(get(f"{arch}.attention.head_count_kv", heads)))
    key_length = int(_scalar(get(f"{arch}.attention.key_length", embedding // heads)))
    value_length = int(_scalar(get(f"{arch}.attention.value_length", key_length)))
    tokens = get("tokenizer.ggml.tokens")
    file_type = get("general.file_type")
    try:
        quant = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type else "?"
    except ValueError:
        quant = f"type {file_type}"
    window = get(f"{arch}.attention.sliding_window")
    return GgufModel(
        path=path,
        architecture=arch,
        name=str(get("general.name", path.stem)),
        parameters=sum(n for n, _ in tensors),
        quantization=quant,
        context_length=need("context_length"),
        layers=need("block_count"),
        embedding=embedding,
        feed_forward=int(_scalar(get(f"{arch}.feed_forward_length", 4 * embedding))),
        heads=heads,
        kv_heads=kv_heads,
        key_length=key_length,
        value_length=value_length,
        vocab=tokens.count if isinstance(tokens, _Array) else int(get(f"{arch}.vocab_size", 0)),
        sliding_window=int(_scalar(window)) if window else None,
        chat_template=get("tokenizer.chat_template"),
        weights_bytes=sum(b for _, b in tensors),
    )


@dataclass(frozen=True, slots=True)
class _Array:
    """A metadata array: its length, and its values when short (per-layer settings)."""

    count: int
    values: list[Any]


_SHORT = 1024  # arrays longer than this (a vocabulary) are counted, not read


def _header(path: Path) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The metadata and, per tensor, (elements, bytes), read from the file's header.

    `gguf.GGUFReader` builds an object per array element: 20 s for a 262,144-token vocabulary
    on this VM, for facts that take 0.2 s. This walks the same layout (`gguf.constants`'
    types and block sizes), skipping long arrays by their lengths."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    fixed = {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
        GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
        GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
        GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }  # fmt: skip
    with path.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        at = 24

        def string() -> str:
            nonlocal at
            (n,) = struct.unpack_from("<Q", data, at)
            text = data[at + 8 : at + 8 + n].decode("utf-8")
            at += 8 + n
            return text

        def value(kind: int) -> Any:
            nonlocal at
            t = GGUFValueType(kind)
            if t == GGUFValueType.STRING:
                return string()
            if t == GGUFValueType.ARRAY:
                inner, n = struct.unpack_from("<IQ", data, at)
                at += 12
                it = GGUFValueType(inner)
                if it in fixed and n > _SHORT:
                    at += n * struct.calcsize("<" + fixed[it])
                    return _Array(n, [])
                if it == GGUFValueType.STRING and n > _SHORT:
                    for _ in range(n):  # lengths only
                        (size,) = struct.unpack_from("<Q", data, at)
                        at += 8 + size
                    return _Array(n, [])
                items = [value(inner) for _ in range(n)]
                return _Array(n, items)
            fmt = "<" + fixed[t]
            (v,) = struct.unpack_from(fmt, data, at)
            at += struct.calcsize(fmt)
            return v

        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            fields[key] = value(kind)
        tensors = []
        for _ in range(n_tensors):
            string()
            (dims,) = struct.unpack_from("<I", data, at)
            shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
            kind, _offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            elements = math.prod(shape)
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            tensors.append((elements, elements // block * size))
        return fields, tensors
    finally:
        data.close()


def _scalar(value: Any) -> Any:
    """Per-layer arrays (some architectures vary heads by layer): the largest."""
    if isinstance(value, _Array):
        return max(value.values) if value.values else 0
    return value


def _pad(n: int, to: int = 256) -> int:
    return int(math.ceil(n / to) * to)


def estimate_memory(
    m: GgufModel,
    context: int,
    parallel: int = PARALLEL,
    ubatch: int = UBATCH,
    cache_bytes: float = CACHE_BYTES,
) -> MemoryEstimate:
    """What llama-server holds serving `m` with `--ctx-size context` (shared by `parallel`
    slots, as its unified KV cache is): see the module docstring."""
    per_cell = m.kv_heads * (m.key_length + m.value_length) * cache_bytes
    every = SWA_FULL_EVERY.get(m.architecture)
    if m.sliding_window and every:
        full_layers = m.layers // every
        swa_cells = min(context, _pad(m.sliding_window * parallel + ubatch))
        kv = per_cell * (full_layers * context + (m.layers - full_layers) * swa_cells)
    else:
        kv = per_cell * m.layers * context
    # One micro-batch's activations (hidden states, the feed-forward's widest tensors, the
    # attention's with flash attention on), the logits of one output per slot, and the
    # vocabulary's tables (token texts, scores, the merge map: about 64 bytes a token).
    activations = ubatch * (6 * m.embedding + 3 * m.feed_forward + m.heads * m.key_length) * 4
    logits = parallel * m.vocab * 4
    compute = activations + logits + 64 * m.vocab + RUNTIME_BYTES
    return MemoryEstimate(m.weights_bytes, int(kv), int(compute))
