"""`${env.NAME}` in configuration text: one code path for Corral's format and llama-swap's."""

from __future__ import annotations

import os
import re
from typing import Any

from corral.errors import Problem

ENV = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: Any, path: tuple[str | int, ...], problems: list[Problem]) -> Any:
    """`${env.NAME}` replaced everywhere in the document, as llama-swap does before anything
    else; an unset variable is an error naming it (never a literal `${env.NAME}`, which as an
    API key would be a working key anyone could guess)."""
    if isinstance(value, dict):
        return {k: expand_env(v, (*path, str(k)), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, (*path, i), problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${env." not in value:
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            where = ".".join(map(str, path))
            problems.append(
                Problem(
                    "", None, where, f"environment variable {name} is not set (${{env.{name}}})"
                )
            )
            return m.group(0)
        return os.environ[name]

    return ENV.sub(one, value)
