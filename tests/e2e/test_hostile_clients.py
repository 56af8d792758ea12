"""A hostile client on Ollama's door and on the raw pass-through, against a real
`corral serve`: `keep_alive` past any duration, `options` that try to choose the upstream model,
and the model servers' lifecycle endpoints through `/upstream/<model>/...`. Through the official
`ollama` client where a client is involved; raw HTTP where the client would not send it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import ollama
import pytest

from corral.backends.process import free_port
from tests.helpers import JsonHandler
from tests.support.gateway import KEY, SIM, Gateway, serve

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {KEY}"}


class Recording(JsonHandler):
    """An OpenAI-compatible upstream that keeps every body it is sent."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Recording.bodies.append(body)
        self.answer(
            200,
            {
                "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    port = free_port()
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", port), Recording)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    config = f"""
models:
  alpha:
    load_s: 0.2
    sleep: {{api: vllm, level: 1}}
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
  paid:
    upstream: http://127.0.0.1:{port}
    upstream_model: the-one-offered
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
"""
    folder: Path = tmp_path_factory.mktemp("hostile-clients")
    try:
        with serve(folder, config) as g:
            yield g
    finally:
        upstream.shutdown()


def client(gw: Gateway) -> ollama.Client:
    return ollama.Client(host=gw.url, headers=AUTH)


@pytest.mark.parametrize("keep", [1e308, 1e12, "99999999999999999h", "-1"])
def test_a_keep_alive_past_any_duration_keeps_the_model_and_ps_answers(
    gw: Gateway, keep: Any
) -> None:
    """`keep_alive: 1e308` once turned /api/ps into a 500 for every client."""
    c = client(gw)
    c.generate(model="alpha", prompt="hi", keep_alive=keep, options={"num_predict": 2})
    loaded = {m.model: m for m in c.ps().models}
    assert "alpha:latest" in loaded
    assert loaded["alpha:latest"].expires_at is not None
    assert loaded["alpha:latest"].expires_at.year == 2318  # Ollama's "forever"


def test_a_keep_alive_of_400_digits_is_forever_not_a_500(gw: Gateway) -> None:
    body = '{"model": "alpha", "prompt": "hi", "stream": false, "keep_alive": ' + "9" * 400 + "}"
    r = httpx.post(f"{gw.url}/api/generate", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{gw.url}/api/ps", headers=AUTH).status_code == 200


def test_a_keep_alive_that_is_no_duration_is_a_400_in_ollamas_shape(gw: Gateway) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client(gw).generate(model="alpha", prompt="hi", keep_alive="soon")
    assert caught.value.status_code == 400
    assert "keep_alive" in caught.value.error
    for keep in (True, {"h": 1}, "nan", [1]):  # what the client would not send: raw HTTP
        body = {"model": "alpha", "prompt": "hi", "keep_alive": keep}
        r = httpx.post(f"{gw.url}/api/generate", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400, (keep, r.text)
        assert "keep_alive" in r.json()["error"]


def test_options_cannot_choose_the_upstream_model(gw: Gateway) -> None:
    """The OpenAI door enforces `upstream_model`; Ollama's did not, so a client could spend the
    operator's upstream key on any model."""
    Recording.bodies.clear()
    out = client(gw).chat(
        model="paid",
        messages=[{"role": "user", "content": "hi"}],
        stream=False,
        options={"model": "gpt-expensive", "temperature": 0.2, "stream": True},
    )
    assert out.message.content == "ok"
    (sent,) = Recording.bodies
    assert sent["model"] == "the-one-offered"
    assert sent["temperature"] == 0.2
    assert sent["stream"] is False


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "sleep?level=1", "/api/models/alpha/unload"),
        ("POST", "wake_up", "/api/models/alpha/load"),
        ("POST", "collective_rpc", "none"),
        ("POST", "%2Fsleep", "/api/models/alpha/unload"),
        ("POST", "slots/0?action=save", "none"),
    ],
)
def test_lifecycle_endpoints_through_upstream_are_a_403_naming_corrals_route(
    gw: Gateway, method: str, path: str, route: str
) -> None:
    client(gw).generate(model="alpha", prompt="hi", options={"num_predict": 1})
    r = httpx.request(method, f"{gw.url}/upstream/alpha/{path}", headers=AUTH, json={})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "managed_by_corral"
    assert route in error["message"]
    # The server was never put to sleep behind Corral's back: it still answers.
    asleep = httpx.get(f"{gw.url}/upstream/alpha/is_sleeping", headers=AUTH).json()
    assert asleep == {"is_sleeping": False}
    assert gw.status(auth=True)["models"]["alpha"]["state"] == "ready"
    answer = client(gw).generate(model="alpha", prompt="hi", options={"num_predict": 1})
    assert answer.done
