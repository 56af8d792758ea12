"""The `corral` command line (typer + rich): app.py holds the root command and the scheduling
commands (serve, simulate, replay, config, ...); tasks.py `corral db`, `corral tasks` and
`corral worker`; batches.py `corral submit` and `corral batches`; bench.py `corral bench`."""

from corral.cli.app import app, main

__all__ = ["app", "main"]
