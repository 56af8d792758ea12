"""Text in a llama-swap file: ${env.*} first, then macros (typed where llama-swap keeps types),
comment lines in `cmd`, and `filters`; `Mapping` records what became of each key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from corral.envvars import ENV as ENV  # re-exported
from corral.envvars import expand_env as expand_env  # re-exported
from corral.errors import Problem

RESERVED = {"PORT", "MODEL_ID", "PID"}
MACRO = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_-]*)\}")


@dataclass
class Mapping:
    """What became of each llama-swap key: `mapped` (from -> to) and `ignored` (key, reason)."""

    mapped: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)


def scalar(value: Any) -> str:
    """A macro's value as llama-swap writes it into text (YAML's spelling: true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def strip_comments(cmd: str) -> str:
    """llama-swap drops `#` comment lines from a multi-line `cmd`."""
    return "\n".join(x for x in cmd.splitlines() if not x.strip().startswith("#"))


def expand_typed(
    value: Any, macros: dict[str, Any], where: str, problems: list[Problem], model: str
) -> Any:
    """Macros in a structured value (metadata): a string that is one macro keeps the macro's
    type (a number stays a number); other strings are expanded as text."""
    if isinstance(value, dict):
        return {k: expand_typed(v, macros, where, problems, model) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_typed(v, macros, where, problems, model) for v in value]
    if not isinstance(value, str):
        return value
    whole = MACRO.fullmatch(value)
    if whole and whole.group(1) in macros:
        return macros[whole.group(1)]
    return expand(value, {**texts(macros), "MODEL_ID": model}, where, problems)


def filters_of(
    f: dict[str, Any], macros: dict[str, str], model: str, where: str, problems: list[Problem]
) -> dict[str, Any]:
    """llama-swap's `filters` as Corral's: stripParams is a comma-separated string (macros
    expanded); setParamsByID's keys take ${MODEL_ID}."""
    out: dict[str, Any] = {}
    for key in f:
        if key not in ("stripParams", "setParams", "setParamsByID", "strip_params"):
            problems.append(Problem("", None, f"{where}.filters.{key}", "unknown filter"))
    strip = f.get("stripParams", f.get("strip_params"))
    if strip:
        text = expand(str(strip), macros, f"{where}.filters.stripParams", problems)
        out["strip_params"] = [
            p.strip() for p in text.split(",") if p.strip() != "model" and p.strip()
        ]
    if isinstance(f.get("setParams"), dict):
        out["set_params"] = {k: v for k, v in f["setParams"].items() if k != "model"}
    if isinstance(f.get("setParamsByID"), dict):
        ids = {**macros, "MODEL_ID": model}
        out["set_params_by_id"] = {
            expand(str(k), ids, f"{where}.filters.setParamsByID", problems): {
                p: v for p, v in (params or {}).items() if p != "model"
            }
            for k, params in f["setParamsByID"].items()
        }
    return out


def texts(macros: dict[str, Any]) -> dict[str, str]:
    return {k: scalar(v) for k, v in macros.items()}


def expand(text: str, macros: dict[str, str], where: str, problems: list[Problem]) -> str:
    """Substitute user macros (which may use each other); leave Corral's own ones."""
    for _ in range(10):  # macros may refer to macros; a cycle is an error, not a hang

        def one(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in macros:
                return macros[name]
            if name in RESERVED or name.startswith("env."):
                return m.group(0)
            if name not in macros:
                problems.append(Problem("", None, where, f"unknown macro ${{{name}}}"))
                return m.group(0)
            return macros[name]

        expanded = MACRO.sub(one, text)
        if expanded == text:
            return expanded
        text = expanded
    problems.append(Problem("", None, where, "macros refer to each other in a cycle"))
    return text
