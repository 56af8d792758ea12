"""What relaying a stream costs: Corral against a bare Python proxy and against the server itself.

A fake upstream streams OpenAI chat chunks paced like a GPU: `--streams` concurrent streams
(256), each one token per step, each token one server-sent event, the step set so that all the
streams together offer the asked tokens per second (`--rates`; 0: as fast as it can). A client
process keeps every stream busy (a new request as soon as one ends) and counts what arrives.
Targets, in blocks that take turns within one run:

- `direct`: the upstream itself;
- `bare`: uvicorn + aiohttp passing the bytes through (no scheduler, no accounting): the floor
  of any Python proxy;
- `corral-0`, `corral-1`, `corral-cores`: `corral serve` with the upstream as its model, relaying
  in its scheduler's own process (`--workers 0`), in one relay process (`--workers 1`), and in
  one relay process per core (`--workers` left to its default);
- `before` (with `--before-src DIR`): the same, run from another checkout's `src/` (a commit
  to compare against, in the same run).

Per block: chunks/s at the client, the proxy's CPU per chunk (user + system, its process and
children, from psutil), time to first chunk p50/p99, and the largest gap a stream saw between
two reads. Run: `make bench-relay` or `.venv/bin/python benchmarks/bench_relay.py [--json F]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench_gateway import free_port, wait_ok

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")

_UPSTREAM = r"""
import asyncio, json, sys, time
from aiohttp import web
step_s = float(sys.argv[2])
HEAD = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"')
TAIL = b'"},"finish_reason":null}]}\n\n'
async def chat(request):
    body = await request.json()
    n = int(body.get("max_tokens", 64))
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    start = time.monotonic()
    for i in range(n):
        await resp.write(HEAD + b"tok" + str(i % 10).encode() + TAIL)
        if step_s > 0:
            delay = start + (i + 1) * step_s - time.monotonic()
            await asyncio.sleep(max(delay, 0))
    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
    await resp.write(b'data: {"id":"c","object":"chat.completion.chunk","created":0,'
                     b'"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
                     b'"usage":' + json.dumps(usage).encode() + b"}\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp
async def ok(request):
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
app = web.Application()
app.add_routes([web.post("/v1/chat/completions", chat), web.get("/health", ok),
                web.get("/v1/models", ok)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

_BARE = r"""
import sys, aiohttp, uvicorn
up, port, session = sys.argv[1], int(sys.argv[2]), None
async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while (m := await receive())["type"] == "lifespan.startup":
            session = aiohttp.ClientSession(auto_decompress=False,
                                            connector=aiohttp.TCPConnector(limit=0))
            await send({"type": "lifespan.startup.complete"})
        await session.close()
        return await send({"type": "lifespan.shutdown.complete"})
    body, more = b"", True
    while more:
        m = await receive()
        body, more = body + m.get("body", b""), m.get("more_body", False)
    async with session.request(scope["method"], up + scope["path"], data=body,
                               headers={"content-type": "application/json"}) as r:
        await send({"type": "http.response.start", "status": r.status,
                    "headers": [(b"content-type", r.headers.get("content-type", "").encode())]})
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""

_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
url, model = sys.argv[1], sys.argv[2]
streams, tokens, seconds = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                   "messages": [{"role": "user", "content": "go"}]}).encode()
chunks = 0; reads = 0; ttfc = []; gaps = []; errors = 0; done = 0
async def one(session, stop):
    global chunks, reads, errors, done
    while time.monotonic() < stop:
        t0 = time.monotonic(); first = None; last = None; gap = 0.0
        try:
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                if r.status != 200:
                    errors += 1; await r.read(); await asyncio.sleep(0.05); continue
                async for data in r.content.iter_any():
                    now = time.monotonic()
                    if first is None:
                        first = now; ttfc.append(now - t0)
                    elif now - last > gap:
                        gap = now - last
                    last = now
                    chunks += data.count(b"data: {")
                    reads += 1
            done += 1; gaps.append(gap)
        except aiohttp.ClientError:
            errors += 1
async def main():
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        start = time.monotonic()
        await asyncio.gather(*(one(s, start + seconds) for _ in range(streams)))
        took = time.monotonic() - start
    ttfc.sort(); gaps.sort()
    pick = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None
    print(json.dumps({"chunks": chunks, "reads": reads, "seconds": took, "requests": done,
                      "errors": errors,
                      "ttfc_p50_s": pick(ttfc, 0.5), "ttfc_p99_s": pick(ttfc, 0.99),
                      "gap_max_s": gaps[-1] if gaps else None, "gap_p99_s": pick(gaps, 0.99)}))
asyncio.run(main())
"""

CONFIG = """
models:
  m:
    upstream: UPSTREAM
    concurrency: 1024
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: LOG_DIR
  max_connections: 4096
"""


@contextlib.contextmanager
def process(
    argv: list[str], health: str, env: dict[str, str] | None = None
) -> Iterator[psutil.Process]:
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_ok(health, 120)
        except BaseException:
            err.seek(0)
            said = err.read()[-3000:].decode(errors="replace")
            sys.stderr.write(f"{' '.join(argv)[:300]}:\n{said}\n")  # why it did not come up
            proc.kill()
            raise
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def cpu_s(p: psutil.Process | None) -> float:
    """User + system seconds of a process and its children (the relay processes of a server)."""
    if p is None:
        return 0.0
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = q.cpu_times()
            total += t.user + t.system
    return total


def block(url: str, proxy: psutil.Process | None, args: argparse.Namespace) -> dict[str, Any]:
    before = cpu_s(proxy)
    argv = [sys.executable, "-c", _CLIENT, url, "m", str(args.streams), str(args.tokens),
            str(args.seconds)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, check=True)
    out: dict[str, Any] = json.loads(run.stdout)
    used = cpu_s(proxy) - before
    out["chunks_per_s"] = out["chunks"] / out["seconds"]
    out["events_per_read"] = out["chunks"] / max(out["reads"], 1)
    counted = proxy is not None and out["chunks"]
    out["cpu_us_per_chunk"] = used / out["chunks"] * 1e6 if counted else None
    return out


def run_rate(rate: float, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    step_s = args.streams / rate if rate > 0 else 0.0
    up_port, bare_port, corral_port = free_port(), free_port(), free_port()
    up = f"http://127.0.0.1:{up_port}"
    config = folder / f"corral-{int(rate)}.yaml"
    config.write_text(
        CONFIG.replace("UPSTREAM", up)
        .replace("LISTEN_PORT", str(corral_port))
        .replace("LOG_DIR", str(folder / "logs"))
    )
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in args.targets}
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            process([sys.executable, "-c", _UPSTREAM, str(up_port), str(step_s)], f"{up}/health")
        )
        procs: dict[str, tuple[str, psutil.Process | None]] = {"direct": (up, None)}
        if "bare" in args.targets:
            bare = f"http://127.0.0.1:{bare_port}"
            bp = stack.enter_context(
                process([sys.executable, "-c", _BARE, up, str(bare_port)], f"{bare}/health")
            )
            procs["bare"] = (bare, bp)
        for t in args.targets:
            if not t.startswith("corral-"):
                continue
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            workers = t.removeprefix("corral-")
            argv = [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"]
            if workers != "cores":
                argv += ["--workers", workers]
            # A data and a log folder each: two gateways never share one.
            own = folder / f"{t}-{int(rate)}"
            mine = own.with_suffix(".yaml")
            mine.write_text(config.read_text().replace(str(folder / "logs"), str(own / "logs")))
            argv[3] = str(mine)
            env = {"XDG_DATA_HOME": str(own / "data")}
            procs[t] = (url, stack.enter_context(process(argv, f"{url}/health", env)))
        if "before" in args.targets:
            port = free_port()
            other = folder / f"before-{int(rate)}.yaml"
            text = config.read_text().replace(f":{corral_port}", f":{port}")
            other.write_text(text.replace(str(folder / "logs"), str(folder / "logs-before")))
            url = f"http://127.0.0.1:{port}"
            argv = ["env", f"PYTHONPATH={args.before_src}", sys.executable, "-m", "corral",
                    "serve", "--config", str(other)]  # fmt: skip
            bp2 = stack.enter_context(process(argv, f"{url}/health"))
            procs["before"] = (url, bp2)
        for _ in range(args.rounds):  # blocks take turns, so drift hits every target alike
            for t in args.targets:
                url, p = procs[t]
                results[t].append(block(url, p, args))
    return {"offered_tokens_per_s": rate, "targets": {t: summary(r) for t, r in results.items()}}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    return {
        "chunks_per_s": med("chunks_per_s"),
        "events_per_read": med("events_per_read"),
        "cpu_us_per_chunk": med("cpu_us_per_chunk"),
        "ttfc_p50_ms": (med("ttfc_p50_s") or 0) * 1000,
        "ttfc_p99_ms": (med("ttfc_p99_s") or 0) * 1000,
        "gap_max_ms": max((r["gap_max_s"] or 0) for r in runs) * 1000,
        "errors": sum(r["errors"] for r in runs),
        "blocks": len(runs),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| offered tok/s | target | chunks/s | x direct | events/read | CPU µs/chunk | x bare "
        "| TTFC p50 / p99 ms | largest gap ms | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ts = row["targets"]
        direct = ts.get("direct", {}).get("chunks_per_s")
        bare_cpu = ts.get("bare", {}).get("cpu_us_per_chunk")
        for t, s in ts.items():
            vs_direct = f"{s['chunks_per_s'] / direct:.2f}" if direct else "-"
            cpu = s["cpu_us_per_chunk"]
            vs_bare = f"{cpu / bare_cpu:.2f}" if cpu and bare_cpu else "-"
            rate = int(row["offered_tokens_per_s"]) or "max"
            lines.append(
                f"| {rate} | {t} | {s['chunks_per_s']:,.0f} | {vs_direct} | "
                f"{s['events_per_read']:.2f} | {cpu:.1f} | {vs_bare} | "
                f"{s['ttfc_p50_ms']:.0f} / {s['ttfc_p99_ms']:.0f} | "
                f"{s['gap_max_ms']:.0f} | {s['errors']} |"
                if cpu is not None
                else f"| {rate} | {t} | {s['chunks_per_s']:,.0f} | {vs_direct} | "
                f"{s['events_per_read']:.2f} | - | - | "
                f"{s['ttfc_p50_ms']:.0f} / {s['ttfc_p99_ms']:.0f} | {s['gap_max_ms']:.0f} | "
                f"{s['errors']} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10000,20000,40000,80000,160000,0",
                    help="offered tokens/s of all streams; 0: unpaced")  # fmt: skip
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per answer")
    ap.add_argument("--seconds", type=float, default=8.0, help="per block")
    ap.add_argument("--rounds", type=int, default=2, help="blocks per target per rate")
    ap.add_argument("--targets", default="direct,bare,corral-0,corral-1,corral-cores")
    ap.add_argument("--before-src", type=Path, help="another checkout's src/: target `before`")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.targets = args.targets.split(",")
    if args.before_src is not None and "before" not in args.targets:
        args.targets.append("before")
    folder = Path(tempfile.mkdtemp(prefix="corral-bench-relay-"))
    rows = []
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            rows.append(run_rate(rate, args, folder))
            print(table(rows[-1:]).split("\n", 2)[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; {args.streams} streams, {args.tokens} tokens "
          f"each, {args.rounds} blocks of {args.seconds:g} s per target\n")  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
