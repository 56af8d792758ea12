"""`corral serve`'s configuration, composed from its options (`ServeOptions -> Config`): the
file (Corral's or llama-swap's), the models folders, `--listen` and `--policy`. `serve` composes
it once at start and `--watch` again on every change, through the same `compose`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from corral.config import Config, ModelsDir
from corral.config.schema import MIN_CONTEXT
from corral.errors import CorralError
from corral.gateway.servers.demo import demo_config
from corral.llamaswap import load_config_file
from corral.modelfiles.capabilities import capabilities_of
from corral.modelfiles.engine_memory import EngineFigures, engine_figures_path
from corral.modelfiles.serving import with_folders
from corral.policy_names import POLICY_NAMES
from corral.secrets import warn_if_exposed
from corral.store import POSTGRES_SCHEMES


@dataclass(frozen=True)
class ServeOptions:
    """What `corral serve` was given."""

    config_path: Path | None = None
    listen: str | None = None  # host:port, over server.listen
    policy: str | None = None
    models: Sequence[Path] = ()  # folders of GGUF files
    llama_server: str | None = None  # the llama-server for the folders
    contexts: Sequence[str] = ()  # --context: `N` for every found model, `NAME=N` for one


@dataclass(frozen=True)
class Composed:
    """A composed configuration, what it is called in the log, the folders it serves (watched
    with `--watch`), and what to tell the person starting it: `notes` (keys ignored, files
    skipped) and `warnings` (a secret in a readable file, models not served, a node others
    cannot reach)."""

    config: Config
    title: str
    folders: list[Path]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def composed_config(opts: ServeOptions) -> Config:
    """The configuration `opts` describe, alone (what `corral serve --watch` reads again)."""
    return compose(opts).config


def compose(opts: ServeOptions) -> Composed:
    """The configuration `opts` describe. CorralError (or ValueError) names what is wrong;
    nothing to serve at all is an error too."""
    notes: list[str] = []
    warnings: list[str] = []
    folders_given = list(opts.models)
    if opts.config_path is None and folders_given:
        config = Config.model_validate({"models_dir": [str(m) for m in folders_given]})
        folders_given = []
        title = f"the models in {', '.join(d.path for d in config.models_dir)}"
    elif opts.config_path is None:
        config = demo_config()
        title = "the built-in demo (three simulated models)"
    else:
        config, mapping = load_config_file(opts.config_path)
        title = str(opts.config_path) + (" (llama-swap format)" if mapping else "")
        notes += [f"ignored  {key}: {why}" for key, why in (mapping.ignored if mapping else ())]
        exposed = warn_if_exposed(Path(opts.config_path), config)
        warnings += [exposed] if exposed is not None else []
    config = with_capabilities(config)
    dirs = [*config.models_dir, *(ModelsDir(path=str(f)) for f in folders_given)]
    dirs = with_contexts(dirs, opts.contexts)
    folders = [d.folder for d in dirs]
    if dirs:
        figures = EngineFigures(engine_figures_path(config))
        config, found = with_folders(config, dirs, opts.llama_server, figures)
        notes += [f"models: {note}" for note in found]
    if opts.listen is not None:
        server = config.server.model_validate({**config.server.model_dump(), "listen": opts.listen})
        config = config.model_copy(update={"server": server})
    if opts.policy is not None:
        if opts.policy not in POLICY_NAMES:
            raise CorralError(
                f"unknown policy {opts.policy!r}; choose from {', '.join(POLICY_NAMES)}"
            )
        config = config.with_policy(opts.policy)
    warnings += _served(config, title)
    return Composed(config, title, folders, notes, warnings)


def with_contexts(dirs: list[ModelsDir], given: Sequence[str]) -> list[ModelsDir]:
    """`dirs` with `--context` applied over what each says: `N` for every model found, `NAME=N`
    for one (repeatable). CorralError naming the option's value when it is not one of those."""
    every: int | None = None
    one: dict[str, int] = {}
    for text in given:
        name, _, value = text.rpartition("=")
        try:
            tokens = int(value.replace("_", "").replace(",", ""))
        except ValueError:
            tokens = 0
        if tokens < MIN_CONTEXT or tokens > 1 << 24 or (_ and not name):
            raise CorralError(
                f"--context {text!r}: give tokens of context ({MIN_CONTEXT:,} to 16,777,216) "
                "for every model found (`--context 32768`) or for one (`--context NAME=65536`)"
            )
        if name:
            one[name] = tokens
        else:
            every = tokens
    if every is None and not one:
        return dirs
    return [
        d.model_copy(
            update={
                "context": every if every is not None else d.context,
                "contexts": {**d.contexts, **one},
            }
        )
        for d in dirs
    ]


def _served(config: Config, title: str) -> list[str]:
    """Warnings about what `config` serves; CorralError if it serves nothing."""
    unserved = config.unserved()
    if len(unserved) == len(config.models):
        raise CorralError(
            f"{title}: no model has `cmd` (a server Corral starts) or `upstream` (a running "
            f"server), so there is nothing to serve ({', '.join(unserved)}). Add one of them "
            "to each model (see the README's Gateway section); a file without them is for "
            "`corral simulate` and the task queue."
        )
    out = []
    if unserved:
        out.append(f"not served (no `cmd` or `upstream`): {', '.join(unserved)}")
    shared = (config.server.store or "").startswith(POSTGRES_SCHEMES)
    if shared and config.server.advertised_url() is None:
        out.append(
            f"server.listen is {config.server.listen}, so the other nodes sharing this store "
            "cannot tell where to reach this one: set server.advertise_url (it still forwards "
            "requests to them)"
        )
    return out


def with_capabilities(config: Config) -> Config:
    """`config` with each `cmd:` model that declares no capabilities given those its command
    shows (`modelfiles.capabilities`): what listings say and which `tools` are refused."""
    models = dict(config.models)
    for name, m in config.models.items():
        if m.cmd is not None and m.capabilities is None:
            found = capabilities_of(m.cmd)
            if found is not None:
                models[name] = m.model_copy(update={"capabilities": found})
    return config.model_copy(update={"models": models})
