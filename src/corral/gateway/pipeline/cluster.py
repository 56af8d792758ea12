"""Several `corral serve` nodes on one database form a cluster (docs/design/gateway.md).

Every node says where it is reached (its worker row's `url`) and what it holds (the residency
table, written by the worker attached to its scheduler). From those two tables, read every
`refresh_s`, a node knows which other node holds a model:

- an interactive request for a model this node does not hold (neither loading nor ready), that
  another live node holds, is forwarded there, streamed back chunk by chunk; the other node
  serves it as its own and never forwards it again (`x-corral-forwarded-by`);
- a node that does not answer the connection is skipped for `UNREACHABLE_S` and the request is
  served here, as if alone: a dead node's rows stay in the table until they age out (a lease).
Batch lines need no forwarding: each node's attached worker shows its scheduler only the lines
of the models it should run (worker/affinity.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi.responses import Response

from corral.gateway.pipeline.calls import Call
from corral.gateway.pipeline.streams import ModelStream
from corral.gateway.pipeline.upstream import DROP, DROP_BACK, Upstream, relay
from corral.gateway.servers.runtime import Gateway
from corral.rendezvous import rendezvous
from corral.store import Membership, StoreError

log = logging.getLogger("corral.cluster")

FORWARDED = "x-corral-forwarded-by"  # the node that forwarded a request: serve it, never again
UNREACHABLE_S = 10.0  # a node that refused a connection is not tried again for this long
CONNECT_S = 2.0  # a node that does not accept a connection within this is unreachable

# What the proxy drops on the way to a model server, except the API key and the priority: the
# other node checks and schedules the request itself (every node has the same keys).
_HOP = DROP - {"authorization", "proxy-authorization", "x-corral-priority"}


class Unreachable(Exception):
    """The node that holds a model did not answer: nothing reached a model (serve it here)."""


@dataclass(frozen=True)
class Node:
    """Another node, and the models it holds: (model, device, state) each."""

    id: str
    url: str
    holds: tuple[tuple[str, str, str], ...] = field(default=())


class Cluster:
    """This node's view of the others, refreshed by `run`; `forward` sends a request on."""

    def __init__(
        self,
        store: Membership,
        gateway: Gateway,
        url: str | None,
        upstream: Upstream,
        window_s: float,
        refresh_s: float = 0.5,
    ) -> None:
        self.store = store
        self.gateway = gateway
        self.node_id = gateway.node_id
        self.url = url
        self.upstream = upstream  # the one client (upstream.py): it sends the hop too
        self.window_s = window_s  # a node silent this long is gone (its lease)
        self.refresh_s = refresh_s
        self.nodes: dict[str, Node] = {}  # every live node, this one included
        self._read_at = 0.0  # monotonic time of the last good read
        self._unreachable: dict[str, float] = {}  # node -> monotonic time to try it again
        self.forwarded: dict[str, int] = {}  # requests sent on, per node

    # --- the view -----------------------------------------------------------------------------
    def read(self) -> None:
        """Read the nodes and what they hold (blocking: run it in a thread)."""
        since = time.time() - self.window_s
        urls = self.store.nodes(since)
        holds: dict[str, list[tuple[str, str, str]]] = {}
        for r in self.store.residency(since):
            holds.setdefault(r.worker_id, []).append((r.model, r.device, r.state))
        self.nodes = {n: Node(n, url, tuple(holds.get(n, ()))) for n, url in urls.items()}
        self._read_at = time.monotonic()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.read)
            except StoreError as exc:  # the store says so itself; the view ages out below
                log.debug("cluster view not refreshed: %s", exc)
            await asyncio.sleep(self.refresh_s)

    def _fresh(self) -> bool:
        return time.monotonic() - self._read_at < self.window_s

    def holder(self, model: str) -> Node | None:
        """The other live, reachable node to send a request for `model` to, or None to serve it
        here: this node holds it, or nobody else does. A ready copy before a loading one; among
        equals, the same node for every request (rendezvous)."""
        sched = self.gateway.scheduler
        if sched is not None and sched.models[model].state.value in ("loading", "ready"):
            return None
        if not self._fresh():
            return None
        now = time.monotonic()
        best: dict[str, list[str]] = {"ready": [], "loading": []}
        for node in self.nodes.values():
            if node.id == self.node_id or now < self._unreachable.get(node.id, 0.0):
                continue
            for m, _, state in node.holds:
                if m == model and state in best:
                    best[state].append(node.id)
        ids = best["ready"] or best["loading"]
        chosen = rendezvous(model, ids)
        return None if chosen is None else self.nodes[chosen]

    def leads(self) -> bool:
        """This node ends batches (validation, finalizing, expiry, webhooks): the first live node
        by id, so that one node does and a webhook goes once. Without a fresh view, this one
        (as if alone). A leader that dies ages out of the table within a lease."""
        if not self._fresh():
            return True
        return min([*self.nodes, self.node_id]) == self.node_id

    # --- forwarding ---------------------------------------------------------------------------
    def destination(self, call: Call) -> Node | None:
        """The node to send `call` to (`holder`), or None to serve it here, as for a request
        another node forwarded already."""
        if FORWARDED in call.request.headers:
            return None
        return self.holder(call.model)

    async def forward(self, call: Call, node: Node) -> Response:
        """Send `call` (its body as the client sent it) to `node` and relay its answer.
        `Unreachable` if the node did not answer: nothing reached a model, so it is served
        here, and the node is skipped for a while."""
        request, model, body = call.request, call.model, call.sent
        url = f"{node.url.rstrip('/')}{request.url.path}"
        query = request.scope["query_string"]
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers[FORWARDED] = self.node_id
        try:
            resp = await self.upstream.request(
                request.method,
                url,
                headers,
                body,
                model,
                aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Nothing was sent to a model: serving it here is safe.
            self._unreachable[node.id] = time.monotonic() + UNREACHABLE_S
            log.warning(
                "node %s (%s) holds %s but did not answer (%s): served here, and that node is "
                "skipped for %g s",
                node.id,
                node.url,
                model,
                type(exc).__name__,
                UNREACHABLE_S,
            )
            raise Unreachable(node.id) from exc
        self.forwarded[node.id] = self.forwarded.get(node.id, 0) + 1
        self.gateway.metrics.forwarded.labels(model).inc()
        out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_BACK}
        events = resp.headers.get("content-type", "").startswith("text/event-stream")

        async def cut_short(exc: BaseException) -> str:
            return f"model {model}: node {node.id} cut the answer short ({type(exc).__name__})"

        return ModelStream(
            relay(resp, events, cut_short),
            self.gateway.config.server.stream_send_timeout_s,
            f"model {model} on node {node.id}",
            resp.close,
            status_code=resp.status,
            headers=out,
        )

    # --- status -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """For /api/status: this node, and every live node with what it holds."""
        now = time.monotonic()
        nodes = dict(self.nodes)
        if self.node_id not in nodes:  # not said yet (or the store is away): this node anyway
            nodes[self.node_id] = Node(self.node_id, self.url or "")
        return {
            "node": self.node_id,
            "url": self.url,
            "view_age_s": round(now - self._read_at, 3) if self._read_at else None,
            "nodes": [
                {
                    "id": n.id,
                    "url": n.url or None,
                    "self": n.id == self.node_id,
                    "reachable": now >= self._unreachable.get(n.id, 0.0),
                    "forwarded": self.forwarded.get(n.id, 0),
                    "models": [
                        {"model": m, "device": d, "state": s} for m, d, s in sorted(n.holds)
                    ],
                }
                for n in sorted(nodes.values(), key=lambda n: n.id)
            ],
        }
