"""A hostile or careless user against a real `corral serve`: DNS rebinding and
cross-site requests, `${env.NAME}` keys, and what of ours must never reach an upstream."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from corral.backends.process import free_port
from tests.conftest import PG_URL
from tests.helpers import JsonHandler, wait_http_ok
from tests.support.gateway import CORRAL, KEY, SIM, Gateway, serve, wait_for

pytestmark = pytest.mark.e2e

CONFIG = f"""
models:
  alpha:
    load_s: 0.1
    cmd: {SIM} --load-s 0.1 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  allowed_hosts: [corral.example]
"""
CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("hostile"), CONFIG) as g:
        yield g


def state(g: Gateway, model: str) -> str:
    return str(g.status()["models"][model]["state"])


@pytest.mark.parametrize("path", ["/logs", "/api/status", "/running", "/v1/models"])
def test_a_rebound_host_name_is_refused(gw: Gateway, path: str) -> None:
    r = httpx.get(gw.url + path, headers={"Host": "attacker.example:8080"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "host_not_allowed"
    assert "server.allowed_hosts" in r.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:8080", "[::1]:8080", "corral.example"])
def test_ip_addresses_localhost_and_allowed_names_are_served(gw: Gateway, host: str) -> None:
    assert httpx.get(gw.url + "/api/status", headers={"Host": host}).status_code == 200


def test_a_cross_site_text_plain_post_loads_nothing(gw: Gateway) -> None:
    httpx.post(f"{gw.url}/unload")
    wait_for(lambda: state(gw, "alpha") == "unloaded")
    for headers in (
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
        {"Origin": "null", "Content-Type": "text/plain"},
        {"Origin": "http://localhost:3000", "Content-Type": "text/plain"},  # another port
        {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
    ):
        r = httpx.post(f"{gw.url}/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
        assert r.status_code == 403, headers
        assert r.json()["error"]["code"] == "cross_site_refused"
    assert state(gw, "alpha") == "unloaded"


def test_a_cross_site_get_unload_unloads_nothing(gw: Gateway) -> None:
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    r = httpx.get(f"{gw.url}/unload", headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert state(gw, "alpha") == "ready"


def test_same_origin_and_non_browser_clients_are_served(gw: Gateway) -> None:
    host = gw.url.removeprefix("http://")
    for headers in (
        {},  # curl, SDKs: no Origin, no Sec-Fetch-Site
        {"Origin": gw.url, "Sec-Fetch-Site": "same-origin"},  # the dashboard
        {"Origin": "https://corral.example", "Host": host},  # a reverse proxy's site
    ):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
        assert r.status_code == 200, headers
    r = httpx.get(f"{gw.url}/ui", headers={"Sec-Fetch-Site": "cross-site"})  # a link elsewhere
    assert r.status_code == 200


def test_env_keys_in_corrals_own_format(tmp_path: Path) -> None:
    config = CONFIG + '  api_keys: ["${env.CORRAL_TEST_KEY}"]\n'
    with serve(tmp_path, config, env={"CORRAL_TEST_KEY": KEY}) as g:
        real = {"Authorization": f"Bearer {KEY}"}
        literal = {"Authorization": "Bearer ${env.CORRAL_TEST_KEY}"}
        assert httpx.get(f"{g.url}/v1/models", headers=real).status_code == 200
        assert httpx.get(f"{g.url}/v1/models", headers=literal).status_code == 401


class Recorder(JsonHandler):
    """An OpenAI-compatible upstream that keeps the headers of each request."""

    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.answer(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "r",
                          "choices": []})  # fmt: skip

    def do_GET(self) -> None:
        self.answer(200, {"object": "list", "data": []})


def test_our_key_and_cookie_never_reach_an_upstream(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = f"""
models:
  remote:
    upstream: http://127.0.0.1:{server.server_address[1]}
server:
  log_dir: LOG_DIR
  api_keys: [KEY_HERE]
"""
    try:
        with serve(tmp_path, config.replace("KEY_HERE", KEY)) as g:
            for path in ("/v1/chat/completions", "/upstream/remote/v1/chat/completions"):
                headers: dict[str, Any] = {
                    "Authorization": f"Bearer {KEY}",
                    "Cookie": f"theme=dark; corral_key={KEY}; lang=en",
                }
                body = {**CHAT, "model": "remote"}
                r = httpx.post(g.url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 200, r.text
                cookie_only = {"Cookie": f"corral_key={KEY}"}
                r = httpx.post(g.url + path, json=body, headers=cookie_only, timeout=30)
                assert r.status_code == 200, r.text
    finally:
        server.shutdown()
    assert len(Recorder.seen) == 4
    for h in Recorder.seen:
        assert KEY not in json.dumps(h), h
    assert Recorder.seen[0]["cookie"] == "theme=dark; lang=en"
    assert "cookie" not in Recorder.seen[1]


SECRET_KEY = "sk-live-0123456789abcdef4f2a"


def test_secrets_are_masked_in_running_logs_and_the_server_log(tmp_path: Path) -> None:
    # `sh -c` runs the sim server and ignores the arguments after it: a server with a key flag.
    config = f"""
models:
  alpha:
    load_s: 0.1
    cmd: sh -c 'exec {SIM} --load-s 0.1 --port ${{PORT}} --model alpha' sh --api-key {SECRET_KEY}
    proxy: http://127.0.0.1:${{PORT}}
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path, config) as g:
        assert httpx.post(f"{g.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        running = httpx.get(f"{g.url}/running").text
        logs = httpx.get(f"{g.url}/logs").text
        model_logs = httpx.get(f"{g.url}/api/models/alpha/logs").text
        status = httpx.get(f"{g.url}/api/status").text
    for shown in (running, logs, model_logs, status):
        assert SECRET_KEY not in shown
    assert "sk-...4f2a" in running
    assert "sk-...4f2a" in logs  # the "--- corral: starting ..." line


def test_config_check_and_the_start_up_line_mask_keys_and_passwords(tmp_path: Path) -> None:
    # PostgreSQL's trust auth ignores the password: the store opens, and the line is printed.
    pg = conninfo_to_dict(PG_URL)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    store = (
        f"postgresql://postgres:pw-0123456789abcdef7777@{pg['host']}:{pg['port']}/{pg['dbname']}"
        f"?schema={schema}"
    )
    config = tmp_path / "corral.yaml"
    config.write_text(
        f"""
models:
  alpha:
    cmd: {SIM} --port ${{PORT}} --model alpha
    upstream_api_key: up-0123456789abcdef9999
server:
  api_keys: [{SECRET_KEY}]
  store: {store}
  log_dir: {tmp_path / "logs"}
"""
    )
    config.chmod(0o644)
    out = subprocess.run(
        [CORRAL, "config", "check", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    for secret in (SECRET_KEY, "up-0123456789abcdef9999", "pw-0123456789abcdef7777"):
        assert secret not in text
    assert "sk-...4f2a" in out.stdout
    assert "can be read (it holds API keys) by other users" in out.stderr
    config.chmod(0o600)
    quiet = subprocess.run([CORRAL, "config", "check", str(config)], capture_output=True, text=True)
    assert "other users" not in quiet.stderr
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    assert "corral serve:" in err
    assert "pw-0123456789abcdef7777" not in err
    assert "pw-...7777" in err


def test_a_model_server_listening_beyond_loopback_is_named(tmp_path: Path) -> None:
    config = tmp_path / "corral.yaml"
    config.write_text(
        f"""
models:
  open:
    load_s: 0.1
    cmd: {SIM} --load-s 0.1 --host 0.0.0.0
  closed:
    load_s: 0.1
    cmd: {SIM} --load-s 0.1
server:
  log_dir: {tmp_path / "logs"}
"""
    )
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    proc = subprocess.Popen(
        [CORRAL, "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health")
        for model in ("open", "closed"):
            body = {**CHAT, "model": model}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "model open: its server answers on" in err
    assert "model closed: its server answers" not in err
