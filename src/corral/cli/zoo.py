"""`corral zoo DIR`: the model zoo's GGUF files written on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corral.console import err_console, fail, out_console


def zoo_cmd(
    folder: Annotated[Path, typer.Argument(help="Where to write the files (created if missing).")],
    arch: Annotated[
        list[str] | None,
        typer.Option("--arch", help="An architecture to write (repeat it); all of them if none."),
    ] = None,
    size_gb: Annotated[
        float | None,
        typer.Option(
            "--size-gb", help="Each file's size in GB (0.05-200); tiny (a few MB) if unset."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="The weights' seed: the same seed, the same file.")] = 0,
    quant: Annotated[str, typer.Option(help="The matrices' type: q4_0, q8_0 or f16.")] = "q4_0",
) -> None:
    """Write GGUF files of the architectures people run (dense qwen3, MoE qwen3moe and gpt-oss,
    sliding-window gemma3, MLA deepseek2, hybrid qwen35/qwen35moe and granitehybrid) with random
    weights, a working tokenizer and a chat template: served by llama-server like any model,
    answering noise at a real model's memory, load and prefill cost. Nothing is downloaded."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

    from corral.zoo import ARCHS, QUANTS, make

    names = arch or list(ARCHS)
    unknown = [a for a in names if a not in ARCHS]
    if unknown:
        raise fail(f"no zoo architecture {', '.join(unknown)}; there are: {', '.join(ARCHS)}")
    if quant not in QUANTS:
        raise fail(f"--quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    if size_gb is not None and not 0.05 <= size_gb <= 200:
        raise fail(f"--size-gb must be within 0.05..200, not {size_gb:g}")
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        for name in names:
            task = bar.add_task(name, total=None)

            def step(done: int, total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done, total=total)

            made = make(name, folder, size_gb=size_gb, seed=seed, quant=quant, progress=step)
            d = made.dims
            out_console.print(
                f"{made.path}  {ARCHS[name].kind}: {made.parameters / 1e6:,.0f}M parameters, "
                f"{made.weights_bytes / 1e9:.3g} GB, {d.layers} layers of {d.embd}",
                highlight=False,
            )
