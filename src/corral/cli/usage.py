"""`corral usage`: who used what on a running `corral serve` (its `GET /api/usage`), as a
table or CSV. With a user's key it shows that user's own use; with an admin's, everyone's."""

from __future__ import annotations

import csv
import datetime as dt
import sys
from typing import Annotated

import typer
from rich.table import Table

from corral.cli.batches import DEFAULT_URL, KeyOption, Refused, UrlOption, _call, _client
from corral.console import err_console, out_console
from corral.console import fail as _fail
from corral.errors import CorralError

COLUMNS = (
    "period_start",
    "principal",
    "model",
    "requests",
    "input_tokens",
    "output_tokens",
    "wait_s",
    "service_s",
    "load_s",
)


def _since(text: str | None) -> float | None:
    """An ISO date or time (UTC unless it says), or a number of hours back (`24h`)."""
    if text is None:
        return None
    if text.endswith("h") and text[:-1].replace(".", "", 1).isdigit():
        return dt.datetime.now(dt.UTC).timestamp() - float(text[:-1]) * 3600
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _fail(
            CorralError(
                f"--since must be an ISO date or time, or hours back like 24h; got {text!r}"
            )
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def usage_cmd(
    by: Annotated[str, typer.Option(help="The period of each row: hour, day or total.")] = "day",
    since: Annotated[
        str | None,
        typer.Option(help="From this ISO date or time (UTC), or hours back like 24h."),
    ] = None,
    principal: Annotated[
        str | None, typer.Option(help="Only this principal's use (an admin's key).")
    ] = None,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="CSV on stdout instead of a table.")
    ] = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Model calls, tokens, waits and device-seconds (service, and the loads their work caused)
    per principal, model and period."""
    params: dict[str, str | float] = {"by": by}
    start = _since(since)
    if start is not None:
        params["since"] = start
    if principal is not None:
        params["principal"] = principal
    try:
        with _client(url, key) as client:
            body = _call(client, "GET", "/api/usage", params=params)
    except Refused as exc:
        raise _fail(CorralError(str(exc))) from None
    rows = body.get("data", [])
    if as_csv:
        w = csv.DictWriter(sys.stdout, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        return
    if not rows:
        err_console.print("no model calls recorded for that period")
        return
    t = Table(title=f"usage by {by}")
    for col in ("period", *COLUMNS[1:]):
        t.add_column(col, justify="left" if col in ("period", "principal", "model") else "right")
    for r in rows:
        start_s = float(r["period_start"])
        period = (
            "total"
            if by == "total"
            else dt.datetime.fromtimestamp(start_s, dt.UTC).strftime(
                "%Y-%m-%d" if by == "day" else "%Y-%m-%d %H:00"
            )
        )
        t.add_row(
            period,
            str(r["principal"]),
            str(r["model"]),
            f"{r['requests']:,}",
            f"{r['input_tokens']:,}",
            f"{r['output_tokens']:,}",
            f"{r['wait_s']:,.1f}",
            f"{r['service_s']:,.1f}",
            f"{r['load_s']:,.1f}",
        )
    out_console.print(t)
