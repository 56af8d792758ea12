"""Ollama's model store (issue 27): names as `ollama list` shows them, blobs by digest, and the
manifests that cannot be used, named."""

from __future__ import annotations

import json
from pathlib import Path

from corral.modelfiles.ollama_store import is_store, scan_store

MODEL = "application/vnd.ollama.image.model"
PROJECTOR = "application/vnd.ollama.image.projector"


def manifest(store: Path, where: str, layers: list[tuple[str, str]], blobs: bool = True) -> None:
    path = store / "manifests" / where
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [{"mediaType": t, "digest": d, "size": 1} for t, d in layers]
    path.write_text(json.dumps({"schemaVersion": 2, "layers": docs}))
    for _, digest in layers if blobs else ():
        (store / "blobs" / digest.replace(":", "-")).write_bytes(b"x")


def test_names_blobs_and_projectors(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    manifest(tmp_path, "registry.ollama.ai/library/llama3.2/3b", [(MODEL, "sha256:aa")])
    manifest(tmp_path, "registry.ollama.ai/someone/tiny/latest", [(MODEL, "sha256:bb")])
    manifest(tmp_path, "hf.co/org/repo/Q4_K_M", [(MODEL, "sha256:cc"), (PROJECTOR, "sha256:dd")])
    manifest(tmp_path, "registry.ollama.ai/library/gone/1b", [(MODEL, "sha256:ee")], blobs=False)
    manifest(tmp_path, "registry.ollama.ai/library/embed-only/x", [("other", "sha256:ff")])
    (tmp_path / "manifests" / "stray.json").write_text("{}")
    assert is_store(tmp_path)
    found, bad = scan_store(tmp_path)
    assert [(m.name, m.gguf.name) for m in found] == [
        ("hf.co/org/repo:Q4_K_M", "sha256-cc"),
        ("llama3.2:3b", "sha256-aa"),
        ("someone/tiny:latest", "sha256-bb"),
    ]
    assert found[0].projector == tmp_path / "blobs" / "sha256-dd"
    assert sorted(why for _, why in bad) == [
        "its model blob sha256-ee is missing",
        "no model layer",
        "not at manifests/<registry>/<namespace>/<model>/<tag>",
    ]
