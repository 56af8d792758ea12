"""Principals and their keys through a real `corral serve`: keys from `corral keys` (the data
directory's key file, read again as it changes) and from the config, users refused the admin
routes with 403, a revoked key refused with 401, and the official client with each key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest

from corral.backends.process import free_port
from tests.support.batches import chat_line, finish, lines_of, upload
from tests.support.gateway import CORRAL, KEY, SIM, serve, wait_for

pytestmark = pytest.mark.e2e

BOB = "bob-key-in-the-config"
CAROL = "carol-key-by-digest"
CONFIG = f"""
models:
  alpha:
    cmd: {SIM} --load-s 0.1
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    bob: {{role: user, keys: [{BOB}]}}
    carol: {{role: admin, keys: ["sha256:{hashlib.sha256(CAROL.encode()).hexdigest()}"]}}
"""


def keys(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_DATA_HOME": str(data)}
    return subprocess.run(
        [CORRAL, "keys", *args], capture_output=True, text=True, env=env, timeout=60
    )


def code(url: str, key: str | None, method: str = "GET") -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, url, headers=headers, timeout=30).status_code


def test_keys_roles_and_revocation_through_a_running_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = keys(data, "create", "alice", "--role", "user")
    assert made.returncode == 0, made.stderr
    alice = made.stdout.strip().splitlines()[-1]  # the key is the last line
    assert alice.startswith("crl-")
    assert alice not in (data / "corral" / "keys.json").read_text()  # only its digest is kept
    with serve(tmp_path, CONFIG, env={"XDG_DATA_HOME": str(data)}) as gw:
        models, load = f"{gw.url}/v1/models", f"{gw.url}/api/models/alpha/load?wait=true"
        assert code(models, None) == 401
        assert code(models, "crl-not-a-key") == 401
        for user in (alice, BOB):
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=user, max_retries=0)
            assert [m.id for m in client.models.list()] == ["alpha"]
            done = client.completions.create(model="alpha", prompt="x", max_tokens=2)
            assert done.choices[0].text
            r = httpx.post(load, headers={"Authorization": f"Bearer {user}"}, timeout=30)
            assert r.status_code == 403
            assert r.json()["error"]["code"] == "forbidden"
            assert "needs the admin role" in r.json()["error"]["message"]
            for route in ("/api/models/alpha/logs", "/logs", "/unload"):
                assert code(gw.url + route, user) == 403, route
        # Admins: server.api_keys, a principal's key given by its digest, a key made now.
        made = keys(data, "create", "ops", "--role", "admin")
        ops = made.stdout.strip().splitlines()[-1]
        wait_for(lambda: code(models, ops) == 200, timeout_s=30)
        for admin in (KEY, CAROL, ops):
            assert code(load, admin, "POST") == 200
            assert code(f"{gw.url}/api/models/alpha/logs", admin) == 200
        # Revoked: refused within a second or so; the others keep working.
        listed = [json.loads(x) for x in keys(data, "list", "--json").stdout.splitlines()]
        (alice_id,) = [k["id"] for k in listed if k["principal"] == "alice"]
        assert keys(data, "revoke", alice_id).returncode == 0
        wait_for(lambda: code(models, alice) == 401, timeout_s=30)
        assert code(models, ops) == 200
        assert code(models, BOB) == 200
        # A damaged key file keeps the keys read before.
        (data / "corral" / "keys.json").write_text("{not json")
        assert keys(data, "create", "mallory").returncode != 0  # never overwritten
        wait_for(lambda: "keys read before stay in force" in gw.logged(), timeout_s=30)
        assert code(models, ops) == 200
        assert code(models, alice) == 401
    assert "keys read before stay in force" in gw.stderr
    assert "keys of 4 principals (admin, alice, bob, carol)" in gw.stderr


def test_a_server_with_a_damaged_key_file_does_not_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "corral").mkdir(parents=True)
    (data / "corral" / "keys.json").write_text('{"version": 1, "keys": 7')
    (tmp_path / "corral.yaml").write_text(f"models:\n  alpha:\n    cmd: {SIM}\n")
    out = subprocess.run(
        [
            CORRAL,
            "serve",
            "--config",
            str(tmp_path / "corral.yaml"),
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_DATA_HOME": str(data)},
        timeout=60,
    )
    assert out.returncode == 2
    assert "keys.json: not JSON" in out.stderr


def test_without_keys_every_route_is_open(tmp_path: Path) -> None:
    with serve(tmp_path, f"models:\n  alpha:\n    cmd: {SIM} --load-s 0.1\n") as gw:
        assert code(f"{gw.url}/v1/models", None) == 200
        assert code(f"{gw.url}/api/models/alpha/load?wait=true", None, "POST") == 200
    assert "no API keys: every caller may use every route" in gw.stderr


OWNED = f"""
models:
  alpha:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    alice: {{role: user, keys: [alice-key]}}
    bob: {{role: user, keys: [bob-key]}}
"""


def test_each_user_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    with serve(tmp_path, OWNED) as gw:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(
                base_url=f"{gw.url}/v1",
                api_key=key,
                max_retries=0,
                _strict_response_validation=True,
            )

        alice, bob, admin = client("alice-key"), client("bob-key"), client(KEY)
        mine = upload(alice, [chat_line(i, "alpha") for i in range(3)])
        theirs = upload(bob, [chat_line(i, "alpha") for i in range(2)])
        made = alice.batches.create(
            input_file_id=mine,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers={"Idempotency-Key": "job-1"},
        )
        # Another user's ids answer 404 on every route, as if they did not exist.
        for attempt in (
            lambda: bob.files.retrieve(mine),
            lambda: bob.files.content(mine),
            lambda: bob.files.delete(mine),
            lambda: bob.batches.retrieve(made.id),
            lambda: bob.batches.cancel(made.id),
            lambda: bob.batches.create(
                input_file_id=mine, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert [f.id for f in bob.files.list()] == [theirs]
        assert [b.id for b in bob.batches.list()] == []
        status = httpx.get(
            f"{gw.url}/api/status", headers={"Authorization": "Bearer bob-key"}, timeout=30
        ).json()
        assert made.id not in {b["id"] for b in status["batches"]}  # nor in its status
        for route in ("/api/audit", "/api/models/alpha/unload"):
            assert code(gw.url + route, "bob-key", "GET" if "audit" in route else "POST") == 403
        # The same idempotency key is each user's own.
        again = bob.batches.create(
            input_file_id=theirs,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers={"Idempotency-Key": "job-1"},
        )
        assert again.id != made.id
        assert [b.id for b in bob.batches.list()] == [again.id]
        # Its owner reads its results; the other user cannot; an admin sees everything.
        done = finish(alice, made.id)
        assert done.status == "completed"
        assert done.output_file_id is not None
        assert len(lines_of(alice, done.output_file_id)) == 3
        with pytest.raises(openai.NotFoundError):
            bob.files.content(done.output_file_id)
        assert {f.id for f in alice.files.list()} == {mine, done.output_file_id}
        assert {b.id for b in admin.batches.list()} == {made.id, again.id}
        assert {mine, theirs, done.output_file_id} <= {f.id for f in admin.files.list()}
        assert admin.files.retrieve(mine).id == mine
        finish(bob, again.id)


TWO = f"""
models:
  alpha:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
  beta:
    load_s: 0.2
    aliases: [b]
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    narrow: {{role: user, keys: [narrow-key], models: ["alp*"]}}
"""


def test_a_principal_uses_and_sees_only_its_models_on_every_door(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = keys(data, "create", "cli-narrow", "--model", "beta")
    assert made.returncode == 0, made.stderr
    cli_key = made.stdout.strip().splitlines()[-1]
    listed = [json.loads(x) for x in keys(data, "list", "--json").stdout.splitlines()]
    assert listed[0]["models"] == ["beta"]
    with serve(tmp_path, TWO, env={"XDG_DATA_HOME": str(data)}) as gw:
        narrow = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="narrow-key", max_retries=0)
        assert [m.id for m in narrow.models.list()] == ["alpha"]
        assert narrow.completions.create(model="alpha", prompt="x", max_tokens=2).choices[0].text
        for name in ("beta", "b"):  # by name or alias: 404, as a model not served
            with pytest.raises(openai.NotFoundError) as refused:
                narrow.completions.create(model=name, prompt="x", max_tokens=2)
            assert "beta" not in str(refused.value).replace(f"'{name}'", "")
            with pytest.raises(openai.NotFoundError):
                narrow.models.retrieve(name)
        auth = {"Authorization": "Bearer narrow-key"}
        tags = httpx.get(f"{gw.url}/api/tags", headers=auth, timeout=30).json()
        assert [t["name"] for t in tags["models"]] == ["alpha:latest"]
        chat = {"model": "beta", "messages": [{"role": "user", "content": "x"}], "stream": False}
        assert (
            httpx.post(f"{gw.url}/api/chat", json=chat, headers=auth, timeout=30).status_code == 404
        )
        r = httpx.post(f"{gw.url}/upstream/beta/v1/models", headers=auth, timeout=30)
        assert r.status_code == 404
        # A batch line naming a model its maker may not use fails, named; the rest never run.
        file_id = upload(narrow, [chat_line(0, "alpha"), chat_line(1, "beta")])
        b = narrow.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert b.status == "failed"
        assert b.errors is not None
        (problem,) = b.errors.data or []
        assert problem.line == 2
        # The key file's principal: its own models.
        mine = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=cli_key, max_retries=0)
        assert [m.id for m in mine.models.list()] == ["beta"]
        admin = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
        assert sorted(m.id for m in admin.models.list()) == ["alpha", "beta"]


LIMITED = f"""
models:
  alpha:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
  late:
    load_s: 30
    cmd: {SIM} --load-s 30
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
  principals:
    rpm: {{keys: [rpm-key], limits: {{requests_per_minute: 2}}}}
    one: {{keys: [one-key], limits: {{in_flight: 1}}}}
    waits: {{keys: [waits-key], limits: {{queued: 1}}}}
"""


def test_over_a_limit_a_call_gets_429_with_retry_after_and_takes_nothing(tmp_path: Path) -> None:
    with serve(tmp_path, LIMITED) as gw:
        url = f"{gw.url}/v1/completions"
        body = {"model": "alpha", "prompt": "x", "max_tokens": 2}

        def auth(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        def post(key: str, timeout_s: float = 120, **kw: object) -> httpx.Response:
            return httpx.post(url, json={**body, **kw}, headers=auth(key), timeout=timeout_s)

        # Requests per minute: two pass, the third waits about half a minute.
        assert [post("rpm-key").status_code for _ in range(2)] == [200, 200]
        r = post("rpm-key")
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["Retry-After"]) <= 30
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(
                base_url=f"{gw.url}/v1", api_key="rpm-key", max_retries=0
            ).completions.create(model="alpha", prompt="x", max_tokens=2)
        assert post(KEY).status_code == 200  # others are not held back

        # In flight and queued: a call waiting for a model that takes 30 s to load holds
        # both until its client leaves (after 5 s).
        def waiting(key: str) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(url, json={**body, "model": "late"}, headers=auth(key), timeout=5)

        def admitted(key: str, model: str = "alpha") -> bool:
            """Whether a call now is let in (answered, or still waiting after 2 s)."""
            try:
                return post(key, model=model, timeout_s=2).status_code != 429
            except httpx.TimeoutException:
                return True

        threads = [threading.Thread(target=waiting, args=(k,)) for k in ("one-key", "waits-key")]
        for t in threads:
            t.start()
        wait_for(lambda: gw.status(auth=True)["models"]["late"]["queued"] >= 2, timeout_s=30)
        r = post("one-key")
        assert r.status_code == 429
        assert "in flight" in r.json()["error"]["message"]
        r = post("waits-key", model="late")
        assert r.status_code == 429
        assert "waiting for a model" in r.json()["error"]["message"]
        for t in threads:
            t.join(60)
        wait_for(lambda: admitted("one-key"), timeout_s=30)
        wait_for(lambda: admitted("waits-key", "late"), timeout_s=30)
    assert gw.stderr.count("refused with 429") == 3  # each limit said once


def test_the_audit_log_keeps_admin_actions_and_key_changes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = keys(data, "create", "alice", "--role", "user")
    alice = made.stdout.strip().splitlines()[-1]
    env = {"XDG_DATA_HOME": str(data)}
    audit = "/api/audit"

    def entries(url: str) -> list[tuple[str, str, str]]:
        r = httpx.get(url + audit, headers={"Authorization": f"Bearer {CAROL}"}, timeout=30)
        assert r.status_code == 200, r.text
        return [(e["principal"], e["action"], e["target"]) for e in r.json()["data"]]

    with serve(tmp_path, CONFIG, env=env) as gw:
        assert code(f"{gw.url}/api/models/alpha/load?wait=true", alice, "POST") == 403
        assert code(f"{gw.url}/api/models/alpha/load?wait=true", CAROL, "POST") == 200
        assert code(f"{gw.url}/api/models/alpha/unload", KEY, "POST") in (200, 202)
        assert code(gw.url + audit, alice) == 403  # the audit log is an admin's
        keys(data, "revoke", "alice")
        wait_for(lambda: any(a == "key.revoke" for _, a, _ in entries(gw.url)), timeout_s=30)
        seen = entries(gw.url)
        assert ("carol", "model.load", "alpha") in seen
        assert ("admin", "model.unload", "alpha") in seen
        assert not any(p == "alice" for p, _, _ in seen)  # refused: not an action taken
        made_by = [(p, t) for p, a, t in seen if a == "key.create"]
        assert len(made_by) == 1
        assert made_by[0][1].startswith("alice:key_")
        assert made_by[0][0]  # the account that ran `corral keys create`
    with serve(tmp_path, CONFIG, env=env) as gw:  # read again at start: kept once
        again = entries(gw.url)
        assert sum(1 for _, a, _ in again if a == "key.create") == 1
        assert sum(1 for _, a, _ in again if a == "key.revoke") == 1
