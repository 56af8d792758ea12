"""Interactive requests beside a running batch, through the official `openai` client: a person's
request goes before any batch line, to the batch's own model and to another one; batch lines
never count toward `max_queue`; and the batch runs on afterwards."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.batches import chat_line, finish, upload
from tests.support.gateway import SIM, Gateway, serve, wait_for

pytestmark = pytest.mark.e2e

LOAD_S, UNLOAD_S, TOKENS_PER_S, TOKENS = 0.6, 0.2, 100, 5
SERVICE_S = TOKENS / TOKENS_PER_S
CONFIG = f"""
models:
  bulk:
    load_s: {LOAD_S}
    unload_s: {UNLOAD_S}
    concurrency: 2
    max_queue: 20
    cmd: {SIM} --load-s {LOAD_S} --unload-s {UNLOAD_S} --tokens-per-s {TOKENS_PER_S} --parallel 2
  chat:
    load_s: {LOAD_S}
    unload_s: {UNLOAD_S}
    max_queue: 20
    cmd: {SIM} --load-s {LOAD_S} --unload-s {UNLOAD_S} --tokens-per-s {TOKENS_PER_S}
server:
  log_dir: LOG_DIR
"""
# The bounds: one swap (the batch model's unload, the chat model's load) at p95, two at
# most, asserted as swaps; in seconds (two swaps and two service times), only ten times over.
SLACK_S = 0.5
MAX_BOUND_S = 2 * (UNLOAD_S + LOAD_S) + 2 * SERVICE_S + SLACK_S


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("classes"), CONFIG) as g:
        yield g


def ask(gw: Gateway, model: str, i: int) -> float:
    """One chat request through the official client; the seconds it waited for its model."""
    return ask_swaps(gw, model, i)[0]


def ask_swaps(gw: Gateway, model: str, i: int) -> tuple[float, int]:
    """One chat request through the official client; the seconds it waited for its model and
    the swaps it waited for (`x-corral-swaps-waited`)."""
    raw = gw.client(max_retries=0).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=TOKENS
    )
    assert raw.parse().choices[0].message.content  # a real answer, strictly validated
    return float(raw.headers["x-corral-wait-ms"]) / 1000, int(raw.headers["x-corral-swaps-waited"])


@pytest.mark.parametrize("model", ["chat", "bulk"])
def test_chat_beside_a_running_batch_waits_at_most_a_swap(gw: Gateway, model: str) -> None:
    client = gw.client()
    lines = [chat_line(i, "bulk", tokens=TOKENS) for i in range(400)]  # 20x max_queue
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch.id).request_counts.completed == 0:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.05)
    status = gw.status()
    assert status["models"]["bulk"]["queued_by_class"]["batch"] > 20  # beyond max_queue

    # A person: a question, then 2 s to read the answer and type. Twenty of them. What is
    # asserted is what the scheduler decided: each question waited for at most one swap at
    # p95 and two at most (the batch model's in-flight lines finish first, never a queued one).
    # Wall-clock waits stretch on a busy machine (a p95 of 1.61 s against 1.4 s failed CI
    # with two busy processes beside it), so they get only a bound that catches a hang.
    waits, swaps = [], []
    for i in range(20):
        wait_s, swapped = ask_swaps(gw, model, i)
        waits.append(wait_s)
        swaps.append(swapped)
        time.sleep(2.0)
    ordered = sorted(swaps)
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]  # nearest rank
    assert p95 <= 1, swaps
    assert max(swaps) <= 2, swaps
    if model == "chat":  # the batch model was resident: the first question swapped chat in
        assert swaps[0] == 1, swaps
    assert max(waits) <= 10 * MAX_BOUND_S, waits

    done = finish(client, batch.id, timeout_s=120)  # and the batch runs on to the end
    assert done.request_counts.completed == 400


@pytest.mark.parametrize("policy", ["cost", "fifo"])
def test_batch_lines_never_fill_max_queue(gw: Gateway, tmp_path: Path, policy: str) -> None:
    """Under any policy: `fifo` ignores classes when it orders work, but not when it counts a
    model's waiting requests against `max_queue`."""
    if policy != "cost":
        with serve(tmp_path, CONFIG + f"scheduler: {{policy: {policy}}}\n") as other:
            return test_batch_lines_never_fill_max_queue(other, tmp_path, "cost")
    client = gw.client()
    lines = [chat_line(i, "bulk", tokens=20) for i in range(60)]  # 3x max_queue, 6 s of work
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    # Queued once the gateway's batch worker has seen the lines (a gateway just started waits
    # 0.3 s before its first look, for the nodes of a cluster started with it).
    wait_for(lambda: gw.status()["models"]["bulk"]["queued_by_class"]["batch"] > 20, 5)
    assert ask(gw, "bulk", 0) >= 0  # answered, not 429
    with contextlib.suppress(openai.ConflictError):  # under fifo the batch may be done by now
        client.batches.cancel(batch.id)
