"""Ollama's model store as models (issue 27): what `ollama pull` left in `~/.ollama/models` (or
`OLLAMA_MODELS`), under the names Ollama users know (`llama3.2:3b`).

The layout: `manifests/<registry>/<namespace>/<model>/<tag>` is a JSON manifest whose layers
name blobs by digest; the blob `blobs/sha256-<hex>` of the layer with media type
`application/vnd.ollama.image.model` is the GGUF file, and one of type
`application/vnd.ollama.image.projector` its vision projector.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MODEL = "application/vnd.ollama.image.model"
PROJECTOR = "application/vnd.ollama.image.projector"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"


@dataclass(frozen=True, slots=True)
class OllamaModel:
    name: str  # as `ollama list` shows it
    gguf: Path
    projector: Path | None
    digest: str  # the manifest's model layer, as /api/tags reports it


def default_store() -> Path:
    """Where Ollama keeps its models: `OLLAMA_MODELS`, else `~/.ollama/models`."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def is_store(folder: Path) -> bool:
    return (folder / "manifests").is_dir() and (folder / "blobs").is_dir()


def _blob(store: Path, digest: str) -> Path:
    return store / "blobs" / digest.replace(":", "-")


def _name(parts: tuple[str, ...]) -> str:
    """`registry/namespace/model/tag` as Ollama writes it: `model:tag` for its own library,
    `namespace/model:tag` for other namespaces, the whole path for other registries."""
    registry, namespace, model, tag = parts
    if registry != DEFAULT_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    if namespace != DEFAULT_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def scan_store(store: Path) -> tuple[list[OllamaModel], list[tuple[Path, str]]]:
    """The models of an Ollama store, and the manifests that could not be used, with why."""
    found: list[OllamaModel] = []
    bad: list[tuple[Path, str]] = []
    root = store / "manifests"
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()):
        parts = manifest.relative_to(root).parts
        if len(parts) != 4:
            bad.append((manifest, "not at manifests/<registry>/<namespace>/<model>/<tag>"))
            continue
        try:
            layers = json.loads(manifest.read_text())["layers"]
            by_type = {layer["mediaType"]: layer["digest"] for layer in layers}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad.append((manifest, f"not an Ollama manifest ({exc})"))
            continue
        if MODEL not in by_type:
            bad.append((manifest, "no model layer"))
            continue
        gguf = _blob(store, by_type[MODEL])
        if not gguf.is_file():
            bad.append((manifest, f"its model blob {gguf.name} is missing"))
            continue
        projector = _blob(store, by_type[PROJECTOR]) if PROJECTOR in by_type else None
        found.append(OllamaModel(_name(parts), gguf, projector, by_type[MODEL]))
    return found, bad
