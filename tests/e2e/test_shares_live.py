"""Fair shares and usage through a real `corral serve`: a light user's request goes before a
heavy user's queued backlog on the same model, and each principal's usage (`/api/usage`,
`/metrics`, `corral usage`) adds up to the server's own token counts."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import CORRAL, KEY, SIM, serve, wait_for

pytestmark = pytest.mark.e2e

HEAVY, LIGHT, BOSS, BULK = "heavy-key", "light-key", "boss-key", "bulk-key"
CONFIG = f"""
models:
  alpha:
    cmd: {SIM} --load-s 0.1 --tokens-per-s 10 --answer-tokens 10
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    heavy: {{keys: [{HEAVY}]}}
    light: {{keys: [{LIGHT}]}}
    boss: {{role: admin, keys: [{BOSS}]}}
    bulk:
      keys: [{BULK}]
      highest_class: batch
      limits: {{tokens_per_minute: 10}}
"""
N_HEAVY = 8


def queued(url: str) -> int:
    status = httpx.get(
        f"{url}/api/status", headers={"Authorization": f"Bearer {BOSS}"}, timeout=30
    ).json()
    return int(status["models"]["alpha"]["queued"])


def test_a_light_user_goes_before_a_heavy_backlog_and_usage_adds_up(tmp_path: Path) -> None:
    with serve(tmp_path, CONFIG) as gw:
        clients = {
            who: openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=120)
            for who, key in (("heavy", HEAVY), ("light", LIGHT))
        }
        tokens: dict[str, int] = {"heavy": 0, "light": 0}
        done: list[str] = []
        lock = threading.Lock()

        def call(who: str) -> None:
            answer = clients[who].chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=10
            )
            assert answer.usage is not None
            with lock:
                tokens[who] += answer.usage.completion_tokens
                done.append(who)

        call("light")  # loads the model
        done.clear()
        heavy = [threading.Thread(target=call, args=("heavy",)) for _ in range(N_HEAVY)]
        for t in heavy:
            t.start()
        # The heavy backlog is queued (one runs, the rest wait) before the light user asks.
        wait_for(lambda: queued(gw.url) >= N_HEAVY - 2, timeout_s=60)

        # A user sees the machine's state, and of the requests, its own only.
        def status_as(key: str) -> dict[str, Any]:
            got: dict[str, Any] = httpx.get(
                f"{gw.url}/api/status", headers={"Authorization": f"Bearer {key}"}, timeout=30
            ).json()
            return got

        as_light = status_as(LIGHT)
        as_boss = status_as(BOSS)
        light_after = status_as(LIGHT)
        # The same machine's count for both (nothing arrives now: the queue only drains, so the
        # admin's read lies between the user's two).
        queued_then = [
            int(x["models"]["alpha"]["queued"]) for x in (as_light, as_boss, light_after)
        ]
        assert queued_then == sorted(queued_then, reverse=True), queued_then
        assert queued_then[-1] >= 1, queued_then
        assert as_light["models"]["alpha"]["queue"] == []
        assert {q["principal"] for q in as_boss["models"]["alpha"]["queue"]} == {"heavy"}
        assert [a["principal"] for a in as_light["activity"]] == ["light"]
        with httpx.stream(
            "GET",
            f"{gw.url}/api/events",
            headers={"Authorization": f"Bearer {LIGHT}"},
            timeout=30,
        ) as events:
            lines = events.iter_lines()
            assert next(lines) == "event: status"
            first = json.loads(next(lines).removeprefix("data: "))
        assert first["models"]["alpha"]["queue"] == []
        assert {a["principal"] for a in first["activity"]} == {"light"}
        light = threading.Thread(target=call, args=("light",))
        light.start()
        for t in [*heavy, light]:
            t.join(timeout=180)
        assert sorted(done) == ["heavy"] * N_HEAVY + ["light"]
        # The decision, from the server's own record (arrival at the door and wait of each
        # request): the light request went before heavy ones that were waiting when it arrived
        # (arrival order would have put them all first); at most two went first: one
        # dispatched as it arrived, and one while it was read and queued on a loaded machine.
        served = httpx.get(
            f"{gw.url}/api/status", headers={"Authorization": f"Bearer {BOSS}"}, timeout=30
        ).json()["activity"]
        light_row = next(a for a in served if a["principal"] == "light")
        light_at = float(light_row["at"])
        light_go = light_at + float(light_row["wait_s"])
        waiting = [
            float(a["at"]) + float(a["wait_s"])
            for a in served
            if a["principal"] == "heavy"
            and float(a["at"]) < light_at
            and float(a["at"]) + float(a["wait_s"]) > light_at
        ]
        assert waiting, "the heavy backlog had drained before the light request arrived"
        went_first = [go for go in waiting if go < light_go]
        assert len(waiting) > len(went_first), (len(went_first), len(waiting))
        assert len(went_first) <= 2, (len(went_first), len(waiting))

        def usage(key: str) -> list[dict[str, object]]:
            r = httpx.get(
                f"{gw.url}/api/usage",
                params={"by": "total"},
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            rows: list[dict[str, object]] = r.json()["data"]
            return rows

        mine = usage(LIGHT)  # a user sees its own use only
        assert [(r["principal"], r["requests"]) for r in mine] == [("light", 2)]
        everyone = {str(r["principal"]): r for r in usage(BOSS)}
        assert set(everyone) == {"heavy", "light"}
        for who in ("heavy", "light"):
            assert everyone[who]["output_tokens"] == tokens[who]  # the server's own counts
            assert float(everyone[who]["service_s"]) > 0  # type: ignore[arg-type]
        assert float(everyone["light"]["load_s"]) > 0  # type: ignore[arg-type]  # it loaded alpha
        bad = httpx.get(
            f"{gw.url}/api/usage",
            params={"by": "week"},
            headers={"Authorization": f"Bearer {BOSS}"},
        )
        assert bad.status_code == 400
        assert "by must be one of" in bad.json()["error"]["message"]
        metrics = httpx.get(
            f"{gw.url}/metrics", headers={"Authorization": f"Bearer {BOSS}"}, timeout=30
        ).text
        heavy_row = (
            f'corral_principal_requests_total{{model="alpha",principal="heavy"}} {N_HEAVY}.0'
        )
        assert heavy_row in metrics  # an admin's scrape: everyone's use
        as_user = httpx.get(
            f"{gw.url}/metrics", headers={"Authorization": f"Bearer {LIGHT}"}, timeout=30
        ).text
        assert 'principal="light"' in as_user
        assert 'principal="heavy"' not in as_user  # a user's: its own
        open_scrape = httpx.get(f"{gw.url}/metrics", timeout=30).text
        assert "corral_swaps_total" in open_scrape or "corral_requests_total" in open_scrape
        assert "principal=" not in open_scrape  # no key: the machine's figures, nobody's use
        out = subprocess.run(
            [CORRAL, "usage", "--by", "total", "--csv", "--url", gw.url, "--api-key", LIGHT],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        rows = list(csv.DictReader(io.StringIO(out.stdout)))
        assert [(r["principal"], r["requests"]) for r in rows] == [("light", "2")]
        table = subprocess.run(
            [CORRAL, "usage", "--url", gw.url, "--api-key", BOSS],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert table.returncode == 0, table.stderr
        assert "heavy" in table.stdout
        assert "light" in table.stdout


def test_a_principals_highest_class_and_tokens_per_minute(tmp_path: Path) -> None:
    with serve(tmp_path, CONFIG) as gw:
        bulk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=BULK, max_retries=0, timeout=60)
        answer = bulk.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=10
        )
        assert answer.usage is not None
        assert answer.usage.total_tokens >= 10  # the minute's tokens are spent
        with pytest.raises(openai.RateLimitError) as over:
            bulk.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=10
            )
        assert "tokens_per_minute" in over.value.message
        assert int(over.value.response.headers["retry-after"]) >= 1
        status = httpx.get(
            f"{gw.url}/api/status", headers={"Authorization": f"Bearer {BULK}"}, timeout=30
        ).json()
        (mine,) = status["activity"]  # one call answered; the refused one never ran
        assert mine["service_class"] == "batch"  # its highest class: run as batch work
        usage = httpx.get(
            f"{gw.url}/api/usage",
            params={"by": "total"},
            headers={"Authorization": f"Bearer {BULK}"},
            timeout=30,
        ).json()["data"]
        assert [(u["principal"], u["requests"]) for u in usage] == [("bulk", 1)]
        assert usage[0]["output_tokens"] == answer.usage.completion_tokens


TURNS = f"""
models:
  alpha:
    concurrency: 1
    cmd: {SIM} --load-s 0.1 --tokens-per-s 2000 --answer-tokens 2
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    ann: {{keys: [{HEAVY}]}}
    bob: {{keys: [{LIGHT}], weight: 2}}
"""


def test_two_users_batches_take_turns_on_one_model(tmp_path: Path) -> None:
    """Bob's batch, made while ann's 30 lines wait on the same model, runs beside them (two
    of his lines to one of hers: his weight is 2) and ends first; one after the other, as in
    arrival order, his would end last. Asserted on the order the lines ran in, from the
    store."""
    from corral.store import open_store
    from tests.support.batches import chat_line, finish, upload

    with serve(tmp_path, TURNS) as gw:
        made = {}
        for who, key, n in (("ann", HEAVY, 30), ("bob", LIGHT, 10)):
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
            file_id = upload(client, [chat_line(i, "alpha", tokens=2) for i in range(n)])
            made[who] = (client, client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id)  # fmt: skip
        for client, batch_id in made.values():
            assert finish(client, batch_id, timeout_s=120).status == "completed"
    data = Path(os.environ.get("XDG_DATA_HOME") or tmp_path / "data")
    store = open_store(f"sqlite:///{data / 'corral' / 'corral.db'}", read_only=True)
    try:
        ran = sorted(
            (t.started_at or 0.0, who)
            for who, (_, batch_id) in made.items()
            for t in store.batches.tasks(batch_id)
        )
    finally:
        store.close()
    order = "".join(who[0] for _, who in ran)
    assert order.count("b") == 10
    assert order.rstrip("a").count("a") < 30 / 2, order  # bob's last ran before ann's middle
    assert "bb" in order.lstrip("a")[: order.rfind("b") + 1], order  # two of his to one of hers
