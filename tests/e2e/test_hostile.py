"""A hostile or careless user against a real `corral serve` (issue 25): DNS rebinding and
cross-site requests, `${env.NAME}` keys, and what of ours must never reach an upstream."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from tests.e2e.test_gateway import KEY, SIM, Gateway, serve, wait_for
from tests.helpers import JsonHandler

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
