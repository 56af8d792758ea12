"""The CLI's two consoles. When stdout is a pipe or a file, rich would assume 80 columns and
squeeze tables, so it gets a fixed width; error lines are never wrapped."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

out_console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True)


def fail(exc: object, code: int = 2) -> typer.Exit:
    """Print `error: <exc>` on stderr; returns the exit to raise (`raise fail(exc)`)."""
    err_console.print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(code)
