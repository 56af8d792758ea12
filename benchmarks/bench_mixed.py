"""Interactive requests beside Batch API batches, live, with the default configuration.

`corral serve` runs the built-in demo (orchestrator-14b, explorer-3b, coder-7b: sim servers that
load in 6, 2 and 4 s) exactly as `make run` does; only the port and the data folder differ. A
person chats through the official `openai` client, one request a second, while batches run
through the Batch API. Each case reports the chat's waits (the gateway's `x-corral-wait-ms`), the
bounds the issue sets (one swap + two service times at p95, two swaps + two service times at
most), any 429, and the batch's throughput. The same cases run under `fifo` in the same run.

Cases: chat to the batch's own model (explorer-3b) or to another model (coder-7b), beside a
2,000- or 20,000-line batch on explorer-3b, and beside a second batch on a third model
(orchestrator-14b). Throughput: the batch alone, and with a chat message every 10 s to its own
model and to another model, over the same window.

Run: `.venv/bin/python benchmarks/bench_mixed.py [--chat-s 60] [--json out.json]`
(`make bench-mixed`). About 20 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import OpenAI
from rich.console import Console
from rich.table import Table

from bench_gateway import CORRAL, free_port
from corral.gateway.servers.demo import DEMO_MODELS

BATCH_MODEL, CHAT_OTHER, THIRD = "explorer-3b", "coder-7b", "orchestrator-14b"
TOKENS = 16  # the sim servers' default answer length, chat and batch alike
UNLOAD_S = 0.5  # the demo's unload estimate


def service_s(model: str) -> float:
    tokens_per_s = DEMO_MODELS[model][1]
    return TOKENS / tokens_per_s


def load_s(model: str) -> float:
    return DEMO_MODELS[model][0]


@contextlib.contextmanager
def gateway(policy: str) -> Iterator[str]:
    """`corral serve` with the built-in demo, on a free port and a data folder of its own."""
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-mixed-"))
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(folder)}
    cmd = [CORRAL, "serve", "--listen", f"127.0.0.1:{port}", "--policy", policy]
    with open(folder / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def submit_batch(client: OpenAI, model: str, lines: int) -> str:
    text = "".join(
        json.dumps(
            {
                "custom_id": f"{model}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"summarise document {i}"}],
                    "max_tokens": TOKENS,
                },
            }
        )
        + "\n"
        for i in range(lines)
    )
    f = client.files.create(file=("batch.jsonl", io.BytesIO(text.encode())), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return b.id


def completed(client: OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


@dataclass
class Chat:
    waits_s: list[float] = field(default_factory=list)
    status: dict[int, int] = field(default_factory=dict)


def chat(client: OpenAI, model: str, every_s: float, for_s: float, timeout_s: float) -> Chat:
    """One chat request every `every_s` for `for_s` (each in its own thread, so a slow answer
    does not delay the next question)."""
    out = Chat()
    lock = threading.Lock()

    def ask(i: int) -> None:
        try:
            raw = client.with_options(timeout=timeout_s).chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=TOKENS,
            )
            with lock:
                out.waits_s.append(float(raw.headers["x-corral-wait-ms"]) / 1000)
                out.status[200] = out.status.get(200, 0) + 1
        except openai.APIStatusError as exc:
            with lock:
                out.status[exc.status_code] = out.status.get(exc.status_code, 0) + 1
        except openai.APITimeoutError:
            with lock:
                out.status[0] = out.status.get(0, 0) + 1  # 0: no answer within timeout_s

    threads = []
    start = time.monotonic()
    for i in range(int(for_s / every_s)):
        delay = start + i * every_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=ask, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return out


def wait_first_line(client: OpenAI, batch_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while completed(client, batch_id) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def chat_case(
    policy: str, chat_model: str, lines: int, third: bool, chat_s: float, timeout_s: float
) -> dict[str, Any]:
    with gateway(policy) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        batch = submit_batch(client, BATCH_MODEL, lines)
        if third:
            submit_batch(client, THIRD, 20)
        wait_first_line(client, batch)
        got = chat(client, chat_model, 1.0, chat_s, timeout_s)
    involved = [BATCH_MODEL, chat_model] + ([THIRD] if third else [])
    swap_s = 0.0 if chat_model == BATCH_MODEL and not third else UNLOAD_S + load_s(chat_model)
    if third:
        swap_s = UNLOAD_S + max(load_s(m) for m in involved if m != BATCH_MODEL)
    svc = max(service_s(m) for m in involved)
    return {
        "policy": policy,
        "chat_to": chat_model,
        "batch_lines": lines,
        "third_model_batch": third,
        "chats": int(chat_s),
        "answered": got.status.get(200, 0),
        "status": {str(k): v for k, v in sorted(got.status.items())},
        "wait_p50_s": statistics.median(got.waits_s) if got.waits_s else float("nan"),
        "wait_p95_s": p(got.waits_s, 0.95),
        "wait_max_s": max(got.waits_s, default=float("nan")),
        "bound_p95_s": (UNLOAD_S + load_s(chat_model) if swap_s else 0) + 2 * svc,
        "bound_max_s": 2 * max(swap_s, UNLOAD_S + load_s(chat_model)) + 2 * svc,
    }


def throughput_case(policy: str, chat_model: str | None, window_s: float) -> dict[str, Any]:
    """Batch lines completed per second over `window_s`, with a chat every 10 s or none."""
    with gateway(policy) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        batch = submit_batch(client, BATCH_MODEL, 20_000)
        wait_first_line(client, batch)
        before, start = completed(client, batch), time.monotonic()
        if chat_model is None:
            time.sleep(window_s)
        else:
            chat(client, chat_model, 10.0, window_s, 120)
        took = time.monotonic() - start
        rate = (completed(client, batch) - before) / took
    return {"policy": policy, "chat_every_10s_to": chat_model, "lines_per_s": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chat-s", type=float, default=60.0, help="seconds of chat per case")
    ap.add_argument("--policy", action="append", help="cost and fifo unless given")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="a chat request gives up")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    policies = args.policy or ["cost", "fifo"]
    console = Console(stderr=True)
    cases = [
        (BATCH_MODEL, 2_000, False),
        (CHAT_OTHER, 2_000, False),
        (BATCH_MODEL, 20_000, False),
        (CHAT_OTHER, 20_000, False),
        (CHAT_OTHER, 2_000, True),
    ]
    chats, rates = [], []
    for policy in policies:
        for chat_model, lines, third in cases:
            if policy == "fifo" and lines > 2_000:
                continue  # under fifo a chat waits for the whole batch: 20,000 lines is 30 min
            console.log(f"{policy}: chat to {chat_model} beside {lines:,} lines, third={third}")
            chats.append(chat_case(policy, chat_model, lines, third, args.chat_s, args.timeout_s))
        for every_10s_to in (None, BATCH_MODEL, CHAT_OTHER):
            console.log(f"{policy}: batch throughput, chat every 10 s to {every_10s_to}")
            rates.append(throughput_case(policy, every_10s_to, args.chat_s))
    for r in rates:
        alone = next(
            x["lines_per_s"]
            for x in rates
            if x["policy"] == r["policy"] and x["chat_every_10s_to"] is None
        )
        r["of_alone"] = r["lines_per_s"] / alone if alone else float("nan")
    result = {
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "chat": chats,
        "throughput": rates,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    out = Console()
    table = Table(title="chat, 1 request/s, beside batches (default configuration, demo models)")
    cols = ("policy", "chat to", "batch", "answered", "status", "p50 s", "p95 s", "bound", "max s")
    for col in (*cols, "bound"):
        table.add_column(col, justify="right")
    for c in chats:
        table.add_row(
            c["policy"],
            c["chat_to"],
            f"{c['batch_lines']:,}" + (" + 20 on a 3rd" if c["third_model_batch"] else ""),
            f"{c['answered']}/{c['chats']}",
            " ".join(f"{k}:{v}" for k, v in c["status"].items()),
            f"{c['wait_p50_s']:.2f}",
            f"{c['wait_p95_s']:.2f}",
            f"{c['bound_p95_s']:.2f}",
            f"{c['wait_max_s']:.2f}",
            f"{c['bound_max_s']:.2f}",
        )
    out.print(table)
    table = Table(title=f"batch throughput over {args.chat_s:g} s, 20,000 lines on {BATCH_MODEL}")
    for col in ("policy", "chat every 10 s to", "lines/s", "of batch alone"):
        table.add_column(col, justify="right")
    for r in rates:
        table.add_row(
            r["policy"],
            r["chat_every_10s_to"] or "(no chat)",
            f"{r['lines_per_s']:.2f}",
            f"{100 * r['of_alone']:.1f}%",
        )
    out.print(table)


if __name__ == "__main__":
    main()
