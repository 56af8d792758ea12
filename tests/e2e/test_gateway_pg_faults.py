"""`corral serve` on PostgreSQL through a dropped network path: mid-batch, the path to the
database is cut and refused for seconds. /health says so while it lasts, chat goes on (it needs
no database), and the batch then finishes with one line per custom_id."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.pg_faults import PrivatePostgres, TcpProxy
from tests.support.batches import chat_line, finish, lines_of, upload
from tests.support.gateway import SIM, serve, wait_for

CONFIG = f"""
models:
  alpha:
    load_s: 0.2
    concurrency: 8
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 8
server:
  log_dir: LOG_DIR
  store: STORE
"""


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    yield server
    server.close()


def test_a_batch_survives_a_cut_database_path_and_health_reports_it(
    pg: PrivatePostgres, tmp_path: Path
) -> None:
    proxy = TcpProxy(pg.port)
    db = pg.new_database()
    n = 1500
    try:
        with serve(tmp_path, CONFIG.replace("STORE", pg.url(db, proxy.port))) as gw:
            client = gw.client(max_retries=0)
            health = httpx.get(f"{gw.url}/health").json()
            assert health == {"status": "ok", "store": "ok"}
            file_id = upload(client, [chat_line(i, "alpha", tokens=2) for i in range(n)])
            b = client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 200)  # type: ignore[union-attr]
            cut = threading.Thread(target=proxy.outage, args=(5.0,))
            cut.start()
            time.sleep(0.2)
            during = httpx.get(f"{gw.url}/health", timeout=10).json()
            while during["status"] == "ok" and cut.is_alive():  # a slow machine: look again
                time.sleep(0.2)
                during = httpx.get(f"{gw.url}/health", timeout=10).json()
            chat = client.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            cut.join()
            assert during["status"] == "degraded"
            assert "unreachable" in during["store"]
            assert "127.0.0.1" in during["store"]
            assert chat.choices[0].message.content  # interactive requests need no database
            b = finish(client, b.id, timeout_s=180)
            assert b.status == "completed"
            out = lines_of(client, b.output_file_id)
            ids = [x["custom_id"] for x in out]
            assert len(ids) == len(set(ids)) == n  # one line per custom_id: none lost or twice
            assert b.error_file_id is None
            wait_for(lambda: httpx.get(f"{gw.url}/health").json()["status"] == "ok")
    finally:
        proxy.close()
    assert proxy.cuts >= 1
