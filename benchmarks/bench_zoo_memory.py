"""The memory a zoo model takes, four ways, per architecture and context: the models
folder's estimate from the file (what Corral packs by when nothing better is known), the
`llama-fit-params --fit-print on` tool's projection, llama-server's own projection for the very
command Corral runs (printed before it reads a weight), and what the server held once loaded and
asked one question (its breakdown at exit) with its peak RSS.

    .venv/bin/python benchmarks/bench_zoo_memory.py [--size-gb 1] [--json out/bench-zoo-memory.json]

The zoo's files are written once under out/zoo-<size>GB (deterministic; `corral zoo`)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from corral.backends.process import free_port
from corral.config import ModelConfig, PromptCacheConfig
from corral.modelfiles.engine_memory import (
    VERBOSE,
    EngineMemory,
    allocated,
    breakdowns,
    device_bytes,
    fit_params,
    server_projection,
    split_command,
)
from corral.modelfiles.folder import FoundModel, find_llama_server, scan
from corral.modelfiles.gguf import estimate_memory
from corral.prompt_cache.caches import serving
from corral.zoo import ARCHS, make_zoo

MIB = 1 << 20
VARIANTS: list[tuple[str, int, list[str]]] = [
    ("4K", 4096, []),
    ("32K", 32768, []),
    ("32K --parallel 4", 32768, ["--parallel", "4"]),
]


def command(found: FoundModel, server: str, context: int, extra: list[str]) -> str:
    """The command `corral serve --models` runs for `found` at `context` (its prompt caches
    kept, as by default), with `extra` flags."""
    base = replace(found, context=context).command(server)
    cmd = serving(ModelConfig(cmd=base), PromptCacheConfig(), Path(found.info.path).parent).cmd
    assert cmd is not None
    return " ".join([cmd, *extra])


def gpu_bytes(pid: int) -> int | None:
    """What NVML says process `pid` holds on the GPUs (its CUDA context included); None
    without NVML or a GPU (the figure Corral's packing is judged against there)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver: a CPU machine
        return None
    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                total += int(p.usedGpuMemory)
    return total


def loaded(argv: list[str]) -> tuple[EngineMemory | None, EngineMemory | None, int, int | None]:
    """Start the server, ask it one question, stop it: what its load's buffer lines say it
    allocated (what Corral packs by from then on), its breakdown at exit, peak RSS, and what
    NVML says it held on the GPU (None without one)."""
    port = int(argv[argv.index("--port") + 1])
    proc = subprocess.Popen([*argv, *VERBOSE], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    gpu: int | None = None
    try:
        for _ in range(600):
            time.sleep(0.2)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                continue
        body = json.dumps({"prompt": "The memory of a model " * 20, "n_predict": 4}).encode()
        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{port}/completion", body), timeout=600
        ).read()
        peak = psutil.Process(proc.pid).memory_info().rss
        gpu = gpu_bytes(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    lines = err.decode(errors="replace").splitlines()
    found = breakdowns(lines)
    return allocated(lines), (found[-1] if len(found) > 1 else None), peak, gpu


def measure(folder: Path, server: str) -> list[dict[str, Any]]:
    fit = Path(server).with_name("llama-fit-params")
    found, bad = scan(folder, swa_full=True)
    assert not bad, bad
    rows = []
    for m in found:
        for label, context, extra in VARIANTS:
            argv = split_command(command(m, server, context, extra), free_port())
            parallel = int(extra[1]) if extra else 4
            estimate = estimate_memory(m.info, context, parallel=parallel, swa_full=True)
            tool = fit_params(
                fit, ["-m", str(m.info.path), "-c", str(context), "--swa-full", *extra]
            )
            projected = server_projection(argv)
            buffers, held, rss, gpu = loaded(argv)
            row = {
                "arch": m.info.architecture, "variant": label, "context": context,
                "file_mb": round(m.info.path.stat().st_size / MIB),
                "estimate_mib": round(estimate.total_bytes / MIB),
                "fit_params_mib": tool.total_mib if tool else None,
                "projected_mib": projected.total_mib if projected else None,
                "held_mib": held.total_mib if held else None,
                # What Corral packs by: before the first load, after each (`device_bytes`).
                "packed_before_mib": device_bytes(projected) // MIB if projected else None,
                "packed_after_mib": device_bytes(buffers) // MIB if buffers else None,
                "buffers": _parts(buffers),
                "rss_mib": round(rss / MIB),
                "nvml_mib": round(gpu / MIB) if gpu is not None else None,
                "projected": _parts(projected), "held": _parts(held), "fit_params": _parts(tool),
                "command": shlex.join(argv),
            }  # fmt: skip
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _parts(e: EngineMemory | None) -> dict[str, list[int]] | None:
    if e is None:
        return None
    return {k: [d.model_mib, d.context_mib, d.compute_mib] for k, d in e.devices.items()}


def _n(mib: int | None) -> str:
    return f"{mib:,}" if mib is not None else "-"


def _line(r: dict[str, Any]) -> str:
    off = f"{r['estimate_mib'] / r['projected_mib'] - 1:+.0%}" if r["projected_mib"] else "-"
    before, after = r["packed_before_mib"], r["packed_after_mib"]
    moved = f"{after / before - 1:+.1%}" if before and after else "-"
    return (
        f"| {r['arch']} | {r['variant']} | {r['file_mb']:,} | {r['estimate_mib']:,} | "
        f"{_n(r['fit_params_mib'])} | {_n(r['projected_mib'])} | "
        f"{_n(before)} | {_n(after)} | {moved} | "
        f"{_n(r['held_mib'])} | {r['rss_mib']:,} | {_n(r['nvml_mib'])} | {off} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--arch", action="append", help="only these architectures")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = find_llama_server()
    if server is None:
        print("no llama-server: make test installs the `llama` extra", file=sys.stderr)
        return 1
    folder = Path("out") / f"zoo-{args.size_gb:g}GB"
    archs = args.arch or list(ARCHS)
    if not all((folder / f"{a}-{args.size_gb:g}GB.gguf").exists() for a in archs):
        make_zoo(folder, archs, size_gb=args.size_gb)
    print("| arch | variant | file MiB | estimate | llama-fit-params | server's projection | "
          "packed before the first load | packed after (its buffers) | after vs before | "
          "server held at exit | peak RSS | GPU (NVML) | estimate vs projection |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    only = Path("out") / f"zoo-{args.size_gb:g}GB-only"
    only.mkdir(parents=True, exist_ok=True)
    for stale in only.iterdir():
        stale.unlink()
    for a in archs:  # a folder of just the architectures asked for (hard links)
        (only / f"{a}-{args.size_gb:g}GB.gguf").hardlink_to(folder / f"{a}-{args.size_gb:g}GB.gguf")
    rows = measure(only, server)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
