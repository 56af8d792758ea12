"""What a GGUF file says about its model, and how much memory llama-server will take to serve it:
read with the `gguf` package (llama.cpp's own reader), never by loading the model.

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

import functools
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
    # Hybrid and recurrent models: layers that keep a KV cache, and the rest's
    # fixed state per sequence (elements, F32: convolution and SSM state, as llama.cpp's
    # n_embd_r + n_embd_s); MLA models cache one latent per token (keys only, the values a view
    # of it); an output tied to the embeddings is a second copy where llama.cpp repacks it.
    attention_layers: int | None = None  # None: every layer
    recurrent_state: int = 0
    mla: bool = False
    tied_copy_bytes: int = 0

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


class GgufError(ValueError):
    """A file that is not a GGUF llama.cpp can serve, or whose header is implausible; the
    message names the file and what is wrong."""


# Bounds on what a header may cost to read, whatever it claims (docs/security.md): real models
# have under a thousand keys, a few thousand tensors and vocabularies under a million tokens.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays (llama.cpp reads none; gguf-py reads some)
MAX_ITEMS = 2_000_000  # keys, tensors and array elements walked one by one (about 0.6 s)
MAX_VALUES = 1 << 18  # array elements kept as Python values (per-layer settings: hundreds)
MAX_KEY_BYTES = 1 << 16
MAX_VALUE_BYTES = 4 << 20  # a longer string (no real chat template is) is passed over, not read
MAX_TEXT_BYTES = 16 << 20  # all the strings read from one header together


def read_gguf(path: Path) -> GgufModel:
    """The model facts of the GGUF file at `path` (its metadata and tensor table only).
    Raises GgufError (a ValueError) naming the file and the key for a file that is not a usable
    GGUF: unreadable, truncated, over the bounds above, or with implausible values."""
    from gguf import LlamaFileType

    try:
        fields, tensors = _header(path)
    except GgufError as exc:
        raise GgufError(f"{path}: not a GGUF file llama.cpp can read ({exc})") from None
    except (ValueError, OSError, struct.error) as exc:
        raise GgufError(f"{path}: not a GGUF file llama.cpp can read ({exc})") from None
    facts = _Facts(path, fields)
    arch = facts.text("general.architecture")
    if arch is None or not 0 < len(arch) <= 64 or not arch.isprintable():
        raise GgufError(f"{path}: no usable general.architecture in its metadata")
    heads = facts.count(f"{arch}.attention.head_count", 1, 1 << 16)
    embedding = facts.count(f"{arch}.embedding_length", 1, 1 << 20)
    key_length = facts.count(f"{arch}.attention.key_length", 1, 1 << 16, max(1, embedding // heads))
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = (
        tokens.count
        if isinstance(tokens, _Array)
        else facts.count(f"{arch}.vocab_size", 0, 1 << 24, 0)
    )
    file_type = fields.get("general.file_type")
    try:
        quant = LlamaFileType(_integral(file_type)).name.removeprefix("MOSTLY_")
    except (ValueError, TypeError):
        quant = "?" if file_type is None else f"type {str(file_type)[:20]}"
    window = facts.count(f"{arch}.attention.sliding_window", 0, 1 << 27, 0)
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GgufError(f"{path}: tokenizer.chat_template is not text")
    weights_bytes = sum(t[1] for t in tensors)
    layers = facts.count(f"{arch}.block_count", 1, 1 << 14)
    attention_layers, state = _recurrence(facts, arch, layers)
    return GgufModel(
        path=path,
        architecture=arch,
        name=facts.text("general.name") or path.stem,
        parameters=sum(t[0] for t in tensors),
        quantization=quant,
        context_length=facts.count(f"{arch}.context_length", 1, MAX_CONTEXT),
        layers=layers,
        embedding=embedding,
        feed_forward=facts.count(f"{arch}.feed_forward_length", 0, 1 << 22, 4 * embedding),
        heads=heads,
        kv_heads=facts.count(f"{arch}.attention.head_count_kv", 1, 1 << 16, heads),
        key_length=key_length,
        value_length=facts.count(f"{arch}.attention.value_length", 1, 1 << 16, key_length),
        vocab=vocab,
        sliding_window=window or None,
        chat_template=template,
        weights_bytes=weights_bytes,
        attention_layers=attention_layers,
        recurrent_state=state,
        mla=f"{arch}.attention.key_length_mla" in fields,
        tied_copy_bytes=_tied_copy(tensors),
    )


# The types llama.cpp's CPU backend repacks on x86 with AVX2 (ggml-cpu/repack.cpp): a tied
# output of one of them is repacked into a buffer of its own beside the embeddings' mapped copy
# (a GPU holds such an output apart from the embeddings too, which stay on the host).
_REPACKED = frozenset({2, 12, 20, 39})  # Q4_0, Q4_K, IQ4_NL, MXFP4
FULL_ATTENTION_EVERY = 4  # Qwen3.5's and Qwen3-Next's default: llama.cpp's when the key is absent


def _tied_copy(tensors: list[tuple[int, int, str, int]]) -> int:
    names = {t[2]: t for t in tensors}
    embd = names.get("token_embd.weight")
    if embd is None or "output.weight" in names or embd[3] not in _REPACKED:
        return 0
    return embd[1]


def _recurrence(facts: _Facts, arch: str, layers: int) -> tuple[int | None, int]:
    """(the layers with a KV cache, None for all; the recurrent state per sequence of all the
    others, in elements). Which layers recur: an explicit list (`attention.recurrent_layers`),
    zero KV heads in a per-layer list (Mamba-2 hybrids), or one full-attention layer in
    `full_attention_interval` (Gated DeltaNet hybrids)."""
    inner = facts.count(f"{arch}.ssm.inner_size", 0, 1 << 22, 0)
    if not inner:
        return None, 0
    state = facts.count(f"{arch}.ssm.state_size", 0, 1 << 16, 0)
    groups = facts.count(f"{arch}.ssm.group_count", 0, 1 << 16, 0)
    conv = facts.count(f"{arch}.ssm.conv_kernel", 0, 1 << 10, 0)
    per_layer = max(0, conv - 1) * (inner + 2 * groups * state) + state * inner
    listed = facts.fields.get(f"{arch}.attention.recurrent_layers")
    kv = facts.fields.get(f"{arch}.attention.head_count_kv")
    if isinstance(listed, _Array) and len(listed.values) == layers:
        recurrent = sum(1 for v in listed.values if v)
    elif isinstance(kv, _Array) and len(kv.values) == layers:
        recurrent = sum(1 for v in kv.values if v == 0)
    else:
        every = facts.count(f"{arch}.full_attention_interval", 1, 1 << 14, FULL_ATTENTION_EVERY)
        recurrent = layers - layers // every
    return layers - recurrent, recurrent * per_layer


MAX_CONTEXT = 1 << 27  # 134M tokens: past any model's training context


def _integral(value: Any) -> int:
    """`value` as an int when it is one (or a whole finite float); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a number: {str(value)[:40]!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"not a whole number: {value!r}")
        return int(value)
    return value


@dataclass(frozen=True, slots=True)
class _Facts:
    """Typed, bounded reads of a header's metadata: a value of the wrong type or out of its
    range is a GgufError naming the file and the key, before any arithmetic uses it."""

    path: Path
    fields: dict[str, Any]

    def text(self, key: str) -> str | None:
        value = self.fields.get(key)
        return value if isinstance(value, str) else None

    def count(self, key: str, lo: int, hi: int, default: int | None = None) -> int:
        """The key's whole number in [lo, hi]; per-layer arrays give their largest. Absent:
        `default`, or an error when there is none."""
        value = self.fields.get(key)
        if value is None:
            if default is None:
                raise GgufError(f"{self.path}: no {key} in its metadata")
            return default
        try:
            if isinstance(value, _Array):
                if not value.values:
                    raise ValueError(f"an array of {value.count} values, none read")
                n = max(_integral(v) for v in value.values)
            else:
                n = _integral(value)
        except (ValueError, TypeError) as exc:
            raise GgufError(f"{self.path}: {key} is not a count ({exc})") from None
        if not lo <= n <= hi:
            raise GgufError(f"{self.path}: {key} is {n}, outside {lo}..{hi}")
        return n


@dataclass(frozen=True, slots=True)
class _Array:
    """A metadata array: its length, and its values when short (per-layer settings)."""

    count: int
    values: list[Any]


@dataclass(frozen=True, slots=True)
class _Unread:
    """A string value longer than MAX_VALUE_BYTES: its length, passed over."""

    size: int


_SHORT = 1024  # arrays longer than this (a vocabulary) are counted, not read
_U64 = struct.Struct("<Q")


class _Walk:
    """A bounded cursor over a GGUF header: every length and count is checked against the
    bytes left before anything is read or allocated, and the work is capped (MAX_*)."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0
        self.end = len(data)
        self.items = 0
        self.kept = 0
        self.text_bytes = 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if size > self.end - self.at:
            raise GgufError(f"truncated at byte {self.at}")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values

    def tick(self, n: int = 1) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise GgufError(f"more than {MAX_ITEMS:,} keys, tensors and array elements")

    def keep(self, n: int) -> None:
        self.kept += n
        if self.kept > MAX_VALUES:
            raise GgufError(f"more than {MAX_VALUES:,} array values in its metadata")

    def skip_strings(self, n: int) -> None:
        """Pass over `n` strings by their lengths (a vocabulary), reading none."""
        at, end, data, unpack = self.at, self.end, self.data, _U64.unpack_from
        for _ in range(n):
            if at + 8 > end:
                raise GgufError(f"truncated at byte {at}")
            at += 8 + unpack(data, at)[0]
            if at > end:
                raise GgufError(f"a string at byte {at} runs past the end")
        self.at = at

    def skip(self, size: int) -> None:
        if size > self.end - self.at:
            raise GgufError(f"a length of {size:,} bytes at byte {self.at} runs past the end")
        self.at += size

    def string(self, limit: int | None = None) -> str | _Unread:
        limit = MAX_VALUE_BYTES if limit is None else limit
        (n,) = self.take("<Q")
        if n > self.end - self.at:
            raise GgufError(f"a string of {n:,} bytes at byte {self.at} runs past the end")
        if n > limit:
            self.at += n
            return _Unread(n)
        self.text_bytes += n
        if self.text_bytes > MAX_TEXT_BYTES:
            raise GgufError(f"more than {MAX_TEXT_BYTES >> 20} MiB of text in its metadata")
        text = self.data[self.at : self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return text

    def key(self) -> str:
        (n,) = self.take("<Q")
        if n > min(MAX_KEY_BYTES, self.end - self.at):
            raise GgufError(f"a key of {n:,} bytes at byte {self.at}")
        raw = self.data[self.at : self.at + n]
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"a key at byte {self.at - n} is not UTF-8") from None


@functools.cache
def _fixed() -> dict[Any, str]:
    """GGUF's fixed-size value types, each with its `struct` format."""
    from gguf import GGUFValueType

    return {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
        GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
        GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
        GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }  # fmt: skip


def _header(path: Path) -> tuple[dict[str, Any], list[tuple[int, int, str, int]]]:
    """The metadata and, per tensor, (elements, bytes, name, type), read from its header.

    `gguf.GGUFReader` builds an object per array element: 20 s for a 262,144-token vocabulary
    on this VM, for facts that take 0.2 s. This walks the same layout (`gguf.constants`'
    types and block sizes), skipping long arrays by their lengths, within the bounds above
    (GgufError past them)."""
    if not path.is_file():  # a FIFO or device named *.gguf would block the open
        raise GgufError("not a regular file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GgufError("no GGUF magic")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        w = _Walk(data)
        w.at = 4
        version, n_tensors, n_kv = w.take("<IQQ")
        if version < 2:
            raise GgufError(f"GGUF version {version} is too old")
        if n_kv > MAX_KEYS or n_tensors > MAX_TENSORS:
            raise GgufError(f"it claims {n_kv:,} keys and {n_tensors:,} tensors")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            w.tick()
            key = w.key()
            (raw,) = w.take("<I")
            fields[key] = _value(w, _kind_of(w, raw), 0)
        tensors = [_tensor(w) for _ in range(n_tensors)]
        _check_data(w, fields, tensors)
        return fields, [(elements, n, name, kind) for elements, n, _, name, kind in tensors]
    finally:
        data.close()


def _kind_of(w: _Walk, raw: int) -> Any:
    from gguf import GGUFValueType

    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GgufError(f"unknown value type {raw} at byte {w.at}") from None


def _value(w: _Walk, t: Any, depth: int) -> Any:
    """The value of type `t` at `w`: long arrays are skipped by their lengths (`_Array`)."""
    from gguf import GGUFValueType

    fixed = _fixed()
    if t == GGUFValueType.STRING:
        return w.string()
    if t == GGUFValueType.ARRAY:
        if depth >= MAX_DEPTH:
            raise GgufError(f"arrays nested more than {MAX_DEPTH} deep")
        inner_raw, n = w.take("<IQ")
        inner = _kind_of(w, inner_raw)
        if inner in fixed:
            size = struct.calcsize("<" + fixed[inner])
            if n > (w.end - w.at) // size:
                raise GgufError(f"an array of {n:,} values runs past the end")
            if n > _SHORT:
                w.skip(n * size)
                return _Array(n, [])
        elif n > (w.end - w.at) // 8:  # a string or an array takes 8 bytes at least
            raise GgufError(f"an array of {n:,} values runs past the end")
        w.tick(n)
        if inner == GGUFValueType.STRING and n > _SHORT:
            w.skip_strings(n)
            return _Array(n, [])
        w.keep(n)
        return _Array(n, [_value(w, inner, depth + 1) for _ in range(n)])
    (v,) = w.take("<" + fixed[t])
    return v


def _tensor(w: _Walk) -> tuple[int, int, int, str, int]:
    """The next tensor's record: (elements, bytes, offset of its data, name, type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    w.tick()
    name = w.string(limit=MAX_KEY_BYTES)
    (dims,) = w.take("<I")
    if not 0 < dims <= MAX_DIMS:
        raise GgufError(f"a tensor of {dims} dimensions")
    shape = w.take(f"<{dims}Q")
    raw_kind, offset = w.take("<IQ")
    elements = math.prod(shape)
    if elements > 1 << 50:
        raise GgufError(f"a tensor of {elements:,} elements")
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_kind)]
    except (ValueError, KeyError):
        raise GgufError(f"a tensor of unknown type {raw_kind}") from None
    return (
        elements,
        elements // block * size,
        offset,
        name if isinstance(name, str) else "",
        raw_kind,
    )


def _check_data(
    w: _Walk, fields: dict[str, Any], tensors: list[tuple[int, int, int, str, int]]
) -> None:
    """Every tensor's data lies in the file: a file cut short (an unfinished download) or one
    that claims more than it holds is found here, not by llama-server."""
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= 1 << 16:
        raise GgufError(f"general.alignment is {str(alignment)[:20]}")
    data_bytes = w.end - (w.at + -w.at % alignment)
    needed = max((offset + n for _, n, offset, _, _ in tensors), default=0)
    if needed > data_bytes:
        raise GgufError(
            f"truncated: its tensors need {needed:,} bytes of data, the file holds "
            f"{max(0, data_bytes):,} (an unfinished download?)"
        )


def _pad(n: int, to: int = 256) -> int:
    return int(math.ceil(n / to) * to)


def estimate_memory(
    m: GgufModel,
    context: int,
    parallel: int = PARALLEL,
    ubatch: int = UBATCH,
    cache_bytes: float = CACHE_BYTES,
    swa_full: bool = False,
) -> MemoryEstimate:
    """What llama-server holds serving `m` with `--ctx-size context` (shared by `parallel`
    slots, as its unified KV cache is): see the module docstring. `swa_full`: run with
    --swa-full, its sliding-window layers keep the whole context (what makes a saved prompt
    cache restore exactly)."""
    # MLA caches the latent alone (its keys; the values are a view of them).
    per_cell = m.kv_heads * (m.key_length + (0 if m.mla else m.value_length)) * cache_bytes
    attention = m.layers if m.attention_layers is None else m.attention_layers
    every = SWA_FULL_EVERY.get(m.architecture)
    if m.sliding_window and every and not swa_full:
        full_layers = m.layers // every
        swa_cells = min(context, _pad(m.sliding_window * parallel + ubatch))
        kv = per_cell * (full_layers * context + (m.layers - full_layers) * swa_cells)
    else:
        kv = per_cell * attention * context
    kv += m.recurrent_state * 4 * parallel  # F32, one state per sequence (slot)
    # One micro-batch's activations (hidden states, the feed-forward's widest tensors, the
    # attention's with flash attention on), the logits of one output per slot, and the
    # vocabulary's tables (token texts, scores, the merge map: about 64 bytes a token).
    activations = ubatch * (6 * m.embedding + 3 * m.feed_forward + m.heads * m.key_length) * 4
    logits = parallel * m.vocab * 4
    compute = activations + logits + 64 * m.vocab + RUNTIME_BYTES
    return MemoryEstimate(m.weights_bytes + m.tied_copy_bytes, int(kv), int(compute))
