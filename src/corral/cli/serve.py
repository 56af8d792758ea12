"""`corral serve`: the gateway, from a configuration, llama-swap's, or models folders."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from corral.cli.models import CONTEXT_HELP
from corral.console import err_console
from corral.console import fail as _fail
from corral.errors import CorralError
from corral.policy_names import POLICY_NAMES

if TYPE_CHECKING:
    from corral.config import Config
    from corral.gateway.relays.supervisor import Relays


def serve_cmd(
    config_path: Annotated[
        Path | None,
        typer.Option("--config", help="Configuration file; without it, the built-in demo."),
    ] = None,
    listen: Annotated[
        str | None, typer.Option(help="host:port to bind (overrides server.listen).")
    ] = None,
    policy: Annotated[
        str | None, typer.Option(help=f"Scheduling policy: {', '.join(POLICY_NAMES)}.")
    ] = None,
    models: Annotated[
        list[Path] | None,
        typer.Option(
            "--models", help="A folder of GGUF files to serve, each a model (repeatable)."
        ),
    ] = None,
    llama_server: Annotated[
        str | None, typer.Option("--llama-server", help="The llama-server for --models.")
    ] = None,
    context: Annotated[list[str] | None, typer.Option("--context", help=CONTEXT_HELP)] = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Apply changes to the config file and the models folders without a restart.",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=0,
            help="Relay processes: they accept clients and carry the models' answers, one "
            "scheduler deciding for all (default: server.relay_processes, else one per core "
            "less one from 4 cores up; 0: all in one process).",
        ),
    ] = None,
) -> None:
    """Serve the OpenAI-compatible gateway: one URL in front of every model's server."""
    from corral.compose import ServeOptions, compose, composed_config

    options = ServeOptions(
        config_path, listen, policy, list(models or []), llama_server, list(context or [])
    )
    try:
        composed = compose(options)
    except CorralError as exc:
        raise _fail(exc) from None
    except ValueError as exc:
        raise _fail(CorralError(str(exc))) from None
    config, title, folders = composed.config, composed.title, composed.folders
    for note in composed.notes:  # names from files: text, never markup
        err_console.print(escape(note), highlight=False)
    for warning in composed.warnings:
        err_console.print(f"[yellow]warning[/yellow]: {escape(warning)}", highlight=False)
    if workers is not None:
        server = config.server.model_copy(update={"relay_processes": workers})
        config = config.model_copy(update={"server": server})
    watched = None
    if watch:
        paths = [p for p in [config_path, *folders] if p is not None]
        if not paths:
            raise _fail(CorralError("--watch needs a config file (--config) or --models DIR"))
        watched = (paths, functools.partial(composed_config, options))
    _serve(config, title, watched)


def _serve(
    config: Config, title: str, watched: tuple[list[Path], Callable[[], Config]] | None
) -> None:
    """Start the gateway on `config` (called `title` in its first line) and serve until a
    signal; `watched`: the paths `--watch` watches and how to compose the config again."""
    import logging

    from corral.child import preload
    from corral.config import data_dir
    from corral.gateway.doors.app import create_app
    from corral.gateway.pipeline.connections import run_server, with_header_timeout

    log_dir = Path(config.server.log_dir) if config.server.log_dir else data_dir() / "logs"
    host, _, port = config.server.listen.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    served = [n for n, m in config.models.items() if m.cmd or m.upstream]
    batches = config.server.store or Path(config.server.data_dir or data_dir()) / "corral.db"
    count = _relay_count(config)
    # What its children run (a reload's reading, a batch file's check), imported once.
    preload("corral.compose", "corral.batch.checker")
    try:  # a key file that cannot be read: never serve without its keys
        app = create_app(config, log_dir, data_dir(), watched, relayed=count > 0)
        app.state.gateway.claim()  # before anything starts, so a second copy changes nothing
    except CorralError as exc:
        raise _fail(exc) from None
    relays = _relays(config, count) if count else None  # the port, once the folder is ours
    if relays is not None:
        app.state.relays = relays
        relays.on_restart = app.state.gateway.metrics.relay_restarts.inc
    err_console.print(
        escape(
            app.state.gateway.redact(
                f"corral serve: {title} on http://{config.server.listen}/v1 "
                f"(policy {config.scheduler.policy}; models: {', '.join(served)}; "
                f"logs: {log_dir}; batches: {batches}; dashboard: "
                f"http://{config.server.listen}/ui; "
                f"relay processes: {relays.count if relays else 0})"
            )
        ),
        highlight=False,
    )
    srv = config.server
    common: dict[str, Any] = {
        "log_level": "warning",
        "http": with_header_timeout(srv.header_timeout_s),
        "timeout_keep_alive": int(max(1, round(srv.keep_alive_s))),
        "limit_concurrency": srv.max_connections,
        "timeout_graceful_shutdown": srv.shutdown_grace_s,
    }
    if relays is None:
        run_server(app, app.state.gateway.events.close, host=host, port=int(port), **common)
        return

    def stop() -> None:
        app.state.gateway.events.close()
        relays.stop()

    # The relays' requests, one connection each for every call in flight, and a margin.
    common["limit_concurrency"] = srv.max_connections * relays.count + 64
    try:
        run_server(app, stop, uds=str(relays.main), on_started=relays.start, **common)
    finally:
        relays.stop()
        relays.wait()


def _relay_count(config: Config) -> int:
    """How many relay processes `corral serve` runs: as configured, else `default_relays`."""
    from corral.gateway.relays.supervisor import default_relays

    asked = config.server.relay_processes
    return asked if asked is not None else default_relays()


def _relays(config: Config, count: int) -> Relays:
    """`count` relay processes, their public socket bound now (not yet started)."""
    from corral.gateway.relays.supervisor import Relays, bind, private_socket_path

    srv = config.server
    try:
        sock = bind(srv.listen)
    except OSError as exc:
        raise _fail(CorralError(f"cannot listen on {srv.listen}: {exc.strerror or exc}")) from None
    return Relays(count, sock, private_socket_path(), srv)
