"""GGUF files for tests, byte by byte: a small valid model of a real architecture, and the same
with any key's value, type or count replaced by what a hostile file would hold (gguf's own
`GGUFWriter` refuses to write those). The layout is GGUF v3's: magic, version, tensor count,
key count, the keys (name, type, value), the tensor table, then the data, aligned to 32."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as T

ALIGN = 32
_FIXED = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i",
          T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d"}  # fmt: skip


def text(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def value(kind: T, v: Any) -> bytes:
    """A value's bytes; an array is (element kind, [values])."""
    if kind == T.STRING:
        return text(v)
    if kind == T.ARRAY:
        inner, items = v
        return struct.pack("<IQ", inner, len(items)) + b"".join(value(inner, x) for x in items)
    return struct.pack("<" + _FIXED[kind], v)


def kv(key: str, kind: T, v: Any) -> bytes:
    return text(key) + struct.pack("<I", kind) + value(kind, v)


def llama_fields(**over: tuple[T, Any] | None) -> dict[str, tuple[T, Any]]:
    """A small llama's metadata; `over` replaces a key's (type, value), None drops it (keys
    are written with `__` for `.`: `llama__context_length`)."""
    fields: dict[str, tuple[T, Any]] = {
        "general.architecture": (T.STRING, "llama"),
        "general.name": (T.STRING, "tiny"),
        "general.file_type": (T.UINT32, 0),
        "llama.context_length": (T.UINT32, 2048),
        "llama.embedding_length": (T.UINT32, 64),
        "llama.block_count": (T.UINT32, 2),
        "llama.feed_forward_length": (T.UINT32, 128),
        "llama.attention.head_count": (T.UINT32, 4),
        "llama.attention.head_count_kv": (T.UINT32, 2),
        "tokenizer.ggml.tokens": (T.ARRAY, (T.STRING, ["<s>", "</s>", "a", "b"])),
    }
    for key, v in over.items():
        key = key.replace("__", ".")
        if v is None:
            fields.pop(key, None)
        else:
            fields[key] = v
    return fields


def gguf_bytes(
    fields: dict[str, tuple[T, Any]],
    *,
    tensors: int = 1,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
) -> bytes:
    """A whole file: `fields`, then `tensors` f32 tensors of 4 x 4 and their data. `n_kv` and
    `n_tensors` override the counts the header claims."""
    table = b"".join(
        text(f"blk.{i}.weight") + struct.pack("<I2QIQ", 2, 4, 4, 0, i * 64) for i in range(tensors)
    )
    head = b"GGUF" + struct.pack(
        "<IQQ",
        version,
        tensors if n_tensors is None else n_tensors,
        len(fields) if n_kv is None else n_kv,
    )
    body = head + b"".join(kv(k, t, v) for k, (t, v) in fields.items()) + table
    body += b"\0" * (-len(body) % ALIGN)
    return body + b"\0" * (64 * tensors)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def nested_array(depth: int) -> bytes:
    """A key whose value is an array of an array ... `depth` deep (the innermost empty)."""
    inner = struct.pack("<IQ", T.UINT8, 0)
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", T.ARRAY, 1) + inner
    return text("x.nested") + struct.pack("<I", T.ARRAY) + inner
