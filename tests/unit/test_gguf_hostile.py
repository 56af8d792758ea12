"""A GGUF header is data from outside: every count and length is checked against the
bytes left before anything is read, nesting and work are capped, and values are checked before
any arithmetic. A file that fails is a GgufError (a ValueError) naming the file and the key,
never another exception; a hypothesis fuzz mutates valid files to hold the walker to that."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.modelfiles import gguf as walker
from corral.modelfiles.gguf import GgufError, estimate_memory, read_gguf
from tests.support.gguf_files import gguf_bytes, kv, llama_fields, nested_array, text, write


def test_a_small_valid_file_reads(tmp_path: Path) -> None:
    m = read_gguf(write(tmp_path / "ok.gguf", gguf_bytes(llama_fields())))
    assert (m.architecture, m.context_length, m.heads, m.kv_heads, m.vocab) == (
        "llama", 2048, 4, 2, 4,
    )  # fmt: skip
    assert m.key_length == 16  # embedding // heads, when the file does not say
    assert estimate_memory(m, 2048).total_bytes > 0


HOSTILE_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "head count 0": (
        {"llama__attention__head_count": (T.UINT32, 0)},
        "llama.attention.head_count is 0",
    ),
    "context inf": ({"llama__context_length": (T.FLOAT32, float("inf"))}, "context_length"),
    "context nan": ({"llama__context_length": (T.FLOAT64, float("nan"))}, "context_length"),
    "context negative": ({"llama__context_length": (T.INT32, -4096)}, "context_length is -4096"),
    "context text": ({"llama__context_length": (T.STRING, "128k")}, "context_length"),
    "context 2^62": ({"llama__context_length": (T.UINT64, 1 << 62)}, "context_length"),
    "layers 0": ({"llama__block_count": (T.UINT32, 0)}, "block_count is 0"),
    "embedding 2^40": ({"llama__embedding_length": (T.UINT64, 1 << 40)}, "embedding_length"),
    "kv heads bool": ({"llama__attention__head_count_kv": (T.BOOL, True)}, "head_count_kv"),
    "template a number": ({"tokenizer__chat_template": (T.UINT32, 7)}, "chat_template"),
    "architecture a number": ({"general__architecture": (T.UINT32, 3)}, "architecture"),
    "no context": ({"llama__context_length": None}, "no llama.context_length"),
    "per-layer heads of text": (
        {"llama__attention__head_count": (T.ARRAY, (T.STRING, ["a", "b"]))},
        "head_count",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_VALUES)
def test_a_hostile_value_is_an_error_naming_the_file_and_key(tmp_path: Path, case: str) -> None:
    over, says = HOSTILE_VALUES[case]
    path = write(tmp_path / "a model (Q4).gguf", gguf_bytes(llama_fields(**over)))
    with pytest.raises(GgufError) as caught:
        read_gguf(path)
    assert str(path) in str(caught.value)
    assert says in str(caught.value)


def test_a_file_type_out_of_range_is_shown_not_used(tmp_path: Path) -> None:
    over = {"general__file_type": (T.FLOAT32, float("inf"))}
    m = read_gguf(write(tmp_path / "f.gguf", gguf_bytes(llama_fields(**over))))
    assert m.quantization == "type inf"


@pytest.mark.parametrize(
    ("claims", "says"),
    [
        ({"n_kv": 1 << 60}, "keys"),
        ({"n_tensors": 1 << 60}, "tensors"),
        ({"n_kv": 60_000}, "bytes"),  # within the cap, but past the end of the file
        ({"version": 1}, "too old"),
    ],
)
def test_counts_are_checked_against_the_file(
    tmp_path: Path, claims: dict[str, int], says: str
) -> None:
    path = write(tmp_path / "m.gguf", gguf_bytes(llama_fields(), **claims))
    with pytest.raises(GgufError, match=says):
        read_gguf(path)


def _with(tmp_path: Path, extra: bytes, keys: int = 1) -> Path:
    fields = llama_fields()
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields) + keys)
    body = head + b"".join(kv(k, t, v) for k, (t, v) in fields.items()) + extra
    return write(tmp_path / "m.gguf", body + b"\0" * 64)


def test_a_string_longer_than_the_file_is_never_read(tmp_path: Path) -> None:
    extra = text("x.big") + struct.pack("<IQ", T.STRING, 1 << 62)
    with pytest.raises(GgufError, match="runs past the end"):
        read_gguf(_with(tmp_path, extra))


@pytest.mark.parametrize("kind", [T.UINT8, T.UINT64, T.STRING, T.ARRAY])
def test_an_array_longer_than_the_file_is_never_read(tmp_path: Path, kind: T) -> None:
    extra = text("x.big") + struct.pack("<IIQ", T.ARRAY, kind, 1 << 40)
    with pytest.raises(GgufError, match="runs past the end"):
        read_gguf(_with(tmp_path, extra))


def test_arrays_nested_5000_deep_are_refused_without_recursing(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="nested more than"):
        read_gguf(_with(tmp_path, nested_array(5000)))


def test_a_vocabulary_past_the_work_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(walker, "MAX_ITEMS", 1000)  # 2M empty strings would be 16 MB on disk
    extra = text("x.tokens") + struct.pack("<IIQ", T.ARRAY, T.STRING, 5000) + b"\0" * 8 * 5000
    with pytest.raises(GgufError, match="keys, tensors and array elements"):
        read_gguf(_with(tmp_path, extra))


def test_a_long_string_value_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(walker, "MAX_VALUE_BYTES", 100)
    extra = kv("x.note", T.STRING, "y" * 1000)
    fields, _ = walker._header(_with(tmp_path, extra))
    assert fields["x.note"] == walker._Unread(1000)


def test_tensors_whose_data_is_not_in_the_file_are_a_truncated_file(tmp_path: Path) -> None:
    whole = gguf_bytes(llama_fields(), tensors=3)
    path = write(tmp_path / "partial.gguf", whole[:-100])  # an unfinished download
    with pytest.raises(GgufError, match="truncated"):
        read_gguf(path)


def test_a_fifo_named_gguf_does_not_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.gguf")
    with pytest.raises(GgufError, match="not a regular file"):
        read_gguf(tmp_path / "pipe.gguf")


VALID = gguf_bytes(
    llama_fields(
        llama__attention__head_count=(T.ARRAY, (T.UINT32, [4, 4])),
        tokenizer__chat_template=(T.STRING, "{{ messages }}"),
        llama__attention__sliding_window=(T.UINT32, 64),
    ),
    tensors=3,
)
# `make test` runs 400; the long hunt (docs/security.md) sets CORRAL_FUZZ_EXAMPLES=200000.
FUZZ_EXAMPLES = int(os.environ.get("CORRAL_FUZZ_EXAMPLES", "400"))
_EXTREMES = [0, 1, 255, 1 << 31, (1 << 32) - 1, 1 << 62, (1 << 64) - 1]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid file with some of: bytes overwritten, a u32/u64 set to an extreme, a cut."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(4, len(data) - 8))
        how = draw(st.sampled_from(["byte", "u32", "u64", "cut"]))
        if how == "byte":
            data[at] = draw(st.integers(0, 255))
        elif how == "u32":
            data[at : at + 4] = struct.pack("<I", draw(st.sampled_from(_EXTREMES)) & 0xFFFFFFFF)
        elif how == "u64":
            data[at : at + 8] = struct.pack("<Q", draw(st.sampled_from(_EXTREMES)))
        else:
            del data[at:]
            break
    return bytes(data)


@pytest.mark.property
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=mutated())
def test_fuzz_a_mutated_file_reads_or_is_a_clear_error(tmp_path: Path, data: bytes) -> None:
    """A mutated header gives model facts every estimate can use, or a GgufError naming the
    file; never another exception. The long hunt: docs/security.md."""
    path = write(tmp_path / "fuzz.gguf", data)  # the same file, written anew each example
    try:
        m = read_gguf(path)
    except GgufError as exc:
        said = str(exc)
    else:
        said = ""
    if said:
        assert str(path) in said
        return
    for context in (1, m.context_length, 131072):
        assert estimate_memory(m, context).total_gb >= 0
    assert m.size_label
