"""A saved conversation restored after a swap, per zoo architecture, on the real
llama-server as Corral starts it (`--slot-save-path`, `--swa-full`): a conversation of about
`--tokens` tokens is answered, its slot saved, the server stopped and started again (a swap),
and the conversation comes back two ways:

- **goes on**: the next turn extends what the slot held (the prompt, the answer as the server
  gave it, a new question), as a chat client's next turn does;
- **diverges**: the same prompt with another ending (a regenerate, an edited last turn), so the
  saved state runs past where the new prompt leaves it.

Each way is timed with the state restored and without it, from the model being ready: the
restore's own time plus the prefill the server still did (its `timings`), against the whole
prefill. `cache_n` says whether the server reused what it restored.

    .venv/bin/python benchmarks/bench_zoo_restores.py [--size-gb 1] [--tokens 4700]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from corral.backends.process import free_port
from corral.modelfiles.folder import find_llama_server
from corral.zoo import ARCHS, file_name, make_zoo


class Server:
    def __init__(self, binary: str, model: Path, states: Path, context: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "-m", str(model), "--port", str(self.port), "--ctx-size", str(context),
             "--parallel", "1", "--slot-save-path", str(states), "--swa-full"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(3000):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{model}: the server did not start")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            out: dict[str, Any] = json.loads(urllib.request.urlopen(req, timeout=3600).read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(exc.read().decode(errors="replace")[:300]) from None
        return out

    def ask(self, prompt: str) -> dict[str, Any]:
        return self.post("/completion", {"prompt": prompt, "n_predict": 1, "id_slot": 0,
                                         "cache_prompt": True, "temperature": 0})  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def conversation(tokens: int) -> str:
    """Text of about `tokens` tokens of the zoo's vocabulary (1.95 characters a token for
    these words and numbers: its merges are letter pairs and their extensions)."""
    words = [
        "the",
        "model",
        "answers",
        "what",
        "the",
        "user",
        "asks",
        "about",
        "swaps",
        "and",
        "caches",
        "and",
        "memory",
    ]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < 1.95 * tokens:
        out.append(words[len(out) % len(words)] + str(len(out) % 97))
    return " ".join(out)


def measure(binary: str, model: Path, tokens: int) -> dict[str, Any]:
    states = Path(tempfile.mkdtemp(prefix="zoo-states-"))
    prompt = conversation(tokens)
    s = Server(binary, model, states, context=4 * tokens)
    try:
        first = s.post("/completion", {"prompt": prompt, "n_predict": 16, "id_slot": 0,
                                       "cache_prompt": True, "temperature": 0})  # fmt: skip
        s.post("/slots/0?action=save", {"filename": "conv.bin"})
    finally:
        s.stop()
    ways = {
        "goes on": prompt + first["content"] + " and the next question is here",
        "diverges": prompt + " but a different ending entirely",
    }
    row: dict[str, Any] = {"arch": model.stem, "prompt_tokens": first["timings"]["prompt_n"]}
    for way, text in ways.items():
        s = Server(binary, model, states, context=4 * tokens)
        try:
            cold = s.ask(text)["timings"]
        finally:
            s.stop()
        s = Server(binary, model, states, context=4 * tokens)
        try:
            restored = s.post("/slots/0?action=restore", {"filename": "conv.bin"})
            warm = s.ask(text)["timings"]
        finally:
            s.stop()
        restore_ms = restored["timings"]["restore_ms"]
        row[way] = {
            "without_ms": round(cold["prompt_ms"], 1),
            "with_ms": round(restore_ms + warm["prompt_ms"], 1),
            "restore_ms": round(restore_ms, 1),
            "restored": restored["n_restored"],
            "cache_n": warm["cache_n"],
            "honoured": 2 * warm["cache_n"] >= restored["n_restored"],
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=None, help="zoo files' size (tiny)")
    parser.add_argument("--tokens", type=int, default=4700)
    parser.add_argument("--arch", action="append")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: make test installs the `llama` extra", file=sys.stderr)
        return 1
    label = "tiny" if args.size_gb is None else f"{args.size_gb:g}GB"
    folder = Path("out") / f"zoo-{label}"
    archs = args.arch or list(ARCHS)
    if not all((folder / file_name(a, args.size_gb)).exists() for a in archs):
        make_zoo(folder, archs, size_gb=args.size_gb)
    print("| arch | prompt | way | without | with (restore) | x | reused of restored | kept |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    rows = []
    for a in archs:
        row = measure(binary, folder / file_name(a, args.size_gb), args.tokens)
        rows.append(row)
        for way in ("goes on", "diverges"):
            w = row[way]
            print(
                f"| {a} | {row['prompt_tokens']:,} | {way} | {w['without_ms'] / 1000:.2f} s | "
                f"{w['with_ms'] / 1000:.2f} s ({w['restore_ms']:.0f} ms) | "
                f"{w['without_ms'] / max(w['with_ms'], 0.1):.1f} | "
                f"{w['cache_n']:,} of {w['restored']:,} | {'yes' if w['honoured'] else 'no'} |",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
