"""Which node a request goes to, and which node ends batches (gateway/pipeline/cluster.py), over a
memory store and a gateway whose scheduler is real but starts no process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.config import ServerConfig, parse_config
from corral.core.types import Lifecycle
from corral.gateway.pipeline.cluster import UNREACHABLE_S, Cluster
from corral.gateway.pipeline.upstream import Upstream
from corral.gateway.servers.runtime import Gateway
from corral.store import MemoryStore

CONFIG = """
models:
  a: {cmd: "true", load_s: 1}
  b: {cmd: "true", load_s: 1}
"""


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gateway]:
    loop = asyncio.new_event_loop()
    gateway = Gateway(parse_config(CONFIG), tmp_path)

    async def start() -> None:
        gateway.start()

    loop.run_until_complete(start())
    yield gateway
    loop.run_until_complete(gateway.close())  # its tasks end before the loop closes
    loop.close()


def cluster(gw: Gateway, store: MemoryStore) -> Cluster:
    c = Cluster(store.members, gw, "http://me:1", Upstream(), window_s=10.0)  # never opened: no hop
    store.members.worker_seen(gw.node_id, ["a", "b"], url="http://me:1")
    return c


def test_a_request_goes_to_a_ready_holder_before_a_loading_one_never_to_itself(
    gw: Gateway,
) -> None:
    store = MemoryStore()
    c = cluster(gw, store)
    for node in ("n1", "n2"):
        store.members.worker_seen(node, ["a", "b"], url=f"http://{node}:1")
    store.members.set_residency("n1", [("gpu0", "a", "loading")])
    store.members.set_residency("n2", [("gpu0", "a", "ready")])
    store.members.set_residency(gw.node_id, [("device0", "b", "ready")])  # said, but not held here
    c.read()
    holder = c.holder("a")
    assert holder is not None
    assert (holder.id, holder.url) == ("n2", "http://n2:1")
    assert c.holder("b") is None  # only this node says it holds b: served here
    store.members.set_residency("n2", [])
    c.read()
    holder = c.holder("a")
    assert holder is not None
    assert holder.id == "n1"  # loading beats loading it again here


def test_a_model_held_here_is_served_here_and_unreachable_nodes_are_skipped(gw: Gateway) -> None:
    store = MemoryStore()
    c = cluster(gw, store)
    store.members.worker_seen("n1", ["a"], url="http://n1:1")
    store.members.set_residency("n1", [("gpu0", "a", "ready"), ("gpu0", "b", "ready")])
    c.read()
    assert gw.scheduler is not None
    gw.scheduler.models["a"].state = Lifecycle.READY  # as after a load here
    assert c.holder("a") is None  # held here too: no hop
    holder = c.holder("b")
    assert holder is not None
    c._unreachable["n1"] = time.monotonic() + UNREACHABLE_S
    assert c.holder("b") is None  # refused a connection lately: served here
    assert c.status()["nodes"][0]["reachable"] is False


def test_a_stale_view_forwards_nothing_and_the_lowest_live_node_leads(gw: Gateway) -> None:
    store = MemoryStore()
    c = cluster(gw, store)
    assert c.leads()  # nothing read yet: as if alone
    store.members.worker_seen("-first", ["a"], url="http://first:1")
    store.members.set_residency("-first", [("gpu0", "a", "ready")])
    c.read()
    assert not c.leads()  # "-first" sorts before this node's id (a host name never starts with "-")
    assert c.holder("a") is not None
    store.members.worker_gone("-first")
    c.read()
    assert c.leads()
    store.members.worker_seen("-first", ["a"], url="http://first:1")
    store.members.set_residency("-first", [("gpu0", "a", "ready")])
    c.read()
    c._read_at -= c.window_s + 1  # no good read for a lease: the store is away
    assert c.holder("a") is None
    assert c.leads()


def test_advertised_url_defaults_to_the_listen_address_unless_it_binds_all() -> None:
    assert ServerConfig(listen="10.0.0.2:8080").advertised_url() == "http://10.0.0.2:8080"
    assert ServerConfig(listen="0.0.0.0:8080").advertised_url() is None
    said = ServerConfig(listen="0.0.0.0:8080", advertise_url="http://node-2.lan:8080/")
    assert said.advertised_url() == "http://node-2.lan:8080"
    with pytest.raises(ValueError, match="advertise_url must be an http"):
        ServerConfig(advertise_url="node-2:8080")
