"""The gateway's own cost: what it adds to a request, its throughput, and what a swap costs on top
of the backend's own start.

- Swap overhead: alternate requests between two sim models so each one swaps. The sim server
  reports when it became ready, so "ready -> first byte at the client" is the gateway's share
  alone (its readiness polling, the proxy, the scheduler).
- Added latency: the same 1-token request straight to the resident model's server and through
  the gateway, one at a time, targets taking turns in blocks; p50/p99 of each and the
  difference.
- The floor: a bare uvicorn + aiohttp pass-through (no scheduler, no routing by model) in the
  same runs, so what Corral adds beyond what any Python proxy pays is visible.
- Throughput: 32 concurrent clients for a few seconds, straight to the server and through the
  gateway.
- Front doors: the same one-token chat through OpenAI's routes and Ollama's (plain and
  streamed, and Ollama's generate), taking turns in blocks.

Run: `make bench-gateway` (LiteLLM's proxy side by side, from .venv-bench), or
`.venv/bin/python benchmarks/bench_gateway.py [--swaps 10] [--requests 500]` (Corral only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
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

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
SIM = f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}} --tokens-per-s 1000"
CONFIG = f"""
models:
  one:
    load_s: 1
    concurrency: 64
    cmd: {SIM} --load-s 1 --parallel 64 --max-tokens 1
  two:
    load_s: 1
    concurrency: 64
    cmd: {SIM} --load-s 1 --parallel 64 --max-tokens 1
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: LOG_DIR
"""
BODY = {"prompt": "x", "max_tokens": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gateway() -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-gw-"))
    port = free_port()
    (folder / "c.yaml").write_text(
        CONFIG.replace("LISTEN_PORT", str(port)).replace("LOG_DIR", str(folder / "logs"))
    )
    with service([CORRAL, "serve", "--config", str(folder / "c.yaml")], port, "/health", folder):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def service(
    argv: list[str], port: int, health: str, folder: Path, env: dict[str, str] | None = None
) -> Iterator[None]:
    """Run a server process until the block ends; wait for `health` to answer 200 first."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ok(f"http://127.0.0.1:{port}{health}", 120)
        yield
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def wait_ok(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url).status_code == 200:
                return
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up within {timeout_s:g} s")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def swap_overhead(url: str, swaps: int) -> dict[str, Any]:
    ready_to_byte, total, own_start, unload = [], [], [], []
    with httpx.Client(timeout=60) as client:
        for i in range(swaps + 1):
            model = ("one", "two")[i % 2]
            sent = time.time()
            with client.stream(
                "POST", f"{url}/v1/completions", json={**BODY, "model": model, "stream": True}
            ) as r:
                first = None
                for _ in r.iter_raw():
                    first = first or time.time()
            assert first is not None
            health = client.get(f"{url}/upstream/{model}/health").json()
            swap = client.get(f"{url}/api/status").json()["recent_swaps"][-1]
            if i == 0:
                continue  # the first load evicts nothing; keep the steady alternation only
            token_s = 1 / 1000
            ready_to_byte.append(first - health["ready_at"] - token_s)
            total.append(first - sent)
            own_start.append(health["ready_at"] - swap["started_at"] - (swap["unload_s"] or 0))
            unload.append(swap["unload_s"] or 0.0)
    return {
        "ready_to_first_byte_ms_p50": 1000 * statistics.median(ready_to_byte),
        "ready_to_first_byte_ms_max": 1000 * max(ready_to_byte),
        "swap_total_s_p50": statistics.median(total),
        "backend_own_start_s_p50": statistics.median(own_start),
        "unload_s_p50": statistics.median(unload),
        "swaps": swaps,
    }


def resident(url: str) -> str:
    """Load model `one` through the gateway; returns its server's own URL."""
    with httpx.Client(timeout=60) as client:
        client.post(f"{url}/v1/completions", json={**BODY, "model": "one"})
        proxy: str = client.get(f"{url}/api/status").json()["models"]["one"]["proxy"]
        return proxy


def percentiles_ms(out: dict[str, list[float]]) -> dict[str, Any]:
    """`{name}_ms_p50` and `{name}_ms_p99` of each list of seconds."""
    res: dict[str, Any] = {}
    for name, xs in out.items():
        res[f"{name}_ms_p50"] = 1000 * pct(xs, 50)
        res[f"{name}_ms_p99"] = 1000 * pct(xs, 99)
    return res


def added_latency(targets: dict[str, str], n: int, block: int = 50) -> dict[str, Any]:
    """p50/p99 of one request at a time to each target, and what each adds over `direct`.

    Targets take turns in blocks of `block` requests, so drift hits all alike, with a pause
    between blocks: work a proxy does after answering (LiteLLM logs and tracks spend in the
    background) would otherwise land on the next target's requests."""
    out: dict[str, list[float]] = {name: [] for name in targets}
    with httpx.Client(timeout=60) as client:
        for _ in range(max(1, n // block)):
            for name, base in targets.items():
                time.sleep(0.3)
                for _ in range(block):
                    t = time.perf_counter()
                    r = client.post(f"{base}/v1/completions", json={**BODY, "model": "one"})
                    out[name].append(time.perf_counter() - t)
                    assert r.status_code == 200, (name, r.text)
    res = percentiles_ms(out)
    for name in targets:
        if name != "direct":
            res[f"{name}_added_ms_p50"] = res[f"{name}_ms_p50"] - res["direct_ms_p50"]
            res[f"{name}_added_ms_p99"] = res[f"{name}_ms_p99"] - res["direct_ms_p99"]
    return res


# The same one-token chat through each of the gateway's front doors: OpenAI's
# routes pass the answer through; Ollama's rewrite the request and translate the answer.
_MESSAGES = [{"role": "user", "content": "x"}]
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai_chat": ("/v1/chat/completions", {"messages": _MESSAGES, "max_tokens": 1}),
    "ollama_chat": (
        "/api/chat",
        {"messages": _MESSAGES, "stream": False, "options": {"num_predict": 1}},
    ),
    "openai_chat_stream": (
        "/v1/chat/completions",
        {"messages": _MESSAGES, "max_tokens": 1, "stream": True},
    ),
    "ollama_chat_stream": ("/api/chat", {"messages": _MESSAGES, "options": {"num_predict": 1}}),
    "ollama_generate": (
        "/api/generate",
        {"prompt": "x", "stream": False, "options": {"num_predict": 1}},
    ),
}


def routes_latency(url: str, n: int, block: int = 50) -> dict[str, Any]:
    """p50/p99 of one request at a time through each front door (whole answer read), routes
    taking turns in blocks; and what Ollama's add over OpenAI's of the same kind."""
    out: dict[str, list[float]] = {name: [] for name in ROUTES}
    with httpx.Client(timeout=60) as client:
        for _ in range(max(1, n // block)):
            for name, (path, body) in ROUTES.items():
                for _ in range(block):
                    t = time.perf_counter()
                    r = client.post(f"{url}{path}", json={**body, "model": "one"})
                    out[name].append(time.perf_counter() - t)
                    assert r.status_code == 200, (name, r.text)
    res = percentiles_ms(out)
    for ollama, openai in (
        ("ollama_chat", "openai_chat"),
        ("ollama_chat_stream", "openai_chat_stream"),
    ):
        res[f"{ollama}_over_openai_ms_p50"] = res[f"{ollama}_ms_p50"] - res[f"{openai}_ms_p50"]
    return res


# The floor for a Python proxy: uvicorn and aiohttp passing the request through, nothing else (no
# routing by model, no scheduler, no metrics). What Corral adds beyond this is its own work.
_BARE = """
import sys, aiohttp, uvicorn
up, port, session = sys.argv[1], int(sys.argv[2]), None
async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while (m := await receive())["type"] == "lifespan.startup":
            session = aiohttp.ClientSession(auto_decompress=False)
            await send({"type": "lifespan.startup.complete"})
        await session.close()
        return await send({"type": "lifespan.shutdown.complete"})
    body, more = b"", True
    while more:
        m = await receive()
        body, more = body + m.get("body", b""), m.get("more_body", False)
    async with session.request(scope["method"], up + scope["path"], data=body,
                               headers={"content-type": "application/json"}) as r:
        data = await r.read()
    await send({"type": "http.response.start", "status": r.status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


@contextlib.contextmanager
def bare_proxy(direct_url: str) -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-bare-"))
    port = free_port()
    with service([sys.executable, "-c", _BARE, direct_url, str(port)], port, "/health", folder):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def litellm_proxy(direct_url: str) -> Iterator[str | None]:
    """LiteLLM's proxy in front of the same server, if `litellm` is installed next to Python."""
    exe = Path(sys.executable).parent / "litellm"
    if not exe.exists():
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-litellm-"))
    port = free_port()
    (folder / "litellm.yaml").write_text(
        "model_list:\n  - model_name: one\n    litellm_params:\n      model: openai/one\n"
        f"      api_base: {direct_url}/v1\n      api_key: unused\n"
    )
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download at start
        "LITELLM_LOG": "ERROR",
        # no key, like Corral here: local benchmark only
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    argv = [str(exe), "--config", str(folder / "litellm.yaml"), "--port", str(port)]
    with service(argv, port, "/health/liveliness", folder, env):
        yield f"http://127.0.0.1:{port}"


async def _hammer(base: str, seconds: float, clients: int) -> float:
    done = 0
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as c:

        async def one() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                r = await c.post(f"{base}/v1/completions", json={**BODY, "model": "one"})
                if r.status_code == 200:
                    done += 1

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(clients)))
        return done / (time.perf_counter() - t)


def throughput(targets: dict[str, str], seconds: float, clients: int) -> dict[str, float]:
    return {
        f"{name}_rps": asyncio.run(_hammer(base, seconds, clients))
        for name, base in targets.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=32)
    args = ap.parse_args()
    with gateway() as url:
        swap = swap_overhead(url, args.swaps)
        direct = resident(url)
        with litellm_proxy(direct) as litellm, bare_proxy(direct) as bare:
            targets = {"direct": direct, "bare": bare, "corral": url}
            if litellm is not None:
                targets["litellm"] = litellm
            lat = added_latency(targets, args.requests)
            routes = routes_latency(url, args.requests)
            tput = throughput(targets, args.seconds, args.clients)
    print(f"{platform.node()}, {os.cpu_count()} CPUs")
    print(
        json.dumps({"swap": swap, "latency": lat, "routes": routes, "throughput": tput}, indent=2)
    )


if __name__ == "__main__":
    main()
