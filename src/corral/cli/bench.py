"""`corral bench`: load any OpenAI-compatible URL (a model server, `corral serve`, a peer) at
several concurrencies or rates, and report throughput and latency per point."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from corral.console import err_console, fail, out_console

if TYPE_CHECKING:  # imported when the command runs: the CLI starts without them
    from corral.bench.loadgen import Point, Spec


def _numbers(text: str, kind: type[float] | type[int], what: str) -> list[float] | list[int]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise fail(f"{what} must be a comma-separated list of numbers; got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise fail(f"{what} must list positive numbers; got {text!r}")
    return values


def bench_cmd(
    url: Annotated[str, typer.Argument(help="The server's base URL, e.g. http://127.0.0.1:8080")],
    model: Annotated[
        list[str], typer.Option("--model", "-m", help="Model id; repeat for a mix (used in turn).")
    ],
    endpoint: Annotated[str, typer.Option(help="chat, completions or embeddings.")] = "chat",
    concurrency: Annotated[
        str | None, typer.Option(help="Requests in flight, one point each: 1,2,4,8.")
    ] = None,
    rate: Annotated[
        str | None, typer.Option(help="Poisson arrivals per second instead, one point each: 1,5.")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="Requests per point.")] = 100,
    prompt_words: Annotated[int, typer.Option(min=1, help="Words in each prompt.")] = 32,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens asked for per answer.")] = 64,
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer key.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for results.csv, manifest.json, plots.")] = Path(
        "out/bench"
    ),
    tune: Annotated[
        bool, typer.Option("--tune", help="Print the best point within --p95-ms as config.")
    ] = False,
    p95_ms: Annotated[
        float | None, typer.Option(help="The end-to-end p95 target for --tune.")
    ] = None,
) -> None:
    """Load an OpenAI-compatible server and measure requests/s, output tokens/s, time to first
    token, inter-token latency and end-to-end latency (p50/p95/p99) per load point."""
    from corral.bench.loadgen import PATHS, Spec
    from corral.bench.loadgen import tune as best
    from corral.bench.report import write_csv, write_manifest, write_plots

    if endpoint not in PATHS:
        raise fail(f"--endpoint must be chat, completions or embeddings; got {endpoint!r}")
    if concurrency is not None and rate is not None:
        raise fail("give --concurrency or --rate, not both")
    if concurrency is None and rate is None:
        concurrency = "1"
    if tune and p95_ms is None:
        raise fail("--tune needs --p95-ms, the latency target")
    levels = (
        [("c", v) for v in _numbers(concurrency, int, "--concurrency")]
        if concurrency is not None
        else [("r", v) for v in _numbers(rate or "", float, "--rate")]
    )
    spec = Spec(url, endpoint, model, requests, prompt_words, max_tokens, api_key)  # type: ignore[arg-type]
    points = _run(spec, levels, requests)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(points, out / "results.csv")
    write_manifest(spec, points, out / "manifest.json", ["corral", *sys.argv[1:]])
    plots = write_plots(points, out)
    out_console.print(_table(points, f"{endpoint} on {url} ({', '.join(model)})"))
    err_console.print(
        f"wrote {out / 'results.csv'}, {out / 'manifest.json'}, "
        + ", ".join(str(p) for p in plots),
        highlight=False,
    )
    if tune:
        assert p95_ms is not None
        chosen = best(points, p95_ms)
        if chosen is None:
            raise fail(f"no point kept its end-to-end p95 within {p95_ms:g} ms without errors")
        row = chosen.summary()
        out_console.print(
            f"best within p95 {p95_ms:g} ms: {row['label']} at {row['requests_per_s']:.2f} req/s "
            f"(p95 {row['e2e_p95_ms']} ms)"
        )
        if chosen.concurrency is not None:
            snippet = "\n".join(f"  {m}:\n    concurrency: {chosen.concurrency}" for m in model)
            out_console.print(f"models:\n{snippet}", highlight=False)


def _run(spec: Spec, levels: list[tuple[str, float]], requests: int) -> list[Point]:
    """Each load point in turn, with a progress bar each."""
    from corral.bench.loadgen import run_point

    points: list[Point] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console, transient=False) as progress:
        for kind, value in levels:
            label = f"concurrency {value}" if kind == "c" else f"rate {value:g}/s"
            task = progress.add_task(label, total=requests)

            def step(task_id: TaskID = task) -> None:
                progress.advance(task_id)

            point = asyncio.run(
                run_point(
                    spec,
                    concurrency=int(value) if kind == "c" else None,
                    rate=float(value) if kind == "r" else None,
                    progress=step,
                )
            )
            points.append(point)
    return points


def _table(points: list[Point], title: str) -> Table:
    """The load points' figures as a table."""
    table = Table(title=title, title_justify="left")
    cols = ["point", "req/s", "tok/s", "ttft p50", "ttft p95", "itl p50", "e2e p50", "e2e p95",
            "e2e p99", "errors"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "point" else "right")
    for p in points:
        r = p.summary()

        def ms(key: str, row: dict[str, object] = r) -> str:
            v = row[key]
            return "-" if v is None else f"{v:.1f}"

        table.add_row(
            r["label"],
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            ms("ttft_p50_ms"),
            ms("ttft_p95_ms"),
            ms("itl_p50_ms"),
            ms("e2e_p50_ms"),
            ms("e2e_p95_ms"),
            ms("e2e_p99_ms"),
            str(r["errors"]),
        )
    return table
