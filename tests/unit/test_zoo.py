"""The model zoo: every architecture's file is a GGUF the models folder reads, with
its tokenizer and chat template, deterministic from its seed and sized as asked; bad requests
are refused naming what is wrong. (Served by the real llama-server: tests/e2e/test_zoo.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from corral.modelfiles.folder import scan
from corral.modelfiles.gguf import read_gguf
from corral.zoo import ARCHS, make
from corral.zoo.tokenizer import SPECIALS, vocabulary
from corral.zoo.writer import _bytes, sized_dims

pytestmark = pytest.mark.unit


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_reads_as_a_model_of_its_kind(arch: str, tmp_path: Path) -> None:
    made = make(arch, tmp_path)
    info = read_gguf(made.path)
    assert info.architecture == arch
    assert info.context_length == 131072
    assert info.vocab == made.dims.vocab == 1024
    assert info.layers == made.dims.layers
    assert info.parameters == made.parameters
    assert info.weights_bytes == made.weights_bytes
    assert made.path.stat().st_size < 8 << 20  # tiny: a few MB
    assert info.chat_template is not None
    assert "tools" in info.chat_template
    assert info.quantization == "Q4_0"
    (found,), bad = scan(tmp_path)
    assert bad == []
    assert found.name == f"{arch}-tiny"


def test_the_same_seed_gives_the_same_file_and_another_seed_another(tmp_path: Path) -> None:
    a = make("qwen35", tmp_path / "a", seed=7)
    b = make("qwen35", tmp_path / "b", seed=7)
    c = make("qwen35", tmp_path / "c", seed=8)
    assert sha(a.path) == sha(b.path) != sha(c.path)
    assert a.path.stat().st_size == c.path.stat().st_size


@pytest.mark.parametrize("quant", ["q4_0", "q8_0", "f16"])
def test_each_type_of_weights_is_written_as_announced(quant: str, tmp_path: Path) -> None:
    made = make("qwen3", tmp_path, quant=quant)
    info = read_gguf(made.path)
    assert info.quantization == quant.upper()
    assert info.weights_bytes == made.weights_bytes


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("gb", [1, 4, 8, 30])
def test_sized_files_come_within_15_percent_of_the_size_asked(arch: str, gb: int) -> None:
    a = ARCHS[arch]
    dims = sized_dims(a, gb * 10**9)
    assert abs(_bytes(a, dims, "q4_0") / (gb * 1e9) - 1) <= 0.15
    assert dims.layers >= 4
    assert dims.vocab == a.vocab  # a real vocabulary's size: its logits and embeddings count


def test_a_sized_file_is_written_at_its_size(tmp_path: Path) -> None:
    made = make("granitehybrid", tmp_path, size_gb=0.1)
    assert made.path.name == "granitehybrid-0.1GB.gguf"
    assert abs(made.path.stat().st_size / 0.1e9 - 1) < 0.35  # the narrowest width, 4+ layers
    assert read_gguf(made.path).weights_bytes == made.weights_bytes


@pytest.mark.parametrize("size", [260, 1024, 5000, 151936])
def test_the_vocabulary_is_a_byte_level_bpe_of_the_size_asked(size: int) -> None:
    v = vocabulary(size)
    assert len(v.tokens) == len(v.types) == size
    assert len(set(v.tokens)) == size
    assert v.tokens[-len(SPECIALS) :] == list(SPECIALS)
    assert len(v.merges) == size - 256 - len(SPECIALS)
    known = set(v.tokens[:256])
    for merge in v.merges:  # each merge joins two tokens made before it
        left, right = merge.split(" ")
        assert left in known
        assert right in known
        known.add(left + right)
    assert vocabulary(size) == v


def test_bad_requests_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no zoo architecture 'mamba9'.*qwen35"):
        make("mamba9", tmp_path)
    with pytest.raises(ValueError, match="size_gb must be within"):
        make("qwen3", tmp_path, size_gb=0.0)
    with pytest.raises(ValueError, match="quant must be one of q4_0, q8_0, f16"):
        make("qwen3", tmp_path, quant="q2_k")
    with pytest.raises(ValueError, match="at least 260 tokens"):
        vocabulary(100)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
