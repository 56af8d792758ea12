"""The CLI's two consoles. When stdout is a pipe or a file, rich would assume 80 columns and
squeeze tables, so it gets a fixed width; error lines are never wrapped."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

out_console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True)


def fail(exc: object, code: int = 2) -> typer.Exit:
    """Print `error: <exc>` on stderr; returns the exit to raise (`raise fail(exc)`). The
    message is text: a file's name in it is never read as markup."""
    err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
    return typer.Exit(code)
