"""`corral models DIR...`: the models a folder of GGUF files holds, what each is, how much memory
serving it takes, and the command that serves it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from corral.console import err_console, fail, out_console

if TYPE_CHECKING:
    from corral.config import PromptCacheConfig
    from corral.modelfiles.engine_memory import EngineFigures, Figures
    from corral.modelfiles.folder import FoundModel

CONTEXT_HELP = (
    "Tokens of context for the models found in folders: N for all, NAME=N for one "
    "(repeatable). Default: up to 32K by memory (README.md, Context)."
)


def models_cmd(
    folders: Annotated[list[Path], typer.Argument(help="Folders of GGUF files.")],
    llama_server: Annotated[
        str | None, typer.Option("--llama-server", help="The llama-server to run them with.")
    ] = None,
    prompt_cache: Annotated[
        bool,
        typer.Option(
            "--prompt-cache/--no-prompt-cache",
            help="As `corral serve` runs them with prompt caches kept across swaps (the "
            "default; `prompt_cache: false` in a config turns it off).",
        ),
    ] = True,
    context: Annotated[
        list[str] | None,
        typer.Option("--context", help=CONTEXT_HELP),
    ] = None,
) -> None:
    """List the models in FOLDERS: name, file, architecture, parameters, quantization, context,
    memory estimate, whether their prompt caches are kept across swaps, and the command that
    serves each; and, one line each, the files that `corral serve --models` would skip
    (unreadable, implausible, or too big for every device)."""
    from corral.config import ModelConfig, PromptCacheConfig, data_dir
    from corral.modelfiles.engine_memory import EngineFigures
    from corral.modelfiles.folder import find_llama_server, shown
    from corral.modelfiles.serving import figures_key
    from corral.prompt_cache.caches import folder_of, recorded_verdicts, serving

    settings = PromptCacheConfig(enabled=prompt_cache)
    states = folder_of(settings, data_dir() / "logs")

    server = find_llama_server(llama_server) or "llama-server"
    table = Table(title=None, show_lines=False)
    figures = EngineFigures(data_dir() / "engine-memory.json")
    verdicts = recorded_verdicts(states)  # earlier runs' prompt caches found not kept
    lost: list[str] = []
    columns = ("model", "file", "arch", "params", "quant", "context", "memory (GB)", "cache")
    for column in (*columns, "command"):
        # A model's name whole, to copy into a request; the rest folds in a narrow terminal.
        table.add_column(column, overflow="fold", no_wrap=column == "model")
    found, skipped = _scanned(folders, context or [], server, settings, figures)
    for m, source in found:
        served = serving(ModelConfig(cmd=m.command(server)), settings, states)
        known = figures.get(figures_key(m, server, settings))
        why = verdicts.get(_cache_fingerprint(served.cmd)) if served.on else None
        if why is not None:
            lost.append(f"{m.name}: prompt caches not kept: {why}")
        row = (
            m.name,
            shown(m.info.path),
            m.info.architecture,
            m.info.size_label,
            m.info.quantization,
            f"{m.context:,} of {m.info.context_length:,}",
            _memory(m.estimate.total_bytes, known, source),
            "off" if not served.on else "kept" if why is None else "not kept",
            shown(served.cmd or ""),
        )
        table.add_row(*map(escape, row))  # names from files are text, never markup
    if not found:
        where = ", ".join(map(shown, folders))
        raise fail(
            f"no model in {where} can be served ({skipped} skipped, above)"
            if skipped
            else f"no GGUF models in {where}"
        )
    out_console.print(table)
    for line in lost:
        err_console.print(escape(line), highlight=False)


def _scanned(
    folders: list[Path],
    context: list[str],
    server: str,
    settings: PromptCacheConfig,
    figures: EngineFigures,
) -> tuple[list[tuple[FoundModel, str]], int]:
    """The models of `folders` that fit this machine's devices, each with the figure it is
    packed by, and how many files were skipped (each said on stderr, with why)."""
    from corral.compose import with_contexts
    from corral.config import ModelsDir
    from corral.errors import CorralError
    from corral.modelfiles.folder import Contexts, scan
    from corral.modelfiles.serving import budget_bytes, fitting, machine_devices, memory_of

    devices, _ = machine_devices()
    try:
        dirs = with_contexts([ModelsDir(path=str(f)) for f in folders], context)
    except CorralError as exc:
        raise fail(str(exc)) from None
    out: list[tuple[FoundModel, str]] = []
    skipped = 0
    for d in dirs:
        rule = Contexts(budget_bytes(devices), d.context, d.contexts)
        try:
            found, bad = scan(d.folder, settings.enabled, rule)
        except ValueError as exc:
            raise fail(str(exc)) from None
        memory = memory_of(found, server, settings, figures)
        found, too_big = fitting(found, devices, memory)
        for u in [*bad, *too_big]:
            skipped += 1
            err_console.print(f"[yellow]skipped[/yellow] {escape(u.why)}", highlight=False)
        out += [(m, memory[m.name].source) for m in found]
    return out, skipped


def _cache_fingerprint(cmd: str | None) -> str:
    """The fingerprint a server started by `cmd` gives its saved states and verdicts."""
    import shlex

    from corral.cmdline import model_file
    from corral.prompt_cache.states import fingerprint

    flags = shlex.split(cmd or "")
    return fingerprint(model_file(flags) or Path(cmd or ""), flags)


def _memory(estimate_bytes: int, known: Figures | None, source: str) -> str:
    """The file's estimate, llama-server's projection and its report after the last load, the
    one the model is packed by marked with *."""
    parts = [
        ("file estimate", "file", estimate_bytes),
        ("engine", "engine", known.projected_bytes if known else None),
        ("measured", "measured", known.measured_bytes if known else None),
    ]
    return ", ".join(
        f"{label} {value / 1e9:.2f}{'*' if key == source else ''}"
        for key, label, value in parts
        if value is not None
    )


def devices_cmd() -> None:
    """List this machine's devices: NVIDIA GPUs through NVML, else the host's memory."""
    from corral.machine import detect

    found, why = detect()
    table = Table()
    for column in ("device", "kind", "model", "memory", "free", "env"):
        table.add_column(column)
    for d in found:
        env = " ".join(f"{k}={v}" for k, v in d.env.items())
        table.add_row(
            d.name, d.kind, d.model, f"{d.total_gb:.1f} GB", f"{d.free_bytes / 1e9:.1f} GB", env
        )
    out_console.print(table)
    if why is not None:
        err_console.print(f"no GPU: {why}; models go on the CPU device", highlight=False)
