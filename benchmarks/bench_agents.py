"""The agent pattern over real HTTP: swaps under `fifo` and `cost`, quiet and under CPU
load.

An orchestrator, two explorers on one model and a coder run as closed-loop `openai` clients
against three sim servers (0.3 s loads) behind `corral serve`; swaps are read from `/metrics`.
`--burn K` runs K busy-looping processes beside it, the way a loaded CI machine jitters the
clients' think times (the case the linger floor of `Cost.linger_s` is for).

Run: `.venv/bin/python benchmarks/bench_agents.py [--runs 3] [--rounds 12] [--burn 0 --burn 4]`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from bench_gateway import CORRAL, free_port, service

SIM = f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}} --tokens-per-s 1000"
CONFIG = f"""
models:
  orchestrator:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3
  explorer:
    load_s: 0.3
    concurrency: 2
    cmd: {SIM} --load-s 0.3 --parallel 2
  coder:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3
scheduler:
  policy: POLICY
  max_wait_s: 30
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: LOG_DIR
"""
AGENTS = ("orchestrator", "explorer", "explorer", "coder")


def _burn() -> None:
    while True:
        pass


@contextlib.contextmanager
def burners(n: int) -> Iterator[None]:
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def swaps(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "corral_swaps"]
    return sum(s.value for s in family.samples if s.name == "corral_swaps_total")


def run_once(policy: str, rounds: int) -> tuple[float, float]:
    """(swaps, seconds) for one run of the agent pattern under `policy`."""
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-agents-"))
    port = free_port()
    config = CONFIG.replace("POLICY", policy).replace("LISTEN_PORT", str(port))
    (folder / "c.yaml").write_text(config.replace("LOG_DIR", str(folder / "logs")))
    with service([CORRAL, "serve", "--config", str(folder / "c.yaml")], port, "/health", folder):
        url = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answered: list[int] = []

        def agent(model: str) -> None:
            for i in range(rounds):
                client.completions.create(model=model, prompt=f"step {i}", max_tokens=5)
                answered.append(i)

        start = time.monotonic()
        threads = [threading.Thread(target=agent, args=(m,)) for m in AGENTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took_s = time.monotonic() - start
        if len(answered) != rounds * len(AGENTS):
            raise SystemExit(f"{policy}: only {len(answered)} requests answered")
        return swaps(url), took_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12, help="requests per agent")
    ap.add_argument("--burn", type=int, action="append", help="busy processes beside the run")
    ap.add_argument("--policy", action="append", help="fifo and cost unless given")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for burn in args.burn or [0, 4]:
        with burners(burn):
            for policy in args.policy or ["fifo", "cost"]:
                runs = [run_once(policy, args.rounds) for _ in range(args.runs)]
                counts = [s for s, _ in runs]
                rows.append(
                    {
                        "burn": burn,
                        "policy": policy,
                        "swaps": counts,
                        "swaps_median": statistics.median(counts),
                        "seconds_median": statistics.median(s for _, s in runs),
                    }
                )
    if args.json:
        print(json.dumps({"machine": platform.platform(), "rows": rows}, indent=2))
        return
    table = Table(title=f"agent pattern, {args.rounds} requests per agent, {args.runs} runs each")
    for col in ("busy processes", "policy", "swaps per run", "median swaps", "median run s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["burn"]),
            str(r["policy"]),
            ", ".join(f"{s:g}" for s in r["swaps"]),
            f"{r['swaps_median']:g}",
            f"{r['seconds_median']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
