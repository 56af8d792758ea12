"""A client that leaves cancels its work, on every route and door, streamed or not:
the upstream request is closed, the model server stops generating and frees its slot, the
model's turn goes to the next request, and the activity log says 499. Against a real `corral
serve` whose two sim models each fill the one device: a request for the other model can only
be served once the first model is idle, and the first model's answer would take 10,000 s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.gateway import SIM, Gateway, serve

pytestmark = pytest.mark.e2e

LONG = 100_000  # tokens: 10,000 s at 10 tokens/s

# (route, body): each asks `slow` for an answer that takes 10,000 s, whole (not streamed).
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": LONG}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": LONG}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "options": {"num_predict": LONG}}),
    ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": LONG}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
                              "stream": True}),
]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
devices: [{{name: gpu0, memory_gb: 24}}]
models:
  slow:
    load_s: 0.3
    memory_gb: 20
    cmd: {SIM} --load-s 0.3 --tokens-per-s 10
  other:
    load_s: 0.3
    memory_gb: 20
    cmd: {SIM} --load-s 0.3 --tokens-per-s 2000
scheduler: {{max_wait_s: 600}}
server:
  log_dir: LOG_DIR
  relay_processes: 2  # a client that leaves a relay's call frees its model as well
"""
    with serve(tmp_path_factory.mktemp("leaves"), config) as g:
        yield g


def leave(gw: Gateway, route: str, body: dict[str, Any]) -> None:
    """Send `body` to `slow` and leave 2 s later without its whole answer: a client's read
    timeout (whole answers), or a client that stops reading and closes (streams)."""
    url, sent = f"{gw.url}{route}", {**body, "model": "slow"}
    if body.get("stream"):
        with httpx.stream("POST", url, json=sent, timeout=30) as r:
            started = time.monotonic()
            for _ in r.iter_bytes():
                if time.monotonic() - started > 2:
                    break  # closes the connection mid-answer
        return
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=sent, timeout=2.0)


@pytest.mark.parametrize(
    ("route", "body"), ROUTES, ids=[f"{r}-{i}" for i, (r, _) in enumerate(ROUTES)]
)
def test_a_client_that_leaves_frees_its_model_for_the_next_request(
    gw: Gateway, route: str, body: dict[str, Any]
) -> None:
    c = gw.client(max_retries=0, timeout=120)
    c.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    leave(gw, route, body)
    # The other model fills the device too: it loads only once `slow` is idle, which it never
    # is while its 10,000 s answer runs.
    r = c.chat.completions.with_raw_response.create(
        model="other", messages=[{"role": "user", "content": "next"}], max_tokens=2
    )
    assert r.parse().choices[0].message.content
    assert int(r.headers["x-corral-swaps-waited"]) >= 1  # it waited for a swap, not 10,000 s
    status = gw.status()
    left = [a for a in status["activity"] if a["model"] == "slow" and a["route"] == route]
    assert left[0]["status"] == 499  # newest first: the client left, not a 200


def test_a_client_that_closes_once_it_has_the_whole_stream_did_not_leave(gw: Gateway) -> None:
    """The official clients close their connection as soon as they read `data: [DONE]`, which
    can reach the gateway before the relay has seen its server's end: the answer was whole, and
    the log says 200 (the loaded CI run of 70ef95c logged such a stream as 499)."""
    url = f"{gw.url}/v1/chat/completions"
    body = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}  # fmt: skip
    rounds = 12
    for _ in range(rounds):
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for chunk in r.iter_bytes():
                if b"[DONE]" in chunk:
                    break  # closes the connection at once
    done = time.monotonic() + 10
    while True:  # the log's entry is written when the relay ends, just after the client left
        streams = [a for a in gw.status()["activity"] if a["model"] == "other"][:rounds]
        if all(a["tokens"] == 3 for a in streams) or time.monotonic() > done:
            break
        time.sleep(0.1)
    assert [a["status"] for a in streams] == [200] * rounds
    assert [a["tokens"] for a in streams] == [3] * rounds
