"""`corral submit` and `corral batches`: the Batch API of a running `corral serve`, from the
shell. They speak plain HTTP to `--url` (env CORRAL_URL), like any OpenAI client would."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from corral.console import err_console, fail, out_console

batches_app = typer.Typer(help="List, inspect and cancel batches.", no_args_is_help=True)

UrlOption = Annotated[
    str,
    typer.Option("--url", envvar="CORRAL_URL", help="The server (env CORRAL_URL)."),
]
KeyOption = Annotated[
    str | None,
    typer.Option("--api-key", envvar="CORRAL_API_KEY", help="If the server wants one."),
]
DEFAULT_URL = "http://127.0.0.1:8080"
ENDED = ("completed", "failed", "cancelled", "expired")


class Refused(Exception):
    pass


def _client(url: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600)


def _call(client: httpx.Client, method: str, path: str, **kw: Any) -> dict[str, Any]:
    try:
        r = client.request(method, path, **kw)
    except httpx.TransportError as exc:
        raise Refused(
            f"cannot reach {client.base_url} ({type(exc).__name__}); is `corral serve` running? "
            "(--url or CORRAL_URL)"
        ) from None
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise Refused(f"{method} {path}: {r.status_code}: {message}")
    body: dict[str, Any] = r.json()
    return body


def _fail(exc: Exception) -> typer.Exit:
    return fail(exc, code=1)


def _endpoint_of(path: Path) -> str:
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return str(json.loads(raw).get("url", ""))
                except (ValueError, AttributeError):
                    return ""
    return ""


def submit(
    file: Annotated[Path, typer.Argument(help="The requests: one JSON line each.")],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Run every line on this model.")
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Show progress until it ends; download the results.")
    ] = False,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Where --wait saves the output and error files.")
    ] = Path("."),
    endpoint: Annotated[
        str | None, typer.Option(help="Default: the url of the file's first line.")
    ] = None,
    webhook: Annotated[str | None, typer.Option(help="POSTed to when the batch ends.")] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
) -> None:
    """Upload FILE, create a batch from it and (with --wait) follow it to the end."""
    if not file.is_file():
        raise _fail(Refused(f"no such file: {file}"))
    try:
        first = _endpoint_of(file)
        with _client(url, api_key) as client:
            with file.open("rb") as f:
                uploaded = _call(
                    client,
                    "POST",
                    "/v1/files",
                    files={"file": (file.name, f)},
                    data={"purpose": "batch"},
                )
            body: dict[str, Any] = {
                "input_file_id": uploaded["id"],
                "endpoint": endpoint or first or "/v1/chat/completions",
                "completion_window": "24h",
            }
            if webhook:
                body["webhook_url"] = webhook
            if model:
                body["model"] = model  # a Corral extension: every line runs on it
            batch = _call(client, "POST", "/v1/batches", json=body)
            if batch["status"] == "failed":
                _print_errors(batch)
                raise typer.Exit(1)
            total = batch["request_counts"]["total"]
            err_console.print(f"batch {batch['id']}: {total} requests, {batch['status']}")
            out_console.print(batch["id"])
            if wait:
                batch = _follow(client, batch)
                _download(client, batch, out_dir)
                if batch["status"] != "completed":
                    raise typer.Exit(1)
    except Refused as exc:
        raise _fail(exc) from None


def _follow(client: httpx.Client, batch: dict[str, Any]) -> dict[str, Any]:
    total = batch["request_counts"]["total"]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task(batch["status"], total=total)
        while batch["status"] not in ENDED:
            time.sleep(0.5)
            batch = _call(client, "GET", f"/v1/batches/{batch['id']}")
            counts = batch["request_counts"]
            bar.update(
                task,
                completed=counts["completed"] + counts["failed"],
                description=batch["status"],
            )
    counts = batch["request_counts"]
    err_console.print(
        f"batch {batch['id']} {batch['status']}: {counts['completed']} completed, "
        f"{counts['failed']} failed"
    )
    return batch


def _download(client: httpx.Client, batch: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        file_id = batch.get(key)
        if not file_id:
            continue
        target = out_dir / f"{batch['id']}_{suffix}.jsonl"
        with client.stream("GET", f"/v1/files/{file_id}/content") as r, target.open("wb") as f:
            if r.status_code >= 400:
                raise Refused(f"downloading {file_id}: {r.status_code}")
            for chunk in r.iter_bytes():
                f.write(chunk)
        err_console.print(f"saved {target}")


def _print_errors(batch: dict[str, Any]) -> None:
    errors = (batch.get("errors") or {}).get("data") or []
    err_console.print(f"[red]batch {batch['id']} failed:[/red] {len(errors)} problem(s)")
    for e in errors[:20]:
        err_console.print(f"  {e['code']}: {e['message']}", highlight=False)


def _when(ts: int | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


@batches_app.command("list")
def list_cmd(
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
    url: UrlOption = DEFAULT_URL,
    api_key: KeyOption = None,
) -> None:
    """The newest batches, with their progress."""
    try:
        with _client(url, api_key) as client:
            page = _call(client, "GET", "/v1/batches", params={"limit": limit})
    except Refused as exc:
        raise _fail(exc) from None
    table = Table("id", "status", "done", "failed", "total", "created", "eta")
    for b in page["data"]:
        c = b["request_counts"]
        eta = (b.get("corral") or {}).get("eta_s")
        table.add_row(
            b["id"],
            b["status"],
            str(c["completed"]),
            str(c["failed"]),
            str(c["total"]),
            _when(b["created_at"]),
            f"{eta:.0f} s" if eta is not None else "-",
        )
    out_console.print(table)


@batches_app.command("show")
def show_cmd(batch_id: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None) -> None:
    """One batch, as the API returns it (JSON)."""
    try:
        with _client(url, api_key) as client:
            out_console.print_json(data=_call(client, "GET", f"/v1/batches/{batch_id}"))
    except Refused as exc:
        raise _fail(exc) from None


@batches_app.command("cancel")
def cancel_cmd(batch_id: str, url: UrlOption = DEFAULT_URL, api_key: KeyOption = None) -> None:
    """Cancel a batch: lines not yet run never run; finished ones are kept."""
    try:
        with _client(url, api_key) as client:
            b = _call(client, "POST", f"/v1/batches/{batch_id}/cancel")
    except Refused as exc:
        raise _fail(exc) from None
    err_console.print(f"batch {b['id']}: {b['status']}")
