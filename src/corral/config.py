"""The one YAML file that describes devices, models and the scheduler.

`load_config(path)` parses and validates it; every problem is reported at once with its key
path and line (`ConfigError`). Unknown keys are errors so that typos never pass silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from corral.errors import ConfigError, Problem

PolicyName = Literal["fifo", "grouped", "fifo-plus", "priority", "cost"]
POLICY_NAMES: tuple[PolicyName, ...] = ("fifo", "grouped", "fifo-plus", "priority", "cost")

NonNegSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosGB = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DeviceConfig(_Strict):
    """A device (GPU, or the CPU box) that holds resident models."""

    name: str = Field(min_length=1)
    memory_gb: PosGB | None = Field(
        default=None, description="Memory for models; without it the device holds one model."
    )


class ModelConfig(_Strict):
    """One model: its swap costs, size, parallelism and importance."""

    load_s: NonNegSeconds = Field(default=5.0, description="Estimated load time, seconds.")
    unload_s: NonNegSeconds = Field(default=1.0, description="Estimated unload time, seconds.")
    memory_gb: PosGB | None = Field(
        default=None, description="Size on a device; without it the model fills a device."
    )
    concurrency: int = Field(default=1, ge=1, description="Requests served at once.")
    priority: int = Field(default=0, description="Model priority; higher is more important.")
    unload_delay_s: NonNegSeconds = Field(
        default=0.0, description="Stay loaded this long after the model's queue empties."
    )
    service_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Prior estimate of one request's service time, replaced by measurements.",
    )


class CostConfig(_Strict):
    """Parameters of the `cost` policy (see docs/design/scheduler.md)."""

    priority_base: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        default=10.0, description="Each step of request priority multiplies its weight by this."
    )
    age_weight_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=60.0, description="A request that has waited this long counts double."
    )
    max_age_factor: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        default=3.0, description="Aging raises a request's weight at most this many times."
    )
    hysteresis: NonNegSeconds = Field(
        default=0.5, description="A challenger must beat the resident model by this fraction."
    )
    linger: bool = Field(
        default=True, description="Keep an idle model while its next request is expected soon."
    )


class SchedulerConfig(_Strict):
    """Which policy decides, and the bound on every wait."""

    policy: PolicyName = "cost"
    max_wait_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=120.0, description="Anti-starvation bound on waits; null disables it."
    )
    min_visit_swaps: NonNegSeconds = Field(
        default=1.0,
        description="A model swapped in serves at least this many times its swap time before "
        "max_wait_s can force it out: swapping never takes more than 1/(1+x) of the device.",
    )
    cost: CostConfig = CostConfig()


def _default_devices() -> list[DeviceConfig]:
    return [DeviceConfig(name="device0")]


class Config(_Strict):
    """The whole configuration file."""

    devices: list[DeviceConfig] = Field(default_factory=_default_devices, min_length=1)
    models: dict[str, ModelConfig] = Field(min_length=1)
    scheduler: SchedulerConfig = SchedulerConfig()

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            if not name or name != name.strip() or any(c.isspace() for c in name):
                raise ValueError(f"model name {name!r} must be non-empty without whitespace")
        return models

    @model_validator(mode="after")
    def _fits(self) -> Config:
        names = [d.name for d in self.devices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"device names must be unique; repeated: {', '.join(dupes)}")
        sized = [d.memory_gb for d in self.devices if d.memory_gb is not None]
        if len(sized) == len(self.devices):
            biggest = max(sized)
            for name, m in self.models.items():
                if m.memory_gb is not None and m.memory_gb > biggest + 1e-9:
                    raise ValueError(
                        f"model {name!r} needs memory_gb {m.memory_gb:g} but the largest device "
                        f"has {biggest:g}; raise a device's memory_gb or lower the model's"
                    )
        return self

    def with_policy(self, policy: PolicyName) -> Config:
        """A copy of this configuration that runs `policy`."""
        sched = self.scheduler.model_copy(update={"policy": policy})
        return self.model_copy(update={"scheduler": sched})


# --- loading with line numbers -------------------------------------------------------------

_Path = tuple[str | int, ...]


def _node_lines(
    node: yaml.Node, path: _Path, lines: dict[_Path, int], dupes: list[Problem], source: str
) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                dupes.append(
                    Problem(
                        source,
                        key_node.start_mark.line + 1,
                        ".".join(map(str, (*path, key))),
                        "key appears twice; keep one",
                    )
                )
            seen.add(key)
            _node_lines(value_node, (*path, key), lines, dupes, source)
            lines[(*path, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _node_lines(item, (*path, i), lines, dupes, source)


def _allowed_keys(loc: _Path) -> list[str]:
    """The keys allowed at the mapping that holds `loc`'s last key."""
    model: type[BaseModel] = Config
    parent = loc[:-1]
    i = 0
    while i < len(parent):
        part = parent[i]
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        if model is Config and part in ("models", "devices"):
            model = ModelConfig if part == "models" else DeviceConfig
            i += 2  # skip the model name / list index
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
        i += 1
    return list(model.model_fields)


def _describe(err: Any) -> str:
    kind = err["type"]
    loc: _Path = tuple(err["loc"])
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc)
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"unknown key{hint}"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"{err['msg'].lower()}; got {err['input']!r}"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return f"{msg}; got {err['input']!r}" if kind not in ("value_error",) else msg


def parse_config(text: str, source: str = "<config>") -> Config:
    """Validate YAML text; raise `ConfigError` listing every problem with its line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(source, line, "", f"not valid YAML: {problem}")]) from exc
    if root is None or data is None:
        raise ConfigError(
            [Problem(source, None, "", "the file is empty; it needs at least `models:`")]
        )
    lines: dict[_Path, int] = {}
    problems: list[Problem] = []
    _node_lines(root, (), lines, problems, source)
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem(source, 1, "", "the top level must be a mapping (models:, ...)")]
        )
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc: _Path = tuple(err["loc"])
            line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
            where = ".".join(str(p) for p in loc) or "(top level)"
            problems.append(Problem(source, line, where, _describe(err)))
    if problems:
        raise ConfigError(sorted(problems, key=lambda p: (p.line or 0, p.where)))
    return config


def load_config(path: str | Path) -> Config:
    """Read and validate the configuration file at `path`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem(str(p), None, "", "no such file")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(p), None, "", f"not UTF-8 text ({exc.reason})")]) from None
    return parse_config(text, str(p))
