"""Ollama's model store: names as `ollama list` shows them, blobs by digest, and the
manifests that cannot be used, named."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from corral.modelfiles.ollama_store import is_store, scan_store

MODEL = "application/vnd.ollama.image.model"
PROJECTOR = "application/vnd.ollama.image.projector"


def digest(short: str) -> str:
    """`sha256:aa` as a whole digest (64 hex digits)."""
    kind, _, hexes = short.partition(":")
    return f"{kind}:{hexes * (64 // len(hexes))}"


def manifest(store: Path, where: str, layers: list[tuple[str, Any]], blobs: bool = True) -> None:
    path = store / "manifests" / where
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [{"mediaType": t, "digest": d, "size": 1} for t, d in layers]
    path.write_text(json.dumps({"schemaVersion": 2, "layers": docs}))
    for _, d in layers if blobs else ():
        (store / "blobs" / d.replace(":", "-")).write_bytes(b"x")


def test_names_blobs_and_projectors(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    manifest(tmp_path, "registry.ollama.ai/library/llama3.2/3b", [(MODEL, digest("sha256:aa"))])
    manifest(tmp_path, "registry.ollama.ai/someone/tiny/latest", [(MODEL, digest("sha256:bb"))])
    manifest(
        tmp_path,
        "hf.co/org/repo/Q4_K_M",
        [(MODEL, digest("sha256:cc")), (PROJECTOR, digest("sha256:dd"))],
    )
    manifest(
        tmp_path, "registry.ollama.ai/library/gone/1b", [(MODEL, digest("sha256:ee"))], blobs=False
    )
    manifest(tmp_path, "registry.ollama.ai/library/embed-only/x", [("other", digest("sha256:ff"))])
    (tmp_path / "manifests" / "stray.json").write_text("{}")
    assert is_store(tmp_path)
    found, bad = scan_store(tmp_path)
    assert [(m.name, m.gguf.name) for m in found] == [
        ("hf.co/org/repo:Q4_K_M", "sha256-" + "cc" * 32),
        ("llama3.2:3b", "sha256-" + "aa" * 32),
        ("someone/tiny:latest", "sha256-" + "bb" * 32),
    ]
    assert found[0].projector == tmp_path / "blobs" / ("sha256-" + "dd" * 32)
    assert sorted(why for _, why in bad) == [
        f"its model blob sha256-{'ee' * 32} is missing",
        "no model layer",
        "not at manifests/<registry>/<namespace>/<model>/<tag>",
    ]


@pytest.mark.parametrize(
    ("layer_digest", "why"),
    [
        ("/etc/passwd", "is not sha256:<64 hex digits>"),
        ("sha256:../../../../etc/passwd", "is not sha256:<64 hex digits>"),
        ("sha256-" + "a" * 63 + "/", "is not sha256:<64 hex digits>"),
        ("sha256:" + "A" * 64, "is not sha256:<64 hex digits>"),  # Ollama writes lower case
        (12345, "is not sha256:<64 hex digits>"),
        (None, "is not sha256:<64 hex digits>"),
        (["sha256:" + "a" * 64], "is not sha256:<64 hex digits>"),
        ({"x": 1}, "is not sha256:<64 hex digits>"),
    ],
)
def test_a_digest_that_is_not_a_sha256_is_skipped_with_why(
    tmp_path: Path, layer_digest: Any, why: str
) -> None:
    (tmp_path / "blobs").mkdir()
    manifest(tmp_path, "registry.ollama.ai/library/good/1b", [(MODEL, digest("sha256:ab"))])
    manifest(tmp_path, "registry.ollama.ai/library/evil/1b", [(MODEL, layer_digest)], blobs=False)
    found, bad = scan_store(tmp_path)
    assert [m.name for m in found] == ["good:1b"]  # the other model is still served
    assert [(p.parts[-2], w) for p, w in bad] == [("evil", bad[0][1])]
    assert why in bad[0][1]


def test_a_blob_that_links_outside_the_store_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-secret.gguf"
    outside.write_bytes(b"GGUF secret")
    d = digest("sha256:cd")
    manifest(tmp_path, "registry.ollama.ai/library/linked/1b", [(MODEL, d)], blobs=False)
    os.symlink(outside, tmp_path / "blobs" / d.replace(":", "-"))
    found, bad = scan_store(tmp_path)
    assert found == []
    assert "links outside the store's blobs folder" in bad[0][1]


@pytest.mark.parametrize(
    "text",
    ['{"layers": 5}', '{"layers": [5, "x", null]}', "[1, 2]", "\xff\xfe", "[" * 100_000],
)
def test_a_manifest_that_is_not_one_is_skipped(tmp_path: Path, text: str) -> None:
    (tmp_path / "blobs").mkdir()
    path = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "odd" / "1b"
    path.parent.mkdir(parents=True)
    path.write_text(text, errors="surrogateescape")
    found, bad = scan_store(tmp_path)
    assert found == []
    assert [p for p, _ in bad] == [path]
