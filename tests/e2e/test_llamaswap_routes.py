"""The endpoints llama-swap's users call, through `corral serve` to sim backends: model-routed
JSON routes beyond chat (rerank, messages, speech, versionless /v/...), multipart audio, GET
routes with `?model=`, `models.retrieve`, streamed legacy completions under the official client's
strict validation, and llama-swap's management routes with its answer shapes."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import pytest
import yaml

from tests.e2e.test_gateway_errors import http_server
from tests.support.gateway import KEY, SIM, Gateway, serve

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
models:
  alpha:
    load_s: 0.2
    aliases: [a]
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000 --parallel 2
  beta:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
  api_keys: [{KEY}]
"""
    folder: Path = tmp_path_factory.mktemp("llamaswap-routes")
    with serve(folder, config) as g:
        yield g


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0, _strict_response_validation=True
    )


def test_models_retrieve_and_streamed_legacy_completions_with_the_official_client(
    gw: Gateway,
) -> None:
    c = client(gw)
    assert c.models.retrieve("alpha").id == "alpha"  # before: 404
    assert c.models.retrieve("a").id == "a"  # an alias answers under its own name
    with pytest.raises(openai.NotFoundError, match="model 'nope' not found"):
        c.models.retrieve("nope")
    # Streamed legacy completions: the client's strict mode rejects `finish_reason: null` in
    # the chunks before the last, which OpenAI's API and llama-server send too; read them as
    # the client does by default.
    loose = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    pieces = [
        chunk.choices[0].text
        for chunk in loose.completions.create(model="alpha", prompt="x", max_tokens=4, stream=True)
        if chunk.choices
    ]
    assert len("".join(pieces).split()) == 4


def test_multipart_audio_speech_and_json_routes_are_routed_by_model(gw: Gateway) -> None:
    c = client(gw)
    heard = c.audio.transcriptions.create(model="beta", file=("a.wav", b"\0" * 3000))
    assert heard.text == "3000 bytes of audio heard by beta"
    spoken = c.audio.speech.create(model="alpha", voice="alloy", input="hello")
    assert spoken.content.startswith(b"ID3")
    for path in ("/v1/rerank", "/rerank", "/v/rerank"):
        r = httpx.post(
            f"{gw.url}{path}",
            headers=AUTH,
            json={"model": "a", "query": "red fox", "documents": ["blue sea", "a red fox"]},
        )
        assert r.status_code == 200, (path, r.text)
        assert r.json()["results"][0]["index"] == 1
        assert r.json()["model"] == "alpha"
    r = httpx.post(
        f"{gw.url}/v1/messages",
        headers=AUTH,
        json={"model": "beta", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    assert len(r.json()["content"][0]["text"].split()) == 3


def test_get_routes_take_the_model_from_the_query(gw: Gateway) -> None:
    # Loaded first: a probe of a model that is not loaded is answered without its server
    # (tests/e2e/test_probes.py); this one reaches the server.
    client(gw).completions.create(model="alpha", prompt="x", max_tokens=1)
    r = httpx.get(f"{gw.url}/props", params={"model": "alpha"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_alias": "alpha", "total_slots": 2}  # the sim's own answer
    missing = httpx.get(f"{gw.url}/props", headers=AUTH)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "model"


def test_llama_swaps_management_routes_answer_in_its_shapes(gw: Gateway) -> None:
    c = client(gw)
    c.completions.create(model="alpha", prompt="x", max_tokens=1)
    running = httpx.get(f"{gw.url}/running", headers=AUTH).json()["running"]
    assert [(r["model"], r["state"]) for r in running] == [("alpha", "ready")]
    assert set(running[0]) == {"model", "state", "cmd", "proxy", "ttl", "name", "description"}
    assert "[alpha]" in httpx.get(f"{gw.url}/logs", headers=AUTH).text
    version = httpx.get(f"{gw.url}/api/version", headers=AUTH).json()
    assert set(version) == {"version", "commit", "build_date"}
    r = httpx.post(f"{gw.url}/api/models/unload/alpha", headers=AUTH)
    assert (r.status_code, r.text) == (200, "OK")
    assert httpx.get(f"{gw.url}/running", headers=AUTH).json() == {"running": []}
    c.completions.create(model="beta", prompt="x", max_tokens=1)
    assert httpx.get(f"{gw.url}/unload", headers=AUTH).text == "OK"
    assert httpx.get(f"{gw.url}/running", headers=AUTH).json() == {"running": []}
    assert httpx.post(f"{gw.url}/api/models/unload", headers=AUTH).json() == {"msg": "ok"}
    assert httpx.post(f"{gw.url}/api/models/unload/nope", headers=AUTH).status_code == 404


def test_the_new_routes_need_the_api_key(gw: Gateway) -> None:
    for method, path in [
        ("POST", "/rerank"),
        ("POST", "/v/chat/completions"),
        ("POST", "/v1/audio/transcriptions"),
        ("GET", "/props?model=alpha"),
        ("GET", "/running"),
        ("GET", "/unload"),
        ("GET", "/logs"),
    ]:
        r = httpx.request(method, f"{gw.url}{path}", json={"model": "alpha"})
        assert r.status_code == 401, path


def test_a_llama_swap_files_filters_names_and_metadata_work_through_the_gateway(
    tmp_path: Path,
) -> None:
    config = f"""
includeAliasesInList: true
macros:
  short: 2
models:
  writer:
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
    name: "Writer"
    description: "writes"
    aliases: [w]
    metadata:
      tokens: ${{short}}
    filters:
      stripParams: "temperature"
      setParams:
        max_tokens: 2
      setParamsByID:
        "${{MODEL_ID}}:long":
          max_tokens: 6
"""
    with serve(tmp_path, config) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)

        def words(model: str) -> int:
            out = c.completions.create(model=model, prompt="x", max_tokens=50, temperature=2)
            return len(out.choices[0].text.split())

        assert words("writer") == 2  # setParams overrides the request's max_tokens
        assert words("writer:long") == 6  # the id's own params, and the id is an alias
        listed = httpx.get(f"{gw.url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["writer", "w", "writer:long"]
        first = listed[0]
        assert (first["name"], first["description"]) == ("Writer", "writes")
        assert first["meta"] == {"llamaswap": {"tokens": 2}}  # the macro kept its type


def test_the_every_key_fixture_serves_with_its_commands_swapped_for_sim_backends(
    tmp_path: Path,
) -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "llama-swap" / "every-key.yaml"
    doc = yaml.safe_load(fixture.read_text())
    for m in doc["models"].values():
        m["cmd"] = f"{SIM} --load-s 0.2 --tokens-per-s 2000"
        m.pop("cmdStop", None)  # the fixture's `kill -TERM ${PID}` would do; SIGTERM is simpler
    env = {"CORRAL_TEST_WEIGHTS": "/models", "CORRAL_TEST_KEY": KEY}
    with http_server(_Peer) as peer:
        doc["peers"]["other-box"]["proxy"] = peer  # a local stand-in for the remote box
        with serve(tmp_path, yaml.safe_dump(doc), env=env) as gw:
            _every_key_serves(gw)
    # the peer got the request under its own model name, with the peer's key (from the env)
    assert _Peer.seen == [("/v1/chat/completions", f"Bearer {KEY}", KEY, "remote-model")]


class _Peer(BaseHTTPRequestHandler):
    """A peer server: answers chat completions and records what it was sent."""

    seen: ClassVar[list[tuple[str, str, str, str]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        auth, key = self.headers.get("authorization", ""), self.headers.get("x-api-key", "")
        _Peer.seen.append((self.path, auth, key, body["model"]))
        answer = json.dumps(
            {
                "id": "chatcmpl-peer",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "from the peer"},
                    }
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_: object) -> None:
        pass


def _every_key_serves(gw: Gateway) -> None:
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    for model in ("big-thinker", "thinker-32768", "big-thinker:fast", "small-fast"):
        out = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert out.choices[0].message.content
    assert [m.id for m in c.models.list()] == [
        "big-thinker",
        "thinker-32768",
        "plain-alias",
        "big-thinker:fast",
        "other-box/remote-model",
        "remote-model",
    ]  # includeAliasesInList; small-fast is unlisted; a peer's model by both its names
    big = httpx.get(f"{gw.url}/v1/models", headers=AUTH).json()["data"][0]
    assert big["architecture"] == {
        "input_modalities": ["text", "image"],
        "output_modalities": ["text"],
        "modality": "text+image->text",
    }
    assert big["capabilities"] == {"vision": True, "function_calling": True}
    assert (big["supported_parameters"], big["context_length"]) == (["tools", "tool_choice"], 32768)
    assert big["meta"]["llamaswap"]["temperature"] == 0.6
    literal = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-literal", max_retries=0)
    assert literal.models.list().data
    remote = c.chat.completions.create(
        model="remote-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert remote.choices[0].message.content == "from the peer"


def test_send_loading_state_streams_the_wait_then_the_answer(tmp_path: Path) -> None:
    config = f"""
sendLoadingState: true
models:
  slow-loader:
    cmd: {SIM} --load-s 2.0 --tokens-per-s 2000
  quiet:
    sendLoadingState: false
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
"""
    with serve(tmp_path, config) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        began = time.monotonic()
        stream = c.chat.completions.create(
            model="slow-loader",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
        )
        thinking, content, first_s, ready_s = [], [], None, None
        for chunk in stream:
            if first_s is None:
                first_s = time.monotonic() - began
            if not chunk.choices:
                continue
            assert chunk.id
            assert chunk.created > 0
            assert chunk.model == "slow-loader"  # every chunk whole, progress included
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                thinking.append(extra["reasoning_content"])
                if "is ready after" in extra["reasoning_content"]:
                    ready_s = time.monotonic() - began
            if delta.content:
                content.append(delta.content)
        told = "".join(thinking)
        assert told.startswith("[corral] waiting for model slow-loader to load\n")
        # The stream was open during the 2 s load, not started after it: it said how long it
        # had waited at least once (a line per whole second, none repeated) before the model
        # was ready, and its first chunk came before the ready one. (Asserted against the
        # gateway's own order, not a wall-clock bound that a busy machine stretches.)
        seconds = re.findall(r"^\[corral\] (\d+) s$", told, re.M)
        assert seconds
        assert len(seconds) == len(set(seconds))
        assert re.search(r"\[corral\] \d+ s\n.*is ready after", told, re.S), told
        assert all(line.startswith("[corral] ") for line in told.splitlines())
        assert first_s is not None
        assert ready_s is not None
        assert first_s < ready_s
        answer = "".join(content)
        assert len(answer.split()) == 3  # then the model's own answer
        # A client sends the answer back, progress and all (OpenCode sends the reasoning back
        # with every later request; some merge it into the text): the model never sees it.
        prompts = []
        for said in ({"content": answer}, {"content": told + answer, "reasoning_content": told}):
            turns: Any = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", **said},
                {"role": "user", "content": "and then?"},
            ]
            again = c.chat.completions.create(model="slow-loader", messages=turns, max_tokens=2)
            assert again.usage is not None
            prompts.append(again.usage.prompt_tokens)
        assert prompts[0] == prompts[1]
        # a model that opts out streams only its answer
        quiet = c.chat.completions.create(
            model="quiet", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert not any(
            (ch.choices[0].delta.model_extra or {}).get("reasoning_content")
            for ch in quiet
            if ch.choices
        )


def test_logs_stream_holds_every_line_written_once_it_has_answered(gw: Gateway) -> None:
    """A line written as soon as the stream's status is in comes in it (the stream follows
    the files from before it answers, not from whenever its first read runs)."""
    assert gw.folder is not None
    log = gw.folder / "logs" / "alpha.log"
    for k in range(5):
        mark = f"corral-test-mark-{k}-{time.monotonic_ns()}"
        with httpx.stream("GET", f"{gw.url}/logs/stream", headers=AUTH, timeout=10) as r:
            assert r.status_code == 200
            with log.open("ab") as f:
                f.write(f"{mark}\n".encode())
            lines = r.iter_lines()
            assert any(line == f"[alpha] {mark}" for line in itertools.islice(lines, 500)), mark


def test_logs_stream_follows_the_servers_logs(gw: Gateway) -> None:
    c = client(gw)
    httpx.post(f"{gw.url}/api/models/unload", headers=AUTH)
    before = set(httpx.get(f"{gw.url}/logs", headers=AUTH).text.splitlines())
    seen: list[str] = []

    def new_start(line: str) -> bool:  # each start names its own port: a line not seen before
        return line.startswith("[beta]") and "corral: starting" in line and line not in before

    with httpx.stream("GET", f"{gw.url}/logs/stream", headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        loader = threading.Thread(
            target=c.completions.create, kwargs={"model": "beta", "prompt": "x", "max_tokens": 1}
        )
        loader.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = next(lines)
            seen.append(line)
            if new_start(line):
                break
        loader.join(20)
    assert any(new_start(x) for x in seen), seen[-5:]
