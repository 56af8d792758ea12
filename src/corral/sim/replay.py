"""`corral replay`: a trace sent live through `corral serve`, to hold the simulator to account.

The configuration's models become sim backends (`corral sim-backend`, real processes behind the
real gateway) whose load, unload and service times are the configuration's and the trace's,
divided by `speed`; every other time in the configuration (wait bounds, debounces, ttls, the cost
policy's aging) is divided the same way. Interactive lines are sent as `/v1/completions` requests
at their time (open loop) or a think time after their session's last answer (closed loop); batch
lines (`"class": "batch"`) go through the Batch API, one batch per arrival time. Times measured
live are multiplied back by `speed`, so the figures are in the trace's seconds and compare
directly with `corral simulate` (`summarize` makes both).

Where a request waited comes from the gateway's `x-corral-wait-ms` header (interactive) and the
task store's start marks (batch lines); loads and swap times, per device, from the gateway's event
stream. Busy time is counted per device (`x-corral-device`; a batch line, which names none, on
its model's), so the busy and swap fractions read as the simulator's with several devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from corral.config import Config
from corral.sim.engine import Run, Segment, SimRequest
from corral.sim.metrics import summarize
from corral.sim.replay_setup import (
    STARTUP_FLOOR_S,
    TOKENS_PER_S,
    ReplayError,
    auth_headers,
    check_replayable,
    live_config,
    too_fast,
)
from corral.sim.trace import Trace, TraceLine

__all__ = ["STARTUP_FLOOR_S", "ReplayError", "replay", "too_fast"]

_HEALTH_TIMEOUT_S = 60.0


@dataclass
class _Timing:
    arrived: float | None = None  # epoch seconds
    dispatched: float | None = None
    finished: float | None = None
    error: str | None = None
    device: str | None = None  # the device that served it (x-corral-device), where told
    engine: dict[str, float] | None = None  # a real server's own `timings` of its answer


@dataclass(frozen=True)
class _Swap:
    """A load's start or end on the gateway's event stream."""

    at: float  # epoch seconds
    model: str
    device: str | None
    load_s: float | None = None  # at the end of a cold load that succeeded: as measured live
    unload_s: float | None = None  # at its end: the stop of the one model it evicted, if one
    evicted: str | None = None
    file_cached: float | None = None  # at its end: its file's fraction cached as it began


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(x: TraceLine) -> str:
    """A line's prompt: a conversation's (`context_tokens` words, each step's beginning the
    last step's prompt of the same session and model, as a conversation grows), else a few
    words."""
    if not x.context_tokens or x.session is None:
        return f"line {x.line}"
    head = f"{x.session}/{x.model}"
    return " ".join([head, *(f"w{i}" for i in range(x.context_tokens - 1))])


def _tokens(x: TraceLine, speed: float) -> int:
    return max(1, round(x.service_s / speed * TOKENS_PER_S))


@contextlib.contextmanager
def _server(config_path: Path, port: int, folder: Path) -> Iterator[str]:
    log = open(folder / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "serve", "--config", str(config_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = (folder / "serve.log").read_text(errors="replace")[-2000:]
                raise ReplayError(f"corral serve exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ReplayError(f"corral serve did not answer on {url} in {_HEALTH_TIMEOUT_S} s")
            time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


class _Events:
    """The gateway's event stream, read in a thread: swap start and end times per model and
    device."""

    def __init__(self, url: str) -> None:
        self.started: list[_Swap] = []
        self.loaded: list[_Swap] = []
        self._evicts: dict[tuple[str, str | None], list[str]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _read(self, url: str) -> None:
        with (
            httpx.Client(timeout=None) as client,
            client.stream("GET", f"{url}/api/events", headers=auth_headers(None)) as resp,
        ):
            self._ready.set()
            for line in resp.iter_lines():
                if self._stop.is_set():
                    return
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                kind = event.get("event")
                if kind in ("load_started", "loaded", "load_failed", "load_aborted"):
                    self._heard(kind, event)

    def _heard(self, kind: str, event: dict[str, Any]) -> None:
        key = (event["model"], event.get("device"))
        if kind == "load_started":
            self._evicts[key] = list(event.get("evict") or [])
            self.started.append(_Swap(event["at"], event["model"], event.get("device")))
            return
        evicted = self._evicts.pop(key, [])
        cold = kind == "loaded" and not event.get("woke")
        one = len(evicted) == 1 and kind == "loaded"
        self.loaded.append(
            _Swap(
                event["at"],
                event["model"],
                event.get("device"),
                event.get("load_s") if cold else None,
                event.get("unload_s") if one else None,
                evicted[0] if one else None,
                event.get("file_cached") if cold else None,
            )
        )

    def close(self) -> None:
        self._stop.set()


_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=1000)


async def _drive(
    url: str,
    trace: Trace,
    speed: float,
    t0: float,
    timings: dict[int, _Timing],
    answer_tokens: int | None = None,
) -> list[str]:
    """Send every line at its time; returns the ids of the batches created. `answer_tokens`:
    real servers answer that many tokens a line (their end of text ignored), whatever the
    line's `service_s`, and their own `timings` are kept."""
    batches: list[str] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=None, limits=_LIMITS, headers=auth_headers(None)
    ) as client:

        async def at(t: float) -> None:
            delay = t0 + t / speed - time.time()
            if delay > 0:
                await asyncio.sleep(delay)

        async def send(x: TraceLine) -> None:
            tm = timings[x.line]
            tm.arrived = time.time()
            try:
                r = await client.post(
                    "/v1/completions",
                    json=_body(x, speed, answer_tokens),
                    headers=auth_headers(x.principal),
                )
            except httpx.HTTPError as exc:
                tm.error = f"{type(exc).__name__}: {exc}"
                return
            tm.finished = time.time()
            if r.status_code != 200:
                tm.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            tm.dispatched = tm.arrived + float(r.headers["x-corral-wait-ms"]) / 1000
            tm.device = r.headers.get("x-corral-device")
            if answer_tokens is not None:
                tm.engine = _engine_timings(r)

        async def open_line(x: TraceLine) -> None:
            await at(x.t or 0.0)
            await send(x)

        async def session(lines: list[TraceLine]) -> None:
            await at(lines[0].t or 0.0)
            for i, x in enumerate(lines):
                if i and x.think_s:
                    await asyncio.sleep(x.think_s / speed)
                await send(x)

        async def batch(t: float, lines: list[TraceLine]) -> None:
            await at(t)
            text = _batch_file(lines, speed)
            for x in lines:
                timings[x.line].arrived = time.time()
            batches.append(await _post_batch(client, text))

        jobs = []
        sessions: dict[str, list[TraceLine]] = defaultdict(list)
        batch_at: dict[float, list[TraceLine]] = defaultdict(list)
        for x in trace.lines:
            timings[x.line] = _Timing()
            if x.background:
                batch_at[x.t or 0.0].append(x)
            elif x.session is not None:
                sessions[x.session].append(x)
            else:
                jobs.append(open_line(x))
        jobs += [session(lines) for lines in sessions.values()]
        jobs += [batch(t, lines) for t, lines in batch_at.items()]
        await asyncio.gather(*jobs)
        await _ended(client, batches)
    return batches


def _body(x: TraceLine, speed: float, answer_tokens: int | None) -> dict[str, Any]:
    """The `/v1/completions` body for a line; with `answer_tokens`, llama-server's own fields
    make a real server answer exactly that many tokens, the same every run."""
    body: dict[str, Any] = {
        "model": x.model,
        "prompt": _prompt(x),
        "max_tokens": _tokens(x, speed),
        "priority": x.priority,
    }
    if answer_tokens is not None:
        body |= {"max_tokens": answer_tokens, "ignore_eos": True, "temperature": 0}
    return body


async def _post_batch(client: httpx.AsyncClient, text: str) -> str:
    """Upload a batch input file and create its batch through the Batch API; the batch's id."""
    f = await client.post(
        "/v1/files", files={"file": ("replay.jsonl", text)}, data={"purpose": "batch"}
    )
    f.raise_for_status()
    b = await client.post(
        "/v1/batches",
        json={
            "input_file_id": f.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    )
    b.raise_for_status()
    return str(b.json()["id"])


def _engine_timings(r: httpx.Response) -> dict[str, float] | None:
    """llama-server's `timings` of an answer (prompt_n, cache_n, prompt_ms, predicted_ms, ...):
    its numbers only, or None where it gave none."""
    try:
        got = r.json().get("timings")
    except ValueError:
        return None
    if not isinstance(got, dict):
        return None
    return {k: float(v) for k, v in got.items() if isinstance(v, int | float)}


def _batch_file(lines: list[TraceLine], speed: float) -> str:
    """The Batch API input file (JSONL) of a trace's batch lines."""
    return "".join(
        json.dumps(
            {
                "custom_id": f"line-{x.line}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": x.model,
                    "prompt": f"line {x.line}",
                    "max_tokens": _tokens(x, speed),
                },
            }
        )
        + "\n"
        for x in lines
    )


async def _ended(client: httpx.AsyncClient, batches: list[str]) -> None:
    """Returns once every batch of `batches` has ended."""
    while batches:
        states = [(await client.get(f"/v1/batches/{b}")).json()["status"] for b in batches]
        if all(s in ("completed", "failed", "expired", "cancelled") for s in states):
            return
        await asyncio.sleep(0.1)


def _batch_timings(folder: Path, batches: list[str], timings: dict[int, _Timing]) -> None:
    from corral.store import open_store

    store = open_store(f"sqlite:///{folder / 'corral.db'}")
    try:
        for b in batches:
            for task in store.batches.tasks(b, limit=10_000_000):
                line = int(task.payload["custom_id"].split("-", 1)[1])
                tm = timings[line]
                tm.dispatched, tm.finished = task.started_at, task.finished_at
                if task.status.value != "succeeded":
                    tm.error = task.error or task.status.value
    finally:
        store.close()


def replay(
    config: Config,
    trace: Trace,
    speed: float = 10.0,
    progress: Callable[[str], None] | None = None,
    own_backends: bool = False,
    answer_tokens: int = 8,
) -> tuple[Run, dict[str, Any]]:
    """Run `trace` live under `config`'s policy; the run and its figures (like `simulate`).
    `own_backends`: on the models' own servers (`cmd`: real llama-servers) at 1x, each line
    answered with `answer_tokens` tokens; the figures then also hold each line's `engine`
    timings (the server's own), each model's `prompt_cache` verdict at the end and its
    `restores` (as `/api/status` counts them)."""
    check_replayable(trace)
    folder = Path(tempfile.mkdtemp(prefix="corral-replay-"))
    port = _free_port()
    path = folder / "corral.yaml"
    principals = {x.principal for x in trace.lines if x.principal is not None}
    spec = live_config(config, speed, port, folder, own_backends, principals)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    timings: dict[int, _Timing] = {}
    verdicts: dict[str, str] = {}
    prepared: dict[str, Any] = {}
    with _server(path, port, folder) as url:
        events = _Events(url)
        if progress is not None:
            progress(f"replaying {len(trace.lines):,} requests live on {url} at {speed:g}x")
            fast = [] if own_backends else too_fast(config, speed)
            if fast:
                progress(
                    f"warning: a sim backend needs ~{STARTUP_FLOOR_S:g} s to start, so these "
                    f"loads will take longer live than in the trace: {', '.join(fast)}; "
                    "lower --speed"
                )
        t0 = time.time() + 0.2
        answers = answer_tokens if own_backends else None
        try:
            batches = asyncio.run(_drive(url, trace, speed, t0, timings, answers))
        finally:
            events.close()
        starts, ends = list(events.started), list(events.loaded)
        if own_backends:
            verdicts, restores, prepared = _verdicts(url)
    _batch_timings(folder, batches, timings)
    run, figures = _run(config, trace, speed, t0, timings, starts, ends)
    if own_backends:
        figures["engine"] = {x: tm.engine for x, tm in sorted(timings.items()) if tm.engine}
        figures["prefill_tokens"] = sum(e.get("prompt_n", 0) for e in figures["engine"].values())
        figures["prompt_cache"] = verdicts
        figures["restores"] = restores
        figures["prepare"] = prepared
        kept = ("model", "load_s", "file_cached")  # each load's, as the stream said
        figures["loads_live"] = [{k: getattr(x, k) for k in kept} for x in ends if x.load_s]
    return run, figures


def _verdicts(url: str) -> tuple[dict[str, str], dict[str, dict[str, int]], dict[str, Any]]:
    """From `/api/status`: each model's prompt-cache verdict (`kept and verified`, `kept`, `not
    kept: why`); its restores (`restores`, `honoured`, `not_honoured` and by cause); what was
    prepared (`prepare`), with each model's load estimates."""
    status = httpx.get(f"{url}/api/status", headers=auth_headers(None), timeout=30).json()
    models = status.get("models", {})
    caches = {
        name: view["prompt_cache"]
        for name, view in models.items()
        if isinstance(view.get("prompt_cache"), dict) and "verified" in view["prompt_cache"]
    }
    verdicts = {name: str(c["verified"]) for name, c in caches.items()}
    restores = {
        name: {
            k: int(v)
            for k, v in c.items()
            if k in ("restores", "honoured") or k.startswith("not_honoured")
        }
        for name, c in caches.items()
    }
    prepared = dict(status.get("prepare") or {})
    prepared["estimates"] = {
        name: {k: view.get(k) for k in ("warm_load_s_estimate", "cold_load_s_estimate")}
        for name, view in models.items()
    }
    return verdicts, restores, prepared


def _run(
    config: Config,
    trace: Trace,
    speed: float,
    t0: float,
    timings: dict[int, _Timing],
    starts: list[_Swap],
    ends: list[_Swap],
) -> tuple[Run, dict[str, Any]]:
    def trace_s(epoch: float) -> float:
        return (epoch - t0) * speed

    requests: list[SimRequest] = []
    rejected: list[tuple[SimRequest, str]] = []
    # Where each request ran: the device the gateway named, else (batch lines) its model's.
    served_on: dict[str, list[SimRequest]] = defaultdict(list)
    for x in trace.lines:
        r = SimRequest(x)
        tm = timings[x.line]
        if tm.error is not None or None in (tm.arrived, tm.dispatched, tm.finished):
            rejected.append((r, tm.error or "no answer"))
        else:
            assert tm.arrived is not None
            assert tm.dispatched is not None
            assert tm.finished is not None
            r.arrived_at = trace_s(tm.arrived)
            r.dispatched_at = trace_s(max(tm.dispatched, tm.arrived))
            r.finished_at = trace_s(tm.finished)
            served_on[tm.device or f"model {x.model}"].append(r)
        requests.append(r)
    loads: dict[str, int] = defaultdict(int)
    for swap in starts:
        loads[swap.model] += 1
    swaps = _swap_segments(starts, ends, config.devices[0].name, trace_s)
    swap_s: dict[str, float] = defaultdict(float)
    for seg in swaps:
        swap_s[seg.device] += seg.end_s - seg.start_s
    run = Run(
        policy=config.scheduler.policy,
        config=config,
        trace=trace,
        requests=requests,
        segments=swaps,
        loads=dict(loads),
        busy_s={where: _covered_s(rs) for where, rs in served_on.items()},
        swap_s=dict(swap_s),
        rejected=rejected,
    )
    figures = summarize(run)
    measured: dict[str, list[float]] = defaultdict(list)
    for swap in ends:
        if swap.load_s is not None:
            measured[swap.model].append(swap.load_s * speed)
    figures["load_s_live"] = {m: sum(v) / len(v) for m, v in sorted(measured.items())}
    figures["load_s_live_range"] = {m: [min(v), max(v)] for m, v in sorted(measured.items())}
    stops: dict[str, list[float]] = defaultdict(list)
    for swap in ends:
        if swap.evicted is not None and swap.unload_s is not None:
            stops[swap.evicted].append(swap.unload_s * speed)
    figures["unload_s_live"] = {m: sum(v) / len(v) for m, v in sorted(stops.items())}
    figures["unload_s_live_range"] = {m: [min(v), max(v)] for m, v in sorted(stops.items())}
    return run, figures


def _covered_s(requests: list[SimRequest]) -> float:
    """Seconds in which at least one of `requests` (served on one device) was being served."""
    busy = 0.0
    edge = -float("inf")
    for r in sorted(requests, key=lambda r: r.dispatched_at or 0.0):
        start, end = r.dispatched_at or 0.0, r.finished_at or 0.0
        busy += max(0.0, end - max(start, edge))
        edge = max(edge, end)
    return busy


def _swap_segments(
    starts: list[_Swap], ends: list[_Swap], default: str, trace_s: Callable[[float], float]
) -> list[Segment]:
    """Each load as a `swap` segment of its device, in trace seconds: from its start to its
    end (loaded, failed or aborted), in order (a gateway that names no device: `default`)."""
    open_at: dict[tuple[str, str], list[float]] = defaultdict(list)
    out: list[Segment] = []
    for at, is_end, swap in sorted(
        [(x.at, False, x) for x in starts] + [(x.at, True, x) for x in ends],
        key=lambda e: (e[0], e[1]),
    ):
        key = (swap.model, swap.device or default)
        if not is_end:
            open_at[key].append(at)
        elif open_at[key]:
            began = open_at[key].pop(0)
            out.append(Segment(key[1], key[0], "swap", trace_s(began), trace_s(at)))
    return out
