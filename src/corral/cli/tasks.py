"""`corral db` and `corral tasks`: look after the task store from the shell."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.table import Table
from rich.text import Text

from corral.console import err_console, out_console
from corral.console import fail as _fail
from corral.errors import CorralError
from corral.limits import PRESENCE_S
from corral.store import Store, StoreError, Task, TaskStatus, open_store
from corral.store.sql import SqlStore

if TYPE_CHECKING:
    from corral.queue import Queue

db_app = typer.Typer(help="Manage the task database.", no_args_is_help=True)
tasks_app = typer.Typer(help="Inspect and steer queued tasks.", no_args_is_help=True)
out, err = out_console, err_console

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="CORRAL_DB",
        help="Store URL: sqlite:///tasks.db or postgresql://host/db (env CORRAL_DB).",
    ),
]
DEFAULT_DB = "sqlite:///corral.db"


def _open(url: str, read_only: bool = False) -> Store:
    """The store of a `corral tasks` command: never created here (a typo in --db must not make
    an empty database), opened read-only for commands that only read."""
    try:
        return open_store(url, create=False, read_only=read_only)
    except CorralError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None


def _when(t: float | None) -> str:
    return "" if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _json(task: Task) -> dict[str, Any]:
    d = asdict(task)
    d["status"] = task.status.value
    return d


@db_app.command("upgrade")
def db_upgrade(db: DbOption = DEFAULT_DB) -> None:
    """Apply pending schema migrations (Corral also applies them whenever it opens a store)."""
    if not db.startswith(("sqlite:", "postgres")):
        err.print(f"[red]error:[/red] {db!r} has no schema; give sqlite:///... or postgresql://...")
        raise typer.Exit(2)
    try:
        store = open_store(db, migrate=False)
        assert isinstance(store, SqlStore)
        applied = store.schema.upgrade()
        version = store.schema.version()
        store.close()
    except CorralError as exc:
        raise _fail(exc) from None
    done = f"applied {', '.join(map(str, applied))}" if applied else "already up to date"
    # One line, as written (a long path is not wrapped, its brackets are not markup).
    out.print(f"{db}: schema version {version} ({done})", soft_wrap=True, markup=False)


@tasks_app.command("list")
def tasks_list(
    db: DbOption = DEFAULT_DB,
    status: Annotated[TaskStatus | None, typer.Option(help="Only this status.")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """Tasks, newest first, with per-model counts."""
    store = _open(db, read_only=True)
    try:
        rows = store.list(status=status, model=model, limit=limit, full=False)
        counts = store.counts()
        workers = store.members.workers(time.time() - PRESENCE_S)
    except StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    served = set().union(*workers.values())
    unserved = {
        m: c[TaskStatus.QUEUED]
        for m, c in sorted(counts.items())
        if c.get(TaskStatus.QUEUED) and m not in served
    }
    if unserved:
        running = "; ".join(f"{w} serves {', '.join(ms) or 'nothing'}" for w, ms in workers.items())
        err.print(
            "[yellow]warning[/yellow]: queued for models no running worker serves: "
            + ", ".join(f"{m} ({n})" for m, n in unserved.items())
            + f" ({running or f'no worker seen in the last {PRESENCE_S:g} s'}); "
            "they wait until a worker with handlers for them runs",
            highlight=False,
        )
    if as_json:  # without payload and result, which may be large: `corral tasks show ID`
        for t in rows:
            d = _json(t)
            del d["payload"], d["result"]
            print(json.dumps(d))
        return
    table = Table(title=f"tasks in {db}", title_justify="left")
    for col in ("id", "kind", "model", "status", "priority", "attempts", "created", "error"):
        table.add_column(
            col,
            justify="right" if col in ("priority", "attempts") else "left",
            overflow="fold" if col == "error" else "ellipsis",
        )
    style = {
        TaskStatus.SUCCEEDED: "green",
        TaskStatus.FAILED: "red",
        TaskStatus.RUNNING: "cyan",
        TaskStatus.CANCELLED: "dim",
    }
    for t in rows:
        table.add_row(
            t.id,
            t.kind,
            t.model,
            Text(t.status.value, style=style.get(t.status, "")),
            str(t.priority),
            f"{t.attempts}/{t.max_attempts}",
            _when(t.created_at),
            (t.error or "")[:60],
        )
    out.print(table)
    summary = ", ".join(
        f"{m}: " + " ".join(f"{n} {s.value}" for s, n in sorted(c.items()))
        for m, c in sorted(counts.items())
    )
    out.print(summary or "no tasks")


SHOWN_CHARS = 10_000  # of a payload, result or error in `show`'s table; --json prints it all


@tasks_app.command("show")
def tasks_show(
    task_id: str,
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Everything about one task: payload, result, every attempt's error."""
    store = _open(db, read_only=True)
    try:
        t = store.get(task_id)
    except StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    if as_json:
        print(json.dumps(_json(t), indent=2))
        return
    table = Table(show_header=False, title=f"task {t.id}", title_justify="left")
    table.add_column(style="cyan")
    table.add_column(overflow="fold")
    for key, value in _json(t).items():
        if (key.endswith("_at") or key == "run_after") and value is not None:
            value = _when(value)
        elif isinstance(value, dict | list):
            value = json.dumps(value)
        text = "" if value is None else str(value)
        if len(text) > SHOWN_CHARS:  # rich lays out every character: 10 MB took 35 s
            text = (
                f"{text[:SHOWN_CHARS]}... ({len(text) - SHOWN_CHARS:,} more characters; "
                f"`corral tasks show {t.id} --json` prints it all)"
            )
        table.add_row(key, text)
    out.print(table)


_R = TypeVar("_R")


def _with_store(db: str, op: Callable[[Store], _R]) -> _R:
    store = _open(db)
    try:
        return op(store)
    except StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()


@tasks_app.command("cancel")
def tasks_cancel(task_id: str, db: DbOption = DEFAULT_DB) -> None:
    """Cancel a task: a queued one never starts; a running one is told to stop."""
    status = _with_store(db, lambda s: s.cancel(task_id))
    note = {
        TaskStatus.RUNNING: " (its worker tells the handler within a second: async handlers "
        "and sync ones with timeout_s are stopped; other sync handlers stop when they check "
        "current_task().cancelled, or run to their end and their result is dropped)"
    }.get(status, "")
    out.print(f"{task_id}: {status.value}{note}")


@tasks_app.command("retry")
def tasks_retry(task_id: str, db: DbOption = DEFAULT_DB) -> None:
    """Queue a failed or cancelled task again, with fresh attempts."""
    status = _with_store(db, lambda s: s.retry(task_id))
    out.print(f"{task_id}: {status.value}")


@tasks_app.command("purge")
def tasks_purge(
    older_than_s: Annotated[
        float,
        typer.Option(min=0, help="Delete tasks that finished more than this many seconds ago."),
    ],
    db: DbOption = DEFAULT_DB,
) -> None:
    """Delete finished tasks (succeeded, failed, cancelled) older than --older-than-s, with
    their results; queued and running tasks, and a batch's lines, are kept."""
    before = time.time() - older_than_s

    def purge_all(store: Store) -> int:
        total = 0
        while n := store.purge(before):  # in chunks: no transaction holds the table for long
            total += n
        return total

    deleted = _with_store(db, purge_all)
    out.print(f"deleted {deleted} finished task(s) older than {older_than_s:g} s")


def load_app(spec: str) -> Queue:
    """`package.module:attribute` naming a `corral.Queue` (the current folder is importable)."""
    from corral.queue import Queue  # the worker and core load only for the commands that run them

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CorralError(f"--app must look like package.module:queue; got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CorralError(f"cannot import {module_name!r} (from --app {spec}): {exc}") from None
    queue = getattr(module, attr, None)
    if not isinstance(queue, Queue):
        found = "nothing" if queue is None else type(queue).__name__
        raise CorralError(f"{spec} must be a corral.Queue; found {found}")
    return queue


def worker_cmd(
    app: Annotated[str, typer.Option(help="The app's queue, as package.module:attribute.")],
    until_idle: Annotated[
        bool,
        typer.Option("--until-idle", help="Exit once nothing of its models is queued or running."),
    ] = False,
    lease_s: Annotated[float, typer.Option(min=0.5, help="Lease length, seconds.")] = 30.0,
    poll_s: Annotated[float, typer.Option(min=0.01, help="Look for work this often.")] = 0.2,
    idle_poll_s: Annotated[
        float,
        typer.Option(min=0.01, help="Poll this often where the store wakes workers (PostgreSQL)."),
    ] = 2.0,
    prefetch: Annotated[
        int,
        typer.Option(
            min=0,
            help="Claim up to this many short tasks ahead, and run up to this many in one run "
            "committed together (0: never ahead).",
        ),
    ] = 128,
    shutdown_timeout_s: Annotated[
        float,
        typer.Option(min=0, help="On SIGTERM, running tasks get this long before they go back."),
    ] = 30.0,
    retention_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="Delete tasks finished more than this many seconds ago (an ended batch's "
            "lines too); 0 keeps them all.",
        ),
    ] = 7 * 86_400.0,
    affinity: Annotated[
        bool,
        typer.Option(
            help="With other workers on the database, load each model on one worker (a second "
            "only for a backlog worth it); --no-affinity: schedule this device alone.",
        ),
    ] = True,
) -> None:
    """Run a worker for an app's queue until SIGTERM/SIGINT."""
    from corral.worker.runtime import WorkerSettings

    try:
        queue = load_app(app)
        settings = WorkerSettings(
            lease_s=lease_s,
            poll_s=poll_s,
            idle_poll_s=idle_poll_s,
            prefetch=prefetch,
            shutdown_timeout_s=shutdown_timeout_s,
            retention_s=retention_s or None,
            affinity=affinity,
        )
        err.print(
            f"corral worker: {app} on {queue.url} "
            f"(models: {', '.join(queue.registry.model_names()) or 'none'})"
        )
        worker = queue.run_worker(until_idle=until_idle, settings=settings)
    except CorralError as exc:
        raise _fail(exc) from None
    if worker.presence.unserved:
        left = ", ".join(f"{m} ({n})" for m, n in worker.presence.unserved.items())
        err.print(
            f"[yellow]warning[/yellow]: tasks left queued for models no running worker serves: "
            f"{left}; run a worker whose app has handlers for them",
            highlight=False,
        )
