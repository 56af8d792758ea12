"""The Batch API's runtime in `corral serve`: the batch lines run through the gateway's own
scheduler.

A batch line is a task in the store. A `Worker` attached to the gateway's scheduler mirrors the
queued lines into it as requests of the batch class (priority `batch.priority` inside it), so
one scheduler decides for both: interactive requests of any model first, batch lines fill every
idle slot and idle device, and batches for other models are grouped like any other work. A
dispatched line is sent to its model's server by `run_line`; the answer is the task's result.
The routes over it are `gateway/doors/batches.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import corral
from corral.batch.checker import Checker
from corral.batch.files import FileStorage
from corral.batch.jsonl import KIND
from corral.batch.service import BatchService
from corral.batch.webhooks import Deliverer
from corral.config import Config
from corral.gateway.pipeline.calls import outgoing
from corral.gateway.pipeline.upstream import Upstream
from corral.gateway.servers.runtime import Gateway
from corral.ratelog import Throttle
from corral.store import Store, StoreBusy, StoreError, StoreUnavailable
from corral.store.roles import Reachable
from corral.worker.registry import ModelHooks, Registry, current_device, current_task
from corral.worker.runtime import Worker, WorkerSettings

log = logging.getLogger("corral.batch")
throttle = Throttle(log)

# 408 and 429 are the server asking for time; 5xx, a server in trouble: worth another try.
_RETRY = {408, 429}


def line_runner(
    config: Config, gateway: Gateway, upstream: Callable[[], Upstream]
) -> Callable[[Any], Awaitable[dict[str, Any]]]:
    """The handler of batch-line tasks: POST the line's body to its model's server, through
    the gateway's one upstream client (a stale pooled connection is tried again; a server that
    does not answer fails the attempt, tried again later)."""

    async def run_line(line: dict[str, Any]) -> dict[str, Any]:
        data = line["body"]
        ctx = current_task()
        model = ctx.model if ctx is not None else config.resolve(data.get("model", ""))
        if model is None or model not in gateway.backends:
            raise corral.Fail(json.dumps({"status_code": 404, "body": _err("model not served")}))
        backend = gateway.servers.backend_on(model, current_device())
        # The server's own name for the model, no `priority`, the model's filters: as any door.
        _, body = outgoing(config, backend.served_name, model, str(data.get("model")), data)
        url = f"{backend.proxy_url}{line['url']}"
        headers = {"Content-Type": "application/json", **backend.headers}
        client = upstream()
        resp = await client.send(backend, model, "POST", url, headers, body)
        raw = await client.read(resp, backend, model)
        request_id = resp.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):  # a line's `response.body` is always an object
            text = raw.decode("utf-8", "replace").strip()[:1000]
            parsed = {
                "error": {
                    "message": f"the model server answered {resp.status} with no JSON object: "
                    f"{text or '(empty)'}",
                    "type": "upstream_error",
                    "param": None,
                    "code": f"upstream_{resp.status}",
                }
            }
        answer = {"status_code": resp.status, "request_id": request_id, "body": parsed}
        if resp.status < 400:
            return answer
        retry = resp.status >= 500 or resp.status in _RETRY
        if retry and ctx is not None and not ctx.last_attempt:
            raise RuntimeError(f"the server answered {resp.status}")  # tried again later
        raise corral.Fail(json.dumps(answer))  # the error file keeps the server's answer

    return run_line


def _err(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


class StoreHealth:
    """Whether the store answers, as a ping every `EVERY_S` on a thread of its own last saw it:
    read without waiting, so that a health check never queues behind the store (SQLite's lock
    while a batch is stored, an outage's retries)."""

    EVERY_S = 0.5
    STALE_S = 5.0  # a ping unanswered this long is a problem of its own

    def __init__(self, store: Reachable) -> None:
        self.store = store
        self._problem: str | None = None
        self._asking_since: float | None = None
        self._first = asyncio.Event()
        # A thread of its own: through an outage the default executor's threads all wait on
        # the store's retries, and a ping queued behind them would answer only once it ended.
        self._pinger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-health")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._asking_since = time.monotonic()
                try:
                    await loop.run_in_executor(self._pinger, self.store.ping)
                    self._problem = None
                except StoreError as exc:
                    self._problem = str(exc)
                self._asking_since = None
                self._first.set()
                await asyncio.sleep(self.EVERY_S)
        finally:
            self._pinger.shutdown(wait=False)

    async def problem(self) -> str | None:
        """None while the store answers; else why not (the first ping is waited for)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first.wait(), self.STALE_S)
        asking = self._asking_since
        if asking is not None and time.monotonic() - asking > self.STALE_S:
            return f"the store has not answered a ping for {time.monotonic() - asking:.0f} s"
        return self._problem


class BatchRuntime:
    """The store, the files, the service and the worker that runs lines; `start` and `close`
    inside the serving loop."""

    def __init__(
        self,
        config: Config,
        gateway: Gateway,
        store: Store,
        files: FileStorage,
        store_url: str = "memory://",
    ) -> None:
        """`store_url`: where another process opens `store` (large files are checked in one,
        batch/checker.py; `memory://`: only here)."""
        self.config = config
        self.gateway = gateway
        self.store = store
        line_mb = config.batch.max_line_mb or config.server.max_body_mb
        line_bytes = int(line_mb * (1 << 20))
        self.service = BatchService(
            store, files, config.batch, config.resolve, max_line_bytes=line_bytes
        )
        self.checker: Checker | None = None
        if store_url != "memory://":
            self.checker = Checker(store_url, files.root, config.batch, line_bytes, config.names)
            self.service.elsewhere = self.checker
        self._upstream: Upstream | None = None
        self.health = StoreHealth(store)
        registry = Registry()
        for name in gateway.backends:
            registry.add_model(ModelHooks(name))  # loads are the gateway's; no hooks here
        registry.add_handler(
            KIND, next(iter(gateway.backends)), line_runner(config, gateway, self.upstream)
        )
        # A short lease: after a crash, the restarted server takes the lines its last run held
        # within seconds (heartbeats renew it every second while a line runs).
        # On shutdown, running lines get 5 s to finish, then go back to the queue.
        # Its URL makes it a node of a cluster, with the gateway's name.
        # Ended batches' lines, and finished tasks, are deleted after `line_retention_days`.
        days = config.batch.line_retention_days
        settings = WorkerSettings(
            lease_s=10.0,
            shutdown_timeout_s=5.0,
            url=config.server.advertised_url(),
            retention_s=None if days is None else days * 86_400,
        )
        self.worker = Worker(store, registry, config, settings, worker_id=gateway.node_id)
        self._tasks: list[asyncio.Task[Any]] = []
        self._live = 0
        # Whether this node ends batches (validation, finalizing, expiry, webhooks): in a
        # cluster one node does (gateway/pipeline/cluster.py), so a webhook is sent once.
        self.leads: Callable[[], bool] = lambda: True

    def upstream(self) -> Upstream:
        assert self._upstream is not None, "the batch runtime is not started"
        return self._upstream

    def start(self, upstream: Upstream) -> None:
        self._upstream = upstream
        sched = self.gateway.scheduler
        assert sched is not None, "start the gateway first"
        self.worker.attach(sched)
        self.gateway.attach(self.worker.node)
        self._tasks = [
            asyncio.ensure_future(self.worker.run()),
            asyncio.ensure_future(self._ticks()),
            asyncio.ensure_future(self.health.run()),
        ]

    async def close(self) -> None:
        """Stop taking lines; running ones finish or go back (the worker's graceful stop)."""
        self.worker.stop()
        if self._tasks:  # the worker's run first: it releases what it held
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tasks[0], 10)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.checker is not None:
            self.checker.close()
        await asyncio.to_thread(self.store.close)

    def status(self) -> list[dict[str, Any]]:
        """The batches not yet ended, oldest first (blocking: store reads): counts, progress,
        place in line and ETA. A running batch's ETA comes from its measured rate; one with no
        line done yet gets an estimate from the scheduler's measured service times: the lines of
        the batches ahead of it on its models, then its own, plus a load per model."""
        sched = self.gateway.scheduler
        assert sched is not None
        ahead_s: dict[str, float] = {}  # per model: seconds of batch work queued so far
        out = []
        for b in self.service.live():
            obj = self.service.object(b)
            counts, ext = obj["request_counts"], obj["corral"]
            left = counts["total"] - counts["completed"] - counts["failed"]
            models: dict[str, int] = b.data.get("models") or {}
            lines = sum(models.values()) or 1
            eta_s = 0.0
            for name, n in models.items():
                m = sched.models.get(name)
                if m is None:
                    continue
                work = left * n / lines * m.est.service_s / m.concurrency
                ahead_s[name] = ahead_s.get(name, 0.0) + work
                eta_s += ahead_s[name] + (0.0 if m.resident else m.est.load_s)
            out.append(
                {
                    "id": b.id,
                    "owner": b.owner,
                    "status": b.status,
                    "models": models,
                    "request_counts": counts,
                    "progress": ext["progress"],
                    "queue_position": ext.get("queue_position", 0),
                    "eta_s": ext["eta_s"] if ext["eta_s"] is not None else round(eta_s, 1),
                    "eta_from": "rate" if ext["eta_s"] is not None else "estimate",
                }
            )
        return out

    async def _ticks(self, every_s: float = 0.25) -> None:
        async def report(batch_id: str, problem: str | None) -> None:
            if problem is not None:
                log.warning("webhook of batch %s not delivered: %s", batch_id, problem)
            await asyncio.to_thread(self.service.webhook_sent, batch_id, problem)

        limits = self.config.batch
        hooks = Deliverer(
            limits.webhook_hosts, report, limits.webhook_secret, limits.webhook_timeout_s
        )
        try:
            while True:
                if not self.leads():  # another node of the cluster ends batches
                    await asyncio.sleep(every_s)
                    continue
                try:
                    live, due = await asyncio.to_thread(self.service.tick)
                    if live or self._live:  # the dashboard refreshes its batch list on these
                        self.gateway.publish("batches", running=live)
                    self._live = live
                    for hook in due:  # in the background: a slow target delays no batch
                        hooks.submit(hook.batch_id, hook.url, hook.body)
                except (StoreUnavailable, StoreBusy) as exc:  # the store logged the outage
                    throttle.warning("store", "batch tick skipped: %s", exc)
                except Exception as exc:  # keep ending batches whatever one tick hit
                    # Once per cause per minute: a fault that repeats every tick wrote
                    # thousands of lines.
                    throttle.warning(type(exc).__name__, "batch tick failed", exc_info=True)
                await asyncio.sleep(every_s)
        finally:
            await hooks.close()
