"""Reading the file: YAML with line numbers, every problem reported at once with its key
path and line (`ConfigError`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from corral.config.models import DeviceConfig, ModelConfig
from corral.config.schema import Config
from corral.envvars import expand_env
from corral.errors import ConfigError, Problem

_Path = tuple[str | int, ...]


def node_lines(
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
            node_lines(value_node, (*path, key), lines, dupes, source)
            lines[(*path, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            node_lines(item, (*path, i), lines, dupes, source)


def _allowed_keys(loc: _Path) -> list[str]:
    """The keys allowed at the mapping that holds `loc`'s last key."""
    model: type[BaseModel] = Config
    parent = loc[:-1]
    i = 0
    while i < len(parent):
        part = parent[i]
        field = _fields_as_written(model).get(str(part))
        if field is None:
            return []
        if model is Config and part in ("models", "devices"):
            model = ModelConfig if part == "models" else DeviceConfig
            i += 2  # skip the model name / list index
            continue
        inner = _section_model(field.annotation)
        if inner is None:
            return []
        model = inner
        i += 1
    return list(_fields_as_written(model))


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The model a key's value is read as: `X` or an optional `X | None`; else None."""
    for candidate in (ann, *get_args(ann)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _fields_as_written(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields under the keys a configuration file uses (a field's alias if it has one)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


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
        return _parse_config(text, source)
    except RecursionError:  # `&a [*a]`: an alias inside what it names
        raise ConfigError(
            [
                Problem(
                    source,
                    None,
                    "",
                    "the YAML refers to itself (an alias inside its own "
                    "anchor, like &a [*a]); write the value out",
                )
            ]
        ) from None


def _parse_config(text: str, source: str) -> Config:
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
    node_lines(root, (), lines, problems, source)
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem(source, 1, "", "the top level must be a mapping (models:, ...)")]
        )
    # ${env.NAME} everywhere, as in llama-swap's format (one code path): an unset variable is
    # an error, never the literal text (as an API key, a working key anyone could guess).
    unset: list[Problem] = []
    data = expand_env(data, (), unset)
    by_where = {".".join(map(str, k)): n for k, n in lines.items()}
    problems += [Problem(source, by_where.get(u.where), u.where, u.message) for u in unset]
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


def read_config_text(path: str | Path) -> str:
    """The text of a configuration file, or `ConfigError` naming the file and the problem."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem(str(p), None, "", "no such file")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(p), None, "", f"not UTF-8 text ({exc.reason})")]) from None


def load_config(path: str | Path) -> Config:
    """Read and validate the configuration file at `path`."""
    return parse_config(read_config_text(path), str(path))
