"""The gateway's request pipeline in process: the app (`create_app`) driven through httpx's
`ASGITransport`, with real HTTP model servers behind it (uvicorn serving small Starlette apps on
this loop). Each test asserts what the pipeline decided: what reached the server, which error
and in which shape, what the scheduler saw. The whole-process tests (`corral serve`, the
official clients) are in tests/e2e."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from corral.config import parse_config
from corral.gateway.doors.app import create_app

pytestmark = pytest.mark.integration


@dataclass
class Seen:
    """What a model server received."""

    path: str
    headers: dict[str, str]
    body: bytes
    query: str

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Echo:
    """A model server that records every request and answers in OpenAI's shapes."""

    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> Starlette:
        async def record(request: Request) -> Seen:
            s = Seen(
                request.url.path,
                {k.lower(): v for k, v in request.headers.items()},
                await request.body(),
                request.url.query,
            )
            self.seen.append(s)
            return s

        async def chat(request: Request) -> Response:
            data = (await record(request)).json()
            if data.get("hold"):  # hold the model's slot until the test lets go
                await self.release.wait()
            if data.get("stream"):

                async def events() -> AsyncIterator[bytes]:
                    for word in ("one", "two", "three"):
                        chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
                        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse(
                {
                    "object": "chat.completion",
                    "model": data.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": f"echo {data['model']}"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                }
            )

        async def embeddings(request: Request) -> Response:
            data = (await record(request)).json()
            inputs = data["input"] if isinstance(data["input"], list) else [data["input"]]
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {"object": "embedding", "index": i, "embedding": [float(len(x))]}
                        for i, x in enumerate(inputs)
                    ],
                    "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)},
                }
            )

        async def anything(request: Request) -> Response:
            s = await record(request)
            return JSONResponse({"path": s.path, "query": s.query, "size": len(s.body)})

        async def health(_: Request) -> Response:
            return JSONResponse({"status": "ok"})

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/embeddings", embeddings, methods=["POST"]),
                Route("/{path:path}", anything, methods=["GET", "POST", "PUT", "DELETE"]),
            ]
        )


def _broken() -> Starlette:
    """A real server's plain-text 500 (no JSON, no OpenAI shape)."""

    async def fail(_: Request) -> Response:
        return PlainTextResponse("Internal Server Error", status_code=500)

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/health", health), Route("/{path:path}", fail, methods=["POST"])]
    )


@contextlib.asynccontextmanager
async def served(app: Starlette) -> AsyncIterator[str]:
    """`app` on a real port of 127.0.0.1, on this loop."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Corral:
    client: httpx.AsyncClient
    app: FastAPI
    echo: Echo

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.gateway.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)


Body = Callable[[Corral], Awaitable[None]]


def run(tmp_path: Path, models: str, test: Body, server: str = "") -> None:
    """Serve `models` (YAML under `models:`; `{echo}` and `{broken}` are the servers' URLs,
    `{down}` a port nothing listens on) and run `test` against the app."""

    async def main() -> None:
        echo = Echo()
        async with served(echo.app()) as echo_url, served(_broken()) as broken_url:
            text = (
                models.replace("{echo}", echo_url)
                .replace("{broken}", broken_url)
                .replace("{down}", f"http://127.0.0.1:{_free_port()}")
            )
            config = parse_config(f"{server}\nmodels:\n{text}")
            app = create_app(config, tmp_path / "logs")
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://127.0.0.1:8080", timeout=30
                ) as client:
                    await test(Corral(client, app, echo))

    asyncio.run(main())


ONE = """
  alpha:
    upstream: {echo}
    aliases: [a]
"""


def chat(model: Any = "alpha", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def openai_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# --- the happy path --------------------------------------------------------------------------


def test_a_chat_reaches_the_model_and_comes_back_with_corral_headers(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "echo alpha"
        assert float(r.headers["x-corral-wait-ms"]) >= 0
        assert r.headers["x-corral-swaps-waited"] == "1"  # it waited for the model's load
        assert r.headers["x-corral-node"] == c.app.state.gateway.node_id
        again = await c.client.post("/v1/chat/completions", json=chat())
        assert again.headers["x-corral-swaps-waited"] == "0"  # resident: no swap
        assert [s.path for s in c.echo.seen] == ["/v1/chat/completions"] * 2
        assert c.metric("corral_requests_total", model="alpha", status="200") == 2

    run(tmp_path, ONE, test)


def test_a_streamed_chat_is_relayed_event_by_event_and_frees_the_slot(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        words = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]
        assert words == ["one", "two", "three"]
        sched = c.app.state.gateway.scheduler
        assert sched.models["alpha"].in_flight == 0  # the relay's end released the turn

    run(tmp_path, ONE, test)


def test_an_alias_reaches_the_server_under_the_served_name_without_corral_fields(
    tmp_path: Path,
) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post(
            "/v1/chat/completions",
            json=chat("a", priority=5),
            headers={"x-corral-priority": "7", "authorization": "Bearer secret"},
        )
        assert r.status_code == 200
        (seen,) = c.echo.seen
        assert seen.json()["model"] == "alpha"
        assert "priority" not in seen.json()
        assert "x-corral-priority" not in seen.headers
        assert "authorization" not in seen.headers  # the client's key stays at the gateway

    run(tmp_path, ONE, test)


def test_llama_swap_filters_rewrite_the_body_in_their_order_at_every_door_and_batch_line(
    tmp_path: Path,
) -> None:
    models = """
  alpha:
    upstream: {echo}
    aliases: [a]
    filters:
      strip_params: [temperature]
      set_params: {top_k: 5}
      set_params_by_id:
        a: {top_k: 9}
"""

    async def test(c: Corral) -> None:
        await c.client.post("/v1/chat/completions", json=chat(temperature=0.3))
        await c.client.post("/v1/chat/completions", json=chat("a", temperature=0.3))
        # Ollama's door reads its call through the same prelude: the filters apply there too.
        hi = [{"role": "user", "content": "hi"}]
        r = await c.client.post(
            "/api/chat",
            json={"model": "a", "messages": hi, "stream": False, "options": {"temperature": 0.3}},
        )
        assert r.status_code == 200
        first, second, ollama = (s.json() for s in c.echo.seen)
        assert "temperature" not in first
        assert first["top_k"] == 5
        assert second["top_k"] == 9
        assert "temperature" not in ollama
        assert (ollama["model"], ollama["top_k"]) == ("alpha", 9)
        # A Batch API line reaches the server through the same rewrite.
        line: dict[str, Any] = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions"}
        line["body"] = chat("a", temperature=0.3, priority=3)
        r = await c.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
        )
        batch = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions"}
        r = await c.client.post("/v1/batches", json={**batch, "completion_window": "24h"})
        assert r.status_code == 200, r.text
        for _ in range(600):
            if len(c.echo.seen) > 3:
                break
            await asyncio.sleep(0.05)
        lined = c.echo.seen[3].json()
        assert "temperature" not in lined
        assert "priority" not in lined
        assert (lined["model"], lined["top_k"]) == ("alpha", 9)

    run(tmp_path, models, test)


def test_the_raw_upstream_route_and_the_query_route_reach_the_server(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.get("/upstream/a/slots?id=3")
        assert (r.status_code, r.json()["path"], r.json()["query"]) == (200, "/slots", "id=3")
        r = await c.client.get("/props", params={"model": "alpha"})
        assert (r.status_code, r.json()["path"]) == (200, "/props")
        r = await c.client.get("/upstream/nobody/slots")
        assert r.status_code == 404
        assert openai_error(r)["code"] == "model_not_found"

    run(tmp_path, ONE, test)


def test_a_multipart_route_finds_its_model_in_the_form(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post(
            "/v1/audio/transcriptions",
            data={"model": "a"},
            files={"file": ("x.wav", b"RIFF0000", "audio/wav")},
        )
        assert r.status_code == 200
        assert c.echo.seen[-1].path == "/v1/audio/transcriptions"
        assert r.json()["size"] > 8  # the form went on as it came
        r = await c.client.post(
            "/v1/audio/transcriptions",
            content=b"--x\r\nnot a form",
            headers={"content-type": "multipart/form-data; boundary=x"},
        )
        assert r.status_code == 400
        assert "multipart" in openai_error(r)["message"]

    run(tmp_path, ONE, test)


# --- refusals, named and in OpenAI's shape ---------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        (b'{"model": "nobody"}', 404, "model", "valid ids: alpha"),
        (b'{"messages": []}', 400, "model", "missing `model`"),
        (b'{"model": 7}', 400, "model", "must be a string"),
        (b'{"model": "alpha",', 400, None, "not valid JSON"),
        (b'{"model": "alpha", "temperature": NaN}', 400, None, "NaN is not a JSON value"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        (b'{"model": "alpha", "priority": 10000000}', 400, "priority", "priority must be"),
        (b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
    ],
)
def test_a_bad_call_is_refused_naming_the_field(
    tmp_path: Path, body: bytes, status: int, param: str | None, says: str
) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == status
        err = openai_error(r)
        assert err["param"] == param, err
        assert says in err["message"], err
        assert c.echo.seen == []  # nothing reached the model
        # Counted once, where it was answered (a name no model has is not a label).
        assert c.metric("corral_requests_total", model="", status=str(status)) == 1

    run(tmp_path, ONE, test)


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post("/v1/chat/completions", content=b"x" * 2_000_000)
        assert r.status_code == 413
        assert openai_error(r)["code"] == "body_too_large"

    run(tmp_path, ONE, test, server="server: {max_body_mb: 1}")


def test_a_wrong_method_on_a_model_route_is_405(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.put("/v1/chat/completions", json=chat())
        assert r.status_code == 405
        assert "takes POST" in openai_error(r)["message"]

    run(tmp_path, ONE, test)


def test_the_api_key_guards_the_model_routes(tmp_path: Path) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401
        assert openai_error(r)["code"] == "invalid_api_key"
        ok = await c.client.post(
            "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer k1"}
        )
        assert ok.status_code == 200
        assert "authorization" not in c.echo.seen[0].headers

    run(tmp_path, ONE, test, server="server: {api_keys: [k1]}")


# --- the model server's failures ---------------------------------------------------------------


def test_a_server_that_does_not_answer_is_a_502_and_frees_the_turn(tmp_path: Path) -> None:
    models = """
  gone:
    upstream: {down}
    check_endpoint: none
"""

    async def test(c: Corral) -> None:
        r = await c.client.post("/v1/chat/completions", json=chat("gone"))
        assert r.status_code == 502
        assert openai_error(r)["code"] == "backend_unreachable"
        assert c.metric("corral_requests_total", model="gone", status="502") == 1
        assert c.app.state.gateway.scheduler.models["gone"].in_flight == 0

    run(tmp_path, models, test)


def test_a_plain_text_500_reaches_the_client_in_openai_shape(tmp_path: Path) -> None:
    models = """
  bad:
    upstream: {broken}
"""

    async def test(c: Corral) -> None:
        for stream in (False, True):
            r = await c.client.post("/v1/chat/completions", json=chat("bad", stream=stream))
            assert r.status_code == 500
            err = openai_error(r)
            assert err["code"] == "upstream_500"
            assert "Internal Server Error" in err["message"]

    run(tmp_path, models, test)


# --- admission ----------------------------------------------------------------------------------


def test_a_full_queue_is_429_with_retry_after_and_a_wait_past_the_bound_504(
    tmp_path: Path,
) -> None:
    models = """
  alpha:
    upstream: {echo}
    max_queue: 1
    request_timeout_s: 3
"""

    async def test(c: Corral) -> None:
        holder = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=chat(hold=1)))
        while not c.echo.seen:  # the first request holds the model's only slot
            await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=chat()))
        # Long enough a bound that a busy machine sees the waiter queued before it times out
        # (with 0.3 s, a poll that slept past it waited for a queue that had emptied).
        while c.app.state.gateway.intake.pending("alpha") < 1:
            assert not waiter.done(), "the waiter timed out before it was seen queued"
            await asyncio.sleep(0.01)
        full = await c.client.post("/v1/chat/completions", json=chat())
        assert full.status_code == 429
        assert openai_error(full)["code"] == "queue_full"
        assert full.headers["retry-after"]
        timed_out = await waiter
        assert timed_out.status_code == 504
        assert openai_error(timed_out)["code"] == "queue_timeout"
        c.echo.release.set()
        assert (await holder).status_code == 200
        assert len(c.echo.seen) == 1  # neither refused request reached the model
        assert c.metric("corral_requests_total", model="alpha", status="429") == 1
        assert c.metric("corral_requests_total", model="alpha", status="504") == 1
        assert c.app.state.gateway.intake.pending("alpha") == 0

    run(tmp_path, models, test)


# --- coalescing ---------------------------------------------------------------------------------


def test_concurrent_embeddings_go_to_the_server_as_one_request(tmp_path: Path) -> None:
    models = """
  emb:
    upstream: {echo}
    batch: {max_size: 8, max_wait_ms: 200}
"""

    async def test(c: Corral) -> None:
        texts = ["a", "bb", "ccc", "dddd"]
        answers = await asyncio.gather(
            *(c.client.post("/v1/embeddings", json={"model": "emb", "input": t}) for t in texts)
        )
        assert [r.status_code for r in answers] == [200] * 4
        assert [r.json()["data"][0]["embedding"] for r in answers] == [[1.0], [2.0], [3.0], [4.0]]
        assert {r.headers["x-corral-batch-size"] for r in answers} == {"4"}
        (seen,) = c.echo.seen
        assert sorted(seen.json()["input"]) == texts

    run(tmp_path, models, test)


def test_embeddings_past_the_coalescing_queue_are_503_with_retry_after(tmp_path: Path) -> None:
    models = """
  emb:
    upstream: {echo}
    batch: {max_size: 8, max_wait_ms: 300, max_queued: 2}
"""

    async def test(c: Corral) -> None:
        first = asyncio.ensure_future(
            c.client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
        )
        await asyncio.sleep(0.05)
        over = await c.client.post("/v1/embeddings", json={"model": "emb", "input": "c"})
        assert over.status_code == 503
        assert openai_error(over)["code"] == "batch_queue_full"
        assert over.headers["retry-after"] == "1"
        assert (await first).status_code == 200

    run(tmp_path, models, test)


# --- the Ollama door: the same pipeline, its own error shape ----------------------------------


def test_ollama_chat_goes_through_the_pipeline_and_answers_in_ollama_shape(
    tmp_path: Path,
) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post(
            "/api/chat",
            json={
                "model": "alpha",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": False,
            },
        )
        assert r.status_code == 200
        body = r.json()
        assert body["message"]["content"] == "echo alpha"
        assert body["done"] is True
        assert c.echo.seen[0].path == "/v1/chat/completions"

    run(tmp_path, ONE, test)


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/chat", b'{"model": "nobody", "messages": []}', 404, "not found"),
        ("/api/chat", b'{"model": "alpha", ', 400, "not valid JSON"),
        ("/api/generate", b'{"prompt": "x"}', 400, "missing `model`"),
        ("/api/show", b'{"model": "nobody"}', 404, "not found"),
        ("/api/show", b"[]", 400, "must be a JSON object"),
    ],
)
def test_ollama_refusals_are_in_ollama_shape(
    tmp_path: Path, path: str, body: bytes, status: int, says: str
) -> None:
    async def test(c: Corral) -> None:
        r = await c.client.post(path, content=body)
        assert r.status_code == status
        assert set(r.json()) == {"error"}
        assert isinstance(r.json()["error"], str)
        assert says in r.json()["error"]
        counted = c.metric("corral_requests_total", model="", status=str(status))
        assert counted == (path != "/api/show")  # a model request's refusal is counted once

    run(tmp_path, ONE, test)


def test_an_ollama_request_past_a_full_queue_keeps_retry_after(tmp_path: Path) -> None:
    models = """
  alpha:
    upstream: {echo}
    max_queue: 1
"""

    async def test(c: Corral) -> None:
        holder = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=chat(hold=1)))
        while not c.echo.seen:
            await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=chat()))
        while c.app.state.gateway.intake.pending("alpha") < 1:
            await asyncio.sleep(0.01)
        r = await c.client.post(
            "/api/chat", json={"model": "alpha", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 429
        assert "max_queue" in r.json()["error"]
        assert r.headers["retry-after"]
        c.echo.release.set()
        assert [(await t).status_code for t in (holder, waiter)] == [200, 200]

    run(tmp_path, models, test)


def test_the_model_list_names_every_served_model(tmp_path: Path) -> None:
    models = (
        ONE
        + """
  beta:
    upstream: {echo}
"""
    )

    async def test(c: Corral) -> None:
        r = await c.client.get("/v1/models")
        assert r.status_code == 200
        assert {m["id"] for m in r.json()["data"]} >= {"alpha", "beta"}
        r = await c.client.get("/v1/models/nobody")
        assert r.status_code == 404
        assert openai_error(r)["code"] == "model_not_found"

    run(tmp_path, models, test)
