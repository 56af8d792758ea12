"""Ollama's model store as models: what `ollama pull` left in `~/.ollama/models` (or
`OLLAMA_MODELS`), under the names Ollama users know (`llama3.2:3b`).

The layout: `manifests/<registry>/<namespace>/<model>/<tag>` is a JSON manifest whose layers
name blobs by digest; the blob `blobs/sha256-<hex>` of the layer with media type
`application/vnd.ollama.image.model` is the GGUF file, and one of type
`application/vnd.ollama.image.projector` its vision projector.

A manifest is data from outside: a digest must be `sha256:` or `sha256-` and 64 hex
digits and its blob must resolve inside `blobs/` once links are followed; anything else, and a
manifest that is not the JSON it should be, is skipped with why.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MODEL = "application/vnd.ollama.image.model"
PROJECTOR = "application/vnd.ollama.image.projector"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DIGEST = re.compile(r"sha256[:-][0-9a-f]{64}")
MAX_MANIFEST_BYTES = 1 << 20  # Ollama's are a few hundred bytes


class BadManifest(ValueError):
    """A manifest Corral cannot use; the message says why."""


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


def _blob(store: Path, digest: object, what: str) -> Path:
    """The blob file of `digest`, which must be a sha256 digest whose file, links followed,
    lies inside the store's `blobs/` folder."""
    if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
        raise BadManifest(f"its {what} digest {str(digest)[:80]!r} is not sha256:<64 hex digits>")
    blobs = store / "blobs"
    path = blobs / digest.replace(":", "-")
    try:
        real = path.resolve(strict=True)
        inside = real.is_relative_to(blobs.resolve(strict=True))
    except (OSError, RuntimeError):  # missing, a loop of links, unreadable
        raise BadManifest(f"its {what} blob {path.name} is missing") from None
    if not inside:
        raise BadManifest(f"its {what} blob {path.name} links outside the store's blobs folder")
    if not real.is_file():
        raise BadManifest(f"its {what} blob {path.name} is not a file")
    return path


def _layers(manifest: Path) -> dict[str, object]:
    """A manifest's layers by media type."""
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            raise BadManifest(f"over {MAX_MANIFEST_BYTES:,} bytes: not an Ollama manifest")
        layers = json.loads(manifest.read_bytes())["layers"]
        if not isinstance(layers, list):
            raise TypeError("layers is not a list")
        return {
            str(layer["mediaType"]): layer.get("digest")
            for layer in layers
            if isinstance(layer, dict)
        }
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        if isinstance(exc, BadManifest):
            raise
        raise BadManifest(f"not an Ollama manifest ({type(exc).__name__}: {exc})") from None


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
            by_type = _layers(manifest)
            if MODEL not in by_type:
                raise BadManifest("no model layer")
            gguf = _blob(store, by_type[MODEL], "model")
            projector = (
                _blob(store, by_type[PROJECTOR], "projector") if PROJECTOR in by_type else None
            )
        except BadManifest as exc:
            bad.append((manifest, str(exc)))
            continue
        found.append(OllamaModel(_name(parts), gguf, projector, str(by_type[MODEL])))
    return found, bad
