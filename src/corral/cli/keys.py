"""`corral keys`: the principals' keys `corral serve` checks, kept (as digests) in the data
directory's `keys.json`; a running `corral serve` on the same directory reads them again within
a second of a change."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from corral.console import err_console, out_console
from corral.console import fail as _fail
from corral.errors import CorralError

if TYPE_CHECKING:
    from corral.access.keyfile import KeyBook, KeyFile

keys_app = typer.Typer(
    help="Create, list and revoke the keys of the principals (people, teams, apps) who may "
    "call `corral serve`.",
    no_args_is_help=True,
)

DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="The folder `corral serve` keeps its data in (server.data_dir; default: "
        "$XDG_DATA_HOME/corral or ~/.local/share/corral).",
    ),
]


def _file(folder: Path | None) -> KeyFile:
    from corral.access.keyfile import KeyFile
    from corral.config import data_dir

    return KeyFile(folder if folder is not None else data_dir())


@keys_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="The principal: a person, a team or an app.")],
    role: Annotated[
        str | None,
        typer.Option(
            help="admin (every route) or user (not the admin routes: loading, unloading, "
            "logs). Default: the principal's role if it has keys already, else user."
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            help="A model NAME may use (a name or a glob like 'qwen*'; repeat for more). "
            "Replaces the ones it had; without any, every model.",
        ),
    ] = None,
    requests_per_minute: Annotated[
        int | None, typer.Option(min=1, help="NAME's model calls started per minute.")
    ] = None,
    in_flight: Annotated[
        int | None, typer.Option(min=1, help="NAME's model calls at once (waiting or answered).")
    ] = None,
    queued: Annotated[
        int | None, typer.Option(min=1, help="NAME's model calls waiting for a model at once.")
    ] = None,
    tokens_per_minute: Annotated[
        int | None,
        typer.Option(min=1, help="NAME's model tokens (input and output) per minute."),
    ] = None,
    weight: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            max=1000,
            help="NAME's share of the devices against other principals' while several wait "
            "(default 1).",
        ),
    ] = None,
    highest_class: Annotated[
        str | None,
        typer.Option(
            help="The highest service class NAME may ask for: interactive (default) or batch "
            "(its calls run as background work)."
        ),
    ] = None,
    folder: DataDir = None,
) -> None:
    """Make a new key for NAME and print it as the last line (it is shown once; Corral keeps
    only its digest). Limits given replace the ones NAME had; over one, a call gets 429."""
    from corral.access.limits import Limits
    from corral.access.principals import CLASSES, ROLES

    if role is not None and role not in ROLES:
        raise _fail(CorralError(f"--role must be admin or user; got {role!r}"))
    if highest_class is not None and highest_class not in CLASSES:
        raise _fail(
            CorralError(f"--highest-class must be interactive or batch; got {highest_class!r}")
        )
    file = _file(folder)
    try:
        given = (requests_per_minute, in_flight, queued, tokens_per_minute)
        limits = Limits(*given) if any(x is not None for x in given) else None
        key, entry, who = file.create(name, role, model, limits, weight, highest_class)
    except (CorralError, ValueError) as exc:
        raise _fail(exc) from None
    err_console.print(
        f"created {entry.id} for {escape(name)} ({who.role}; models: "
        f"{escape(', '.join(who.models) or 'all')}) in {escape(str(file.path))}; "
        "a `corral serve` on that data directory accepts it within a second. The key:",
        highlight=False,
    )
    print(key)


@keys_app.command("list")
def list_(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    revoked: Annotated[bool, typer.Option("--revoked", help="Revoked keys too.")] = False,
    folder: DataDir = None,
) -> None:
    """The keys in the data directory (their ids, never the keys) and their principals."""
    file = _file(folder)
    try:
        book = file.read()
    except CorralError as exc:
        raise _fail(exc) from None
    for problem in book.problems:
        err_console.print(f"[yellow]warning[/yellow]: {escape(problem)}", highlight=False)
    shown = [k for k in book.keys if revoked or k.revoked_at is None]
    if as_json:
        for k in shown:
            print(
                json.dumps(
                    {
                        "id": k.id,
                        "principal": k.principal,
                        "role": _role(book, k.principal),
                        "models": list(_models(book, k.principal)),
                        "limits": _limits(book, k.principal),
                        "created_at": k.created_at,
                        "revoked_at": k.revoked_at,
                    }
                )
            )
        return
    table = Table(
        "id", "principal", "role", "models", "limits", "created",
        *(["revoked"] if revoked else []),
    )  # fmt: skip
    for k in shown:
        models = ", ".join(_models(book, k.principal)) or "all"
        limits = ", ".join(f"{n} {v}" for n, v in _limits(book, k.principal).items()) or "none"
        role = _role(book, k.principal) or "?"
        row = [k.id, k.principal, role, models, limits, _when(k.created_at)]
        table.add_row(*map(escape, row), *([_when(k.revoked_at)] if revoked else []))
    out_console.print(table)
    if not shown:
        err_console.print(f"no keys in {escape(str(file.path))} (corral keys create NAME)")


@keys_app.command("revoke")
def revoke(
    ref: Annotated[str, typer.Argument(help="A key's id (key_...), or a principal: all its keys.")],
    folder: DataDir = None,
) -> None:
    """Revoke a key, or every key of a principal; a running `corral serve` refuses it within a
    second."""
    file = _file(folder)
    try:
        done = file.revoke(ref)
    except CorralError as exc:
        raise _fail(exc) from None
    for k in done:
        err_console.print(f"revoked {k.id} ({escape(k.principal)})", highlight=False)


def _role(book: KeyBook, name: str) -> str | None:
    who = book.principals.get(name)
    return who.role if who is not None else None


def _models(book: KeyBook, name: str) -> tuple[str, ...]:
    who = book.principals.get(name)
    return who.models if who is not None else ()


def _limits(book: KeyBook, name: str) -> dict[str, int]:
    who = book.principals.get(name)
    if who is None:
        return {}
    return {k: v for k, v in dataclasses.asdict(who.limits).items() if v is not None}


def _when(t: float | None) -> str:
    return "" if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
