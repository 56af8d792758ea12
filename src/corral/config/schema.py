"""The whole configuration file's schema (`Config`) and the rules across its sections."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from corral.config.models import DeviceConfig, HostConfig, ModelConfig, SchedulerConfig, Strict
from corral.config.server import (
    BatchConfig,
    PromptCacheConfig,
    ServerConfig,
    keeps_prompt_cache,
)
from corral.policy_names import PolicyName


def _with_latest(find: Callable[[str], str | None], name: str) -> str | None:
    """`find(name)`, else, for a name without a tag, `find` of its `:latest`."""
    found = find(name)
    if found is None and ":" not in name.rsplit("/", 1)[-1]:
        found = find(f"{name}:latest")
    return found


@dataclass(frozen=True)
class Names:
    """A configuration's model names and aliases, by the model each names (`Config.names`):
    called with a client's name, the model it refers to, as `Config.resolve` answers."""

    table: dict[str, str]

    def __call__(self, name: str) -> str | None:
        return _with_latest(self.table.get, name)


def _default_devices() -> list[DeviceConfig]:
    return [DeviceConfig(name="device0")]


MIN_CONTEXT = 256  # tokens: less leaves no room for a chat template and an answer
Context = Annotated[int, Field(ge=MIN_CONTEXT, le=1 << 24)]


class ModelsDir(Strict):
    """A folder of GGUF files, and the context its models get (README.md, "Context")."""

    path: str = Field(min_length=1, description="The folder (searched to any depth).")
    context: Context | None = Field(
        default=None,
        description="Tokens of context for every model found here; default: the largest of "
        "32K, 16K, 8K, 4K that the model was trained for and whose memory takes at most half "
        "the largest device (up to 128K on a device of 48 GiB or more).",
    )
    contexts: dict[str, Context] = Field(
        default_factory=dict, description="Tokens of context by model name, over `context`."
    )

    @model_validator(mode="before")
    @classmethod
    def _a_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value

    @property
    def folder(self) -> Path:
        """The folder, `~` expanded."""
        return Path(self.path).expanduser()


class Config(Strict):
    """The whole configuration file."""

    def unserved(self) -> list[str]:
        """Models with neither `cmd` nor `upstream`: scheduled (simulator, task queue) but not
        served by `corral serve`."""
        return [n for n, m in self.models.items() if m.cmd is None and m.upstream is None]

    devices: list[DeviceConfig] = Field(
        default_factory=_default_devices,
        min_length=1,
        description="The devices that hold models (GPUs, or the machine itself); without it "
        "one device, `device0`, that holds one model at a time.",
    )
    models: dict[str, ModelConfig] = Field(
        default_factory=dict,
        description="The models, by the name clients ask for: each a command Corral starts "
        "(`cmd`) or an upstream server (`upstream`).",
    )
    models_dir: list[ModelsDir] = Field(
        default_factory=list,
        description="Folders of GGUF files: each file a model served by llama-server, named by "
        "its file (`corral models DIR` lists them). Models written under `models:` win. Each "
        "a path, or `{path, context, contexts}` to set the context of its models.",
    )
    scheduler: SchedulerConfig = Field(
        default=SchedulerConfig(), description="How the next model is chosen, and wait bounds."
    )
    host: HostConfig = Field(
        default=HostConfig(), description="The machine's own memory, beyond its devices."
    )
    server: ServerConfig = Field(
        default=ServerConfig(), description="`corral serve`: where it listens, keys, limits."
    )
    batch: BatchConfig = Field(
        default=BatchConfig(), description="The Batch API's limits and defaults."
    )
    prompt_cache: PromptCacheConfig = Field(
        default=PromptCacheConfig(),
        description="Prompt caches kept across swaps (llama-server): false turns it off; "
        "true or a section (dir, max_gb, min_tokens) turns it on.",
    )
    # Models a folder offered but Corral does not serve, by name, with why (filled by
    # modelfiles/serving.py, never read from a file): a request for one is told why.
    _skipped: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def skipped(self) -> dict[str, str]:
        return self._skipped

    @field_validator("prompt_cache", mode="before")
    @classmethod
    def _prompt_cache_switch(cls, value: Any) -> Any:
        if isinstance(value, bool):  # `prompt_cache: false` / `true`
            return {"enabled": value}
        return value

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            if not name or name != name.strip() or any(c.isspace() for c in name):
                raise ValueError(f"model name {name!r} must be non-empty without whitespace")
        return models

    @model_validator(mode="after")
    def _fits(self) -> Config:
        if not self.models and not self.models_dir:
            raise ValueError("no models: write them under `models:`, or name folders of GGUF "
                             "files under `models_dir:`")  # fmt: skip
        names = [d.name for d in self.devices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"device names must be unique; repeated: {', '.join(dupes)}")
        for name, m in self.models.items():
            if m.cmd is not None and m.upstream is not None:
                raise ValueError(
                    f"model {name!r} has both `cmd` (start a server) and `upstream` (use a "
                    "running one); keep one"
                )
        seen: dict[str, str] = {}
        for name, m in self.models.items():
            for alias in m.aliases:
                if alias in self.models:
                    raise ValueError(f"alias {alias!r} of model {name!r} is itself a model name")
                if alias in seen:
                    raise ValueError(
                        f"alias {alias!r} is given to both {seen[alias]!r} and {name!r}"
                    )
                seen[alias] = name
        for name in self.server.preload:
            if name not in self.models and name not in seen:
                raise ValueError(
                    f"server.preload names {name!r}, which is not a model or alias; models: "
                    f"{', '.join(self.models)}"
                )
        by_name = {d.name: d for d in self.devices}
        for name, m in self.models.items():
            unknown = [d for d in m.devices if d not in by_name]
            if unknown:
                raise ValueError(
                    f"model {name!r} names devices {', '.join(map(repr, unknown))}, which are "
                    f"not defined; devices: {', '.join(by_name)}"
                )
            if m.devices and m.memory_gb is not None:
                room = [by_name[d].memory_gb for d in m.devices]
                if all(r is not None and m.memory_gb > r + 1e-9 for r in room):
                    raise ValueError(
                        f"model {name!r} needs memory_gb {m.memory_gb:g}, more than any of its "
                        f"devices ({', '.join(m.devices)}) has"
                    )
        sized = [d.memory_gb for d in self.devices if d.memory_gb is not None]
        if len(sized) == len(self.devices):
            biggest = max(sized)
            for name, m in self.models.items():
                if m.memory_gb is not None and m.memory_gb > biggest + 1e-9:
                    raise ValueError(
                        f"model {name!r} needs memory_gb {m.memory_gb:g} but the largest device "
                        f"has {biggest:g}; raise a device's memory_gb or lower the model's"
                    )
        self._pins_leave_room()
        return self

    def _pins_leave_room(self) -> None:
        """On one device, every model must fit beside the pinned ones (with several, where
        pins go is decided live, and a model that fits nowhere then gets a clear error)."""
        pins = [n for n, m in self.models.items() if m.pin]
        if not pins or len(self.devices) != 1:
            return
        d = self.devices[0]
        cap = d.memory_gb

        def size(m: ModelConfig) -> float:
            return m.memory_gb if cap is not None and m.memory_gb is not None else math.inf

        held = sum(size(self.models[n]) for n in pins)
        room = math.inf if cap is None else cap
        if cap is None and len(pins) < len(self.models):  # one model at a time there
            others = [n for n in self.models if n not in pins]
            raise ValueError(
                f"model {others[0]!r} cannot fit on {d.name} beside the pinned "
                f"{', '.join(pins)}: without memory_gb the device holds one model at a time; "
                "unpin it, or set memory_gb on the device and the models"
            )
        if len(pins) > 1 and held > room + 1e-9:
            raise ValueError(
                f"the pinned models {', '.join(pins)} do not fit on {d.name} together; pin "
                "fewer, or give them memory_gb that fits"
            )
        for name, m in self.models.items():
            if not m.pin and held + size(m) > room + 1e-9:
                raise ValueError(
                    f"model {name!r} cannot fit on {d.name} beside the pinned "
                    f"{', '.join(pins)} (a pinned model is never evicted); unpin one, or set "
                    "memory_gb on the device and the models so that they fit together"
                )

    def keeps_prompt_cache(self, name: str) -> bool:
        """Whether model `name`'s prompt caches are kept across swaps (see `prompt_cache`)."""
        return keeps_prompt_cache(self.models[name], self.prompt_cache)

    def resolve(self, name: str) -> str | None:
        """The model a client's name refers to (a model name or an alias), or None. A name
        without a tag also finds its `:latest`, as Ollama resolves `llama3`."""
        return _with_latest(self._resolve, name)

    def names(self) -> Names:
        """What `resolve` knows, as a table that can be pickled (a process of its own resolves
        with it as `resolve` does)."""
        table: dict[str, str] = {}
        # In reverse, so that a model's own name, then the first model with an alias, wins.
        for m, c in reversed(list(self.models.items())):
            ids = c.filters.set_params_by_id if c.filters is not None else {}
            table.update(dict.fromkeys((*c.aliases, *ids), m))
        table.update({m: m for m in self.models})
        return Names(table)

    def _resolve(self, name: str) -> str | None:
        if name in self.models:
            return name
        return next(
            (
                m
                for m, c in self.models.items()
                if name in c.aliases
                or (c.filters is not None and name in c.filters.set_params_by_id)
            ),
            None,
        )

    def with_policy(self, policy: PolicyName) -> Config:
        """A copy of this configuration that runs `policy`."""
        sched = self.scheduler.model_copy(update={"policy": policy})
        return self.model_copy(update={"scheduler": sched})
