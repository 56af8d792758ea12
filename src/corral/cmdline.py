"""Reading a model server's command line (argv, already split): the value a flag is given and
the model file it names. Pure; no flag is interpreted beyond its spelling."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def flag_value(argv: Sequence[str], *flags: str) -> str | None:
    """The value of the last of `flags` in `argv` (`--flag value` or `--flag=value`); None
    where none is given (or the last one ends the line without a value)."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name in flags:
            found = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def model_file(argv: Sequence[str]) -> Path | None:
    """The model file a llama-server command line names (`-m`/`--model`), if any."""
    for i, a in enumerate(argv):
        if a in ("-m", "--model") and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--model="):
            return Path(a.split("=", 1)[1])
    return None
