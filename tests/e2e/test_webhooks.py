"""Batch webhooks on a real `corral serve`, against real listeners: internal targets
refused by default, one signed delivery per batch, a hanging target delaying no other batch,
and a huge answer never read into memory."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.support.batches import chat_line, finish, upload
from tests.support.gateway import SIM, serve, wait_for

pytestmark = pytest.mark.e2e

SECRET = "whsec_" + base64.b64encode(b"corral-test-secret-0123456789").decode()
CONFIG = f"""
models:
  alpha:
    load_s: 0.1
    concurrency: 4
    cmd: {SIM} --load-s 0.1 --tokens-per-s 2000 --parallel 4
server:
  log_dir: LOG_DIR
"""
HOOKED = (
    CONFIG
    + f"""
batch:
  webhook_hosts: [127.0.0.1]
  webhook_secret: {SECRET}
"""
)


class Listener:
    """A raw TCP webhook target. `mode`: ok (204), hang (reads the request, never answers) or
    flood (200 with a 400 MB body, sent until the peer hangs up)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.open = 0  # requests read and not answered or hung up on yet
        self.watch: Listener | None = None  # another listener whose `open` to note on each request
        self.seen_open: list[int] = []  # the watched listener's `open` when each request came
        self.sent = 0  # bytes of answer sent (flood)
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
            while len(body) < int(headers.get("content-length", 0)):
                body += conn.recv(65536)
            with self.lock:
                self.requests.append((headers, body))
                self.open += 1
                if self.watch is not None:
                    self.seen_open.append(self.watch.open)
            try:
                if self.mode == "ok":
                    conn.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
                elif self.mode == "hang":
                    conn.recv(1)  # until the peer gives up
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 400000000\r\n\r\n")
                    block = b"x" * 65536
                    while self.sent < 400_000_000:
                        conn.sendall(block)
                        self.sent += len(block)
            except OSError:
                pass
            finally:
                with self.lock:
                    self.open -= 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listeners() -> Iterator[list[Listener]]:
    made: list[Listener] = []
    yield made
    for x in made:
        x.close()


def batch(client: openai.OpenAI, hook: str, lines: int = 1) -> str:
    file_id = upload(client, [chat_line(i, "alpha") for i in range(lines)])
    b = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"webhook_url": hook},
    )
    return b.id


def webhook(client: openai.OpenAI, batch_id: str) -> dict[str, Any]:
    extra = client.batches.retrieve(batch_id).model_extra or {}
    return extra["corral"]["webhook"] or {}


def test_internal_targets_are_refused_by_default(tmp_path: Path, listeners: list[Listener]) -> None:
    inside = Listener("ok")
    listeners.append(inside)
    with serve(tmp_path, CONFIG) as g:
        client = g.client(max_retries=0)
        for url, why in (
            (inside.url, "127.0.0.1, a loopback address"),
            (f"http://localhost:{inside.port}/hook", "a loopback address"),
            ("http://169.254.169.254/latest/meta-data/", "link-local"),
            ("http://10.1.2.3/x", "private"),
        ):
            with pytest.raises(openai.BadRequestError, match=why) as exc:
                batch(client, url)
            assert exc.value.body["param"] == "webhook_url"  # type: ignore[index]
    assert inside.requests == []


def test_each_batch_sends_one_signed_webhook(tmp_path: Path, listeners: list[Listener]) -> None:
    target = Listener("ok")
    listeners.append(target)
    with serve(tmp_path, HOOKED) as g:
        client = g.client(max_retries=0)
        ids = [batch(client, target.url, lines=2) for _ in range(3)]
        for b in ids:
            assert finish(client, b).status == "completed"
        wait_for(lambda: all(webhook(client, b).get("delivered_at") for b in ids))
        assert all(webhook(client, b)["tries"] == 1 for b in ids)
        # Ticks run every 0.25 s: another two seconds of them must send nothing more.
        time.sleep(2)
    assert sorted(json.loads(body)["data"]["id"] for _, body in target.requests) == sorted(ids)
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    for headers, body in target.requests:
        signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
        mac = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        assert headers["webhook-signature"] == f"v1,{mac}"
        assert json.loads(body)["type"] == "batch.completed"


def test_a_hanging_target_delays_no_other_batch(tmp_path: Path, listeners: list[Listener]) -> None:
    hanging, ok = Listener("hang"), Listener("ok")
    ok.watch = hanging
    listeners += [hanging, ok]
    with serve(tmp_path, HOOKED) as g:
        client = g.client(max_retries=0)
        slow = [batch(client, hanging.url) for _ in range(2)]
        wait_for(lambda: len(hanging.requests) == 2)
        other = batch(client, ok.url)
        assert finish(client, other).status == "completed"
        wait_for(lambda: bool(webhook(client, other).get("delivered_at")))
        # Decided, not timed: the other batch's webhook went out while both hanging
        # deliveries were still waiting for their answers.
        assert ok.seen_open == [2]
        assert all(not webhook(client, b).get("delivered_at") for b in slow)


def test_a_huge_answer_is_never_read_into_memory(tmp_path: Path, listeners: list[Listener]) -> None:
    flood = Listener("flood")
    listeners.append(flood)
    with serve(tmp_path, HOOKED) as g:
        client = g.client(max_retries=0)
        rss_before = psutil.Process(g.pid()).memory_info().rss
        b = batch(client, flood.url)
        wait_for(lambda: bool(webhook(client, b).get("delivered_at")))
        rss_after = psutil.Process(g.pid()).memory_info().rss
    assert flood.sent < 50_000_000  # it hung up after a few KB (and socket buffers)
    assert rss_after - rss_before < 50_000_000
