"""Prompt caches kept across swaps, through `corral serve` on real llama-server
processes with the packaged gemma GGUF, two models on a device that holds one at a time: a
conversation comes back after a swap restored, not processed again, through every door (the
official openai, anthropic and ollama clients; chat and completions), with the same answer at
temperature 0; states outlive a restart of Corral; a truncated, missing or foreign state is
dropped with a log line and the request is answered; the budget holds; a full disk stops
saving, never serving."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import pytest

from corral.backends.process import free_port
from corral.prompt_cache.server import conversation_keys
from tests.helpers import wait_http_ok
from tests.support.disks import tmpfs
from tests.support.gateway import CORRAL
from tests.support.gemma import gemma_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SERVER = Path(sys.executable).parent / "llama-cpp-server"
SYSTEM = "You answer in one word. " + "Rayleigh scattering makes the sky blue. " * 30
# llama-server places an Anthropic request itself (it drops `id_slot`), in the slot whose
# cached prompt is most like it: a system prompt of its own keeps it off the others' slots.
OTHER_SYSTEM = "Reply tersely. " + "Sea water is salty because rivers carry minerals. " * 25


def config(gguf: Path, states: Path, extra: str = "", flags: str = "", budget: float = 1) -> str:
    cmd = f"{SERVER} -m {gguf} --port ${{PORT}} --ctx-size 8192 -- --parallel 4 --no-repack"
    return f"""
devices: [{{name: cpu}}]
prompt_cache: {{dir: {states}, max_gb: {budget}, min_tokens: 64}}
models:
  a: {{cmd: "{cmd} {flags}", load_s: 2, health_timeout_s: 240}}
  b: {{cmd: "{cmd}", load_s: 2, health_timeout_s: 240}}
{extra}"""


class Served:
    """One `corral serve`, its stderr in a file (read while it runs)."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def chat(self, model: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, **kw}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def cache(self, model: str) -> dict[str, Any]:
        view: dict[str, Any] = httpx.get(f"{self.url}/api/status").json()["models"][model]
        figures: dict[str, Any] = view["prompt_cache"]
        return figures

    def logged(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serving(folder: Path, text: str) -> Iterator[Served]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corral.yaml").write_text(text)
    port = free_port()
    log = folder / f"corral-{port}.log"
    env = {**os.environ, "XDG_DATA_HOME": str(folder / "data")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CORRAL, "serve", "--config", str(folder / "corral.yaml"), "--listen",
             f"127.0.0.1:{port}"],
            stderr=out, env=env,
        )  # fmt: skip
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60)
            yield Served(f"http://127.0.0.1:{port}", log)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma_gguf(tmp_path_factory.mktemp("gguf") / "gemma.gguf")


def conversation(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def conversation_keys_of(question: str) -> list[str]:
    return conversation_keys({"messages": conversation(question)})


def index(states: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads((states / "index.json").read_text())["states"]
    return entries


def test_a_conversation_comes_back_restored_with_the_same_answer(
    gguf: Path, tmp_path: Path
) -> None:
    states = tmp_path / "states"
    with serving(tmp_path, config(gguf, states)) as g:
        asked = conversation("What is the capital of Italy?")
        fresh = g.chat("a", asked)
        assert fresh["timings"]["cache_n"] == 0  # a new server: processed whole
        g.chat("b", conversation("Name a colour."))  # a swap: a's server stops, saved first
        (saved,) = index(states)
        assert saved["model"] == "a"
        assert saved["tokens"] >= fresh["usage"]["prompt_tokens"]
        assert (states / saved["file"]).stat().st_size == saved["bytes"]
        back = g.chat("a", asked)  # a swap back: restored before it is sent
        assert back["timings"]["cache_n"] >= fresh["usage"]["prompt_tokens"] - 1
        assert back["timings"]["prompt_n"] <= 1
        assert back["choices"][0]["message"] == fresh["choices"][0]["message"]
        view = g.cache("a")
        assert view["restores"] == 1
        assert view["restored_tokens"] >= fresh["usage"]["prompt_tokens"]
        assert g.cache("b")["restores"] == 0
        metrics = httpx.get(f"{g.url}/metrics").text
        assert 'corral_prompt_cache_restores_total{model="a"} 1.0' in metrics
        # The conversation goes on: the next turn reuses the restored state and its answer.
        going_on = [*asked, back["choices"][0]["message"], {"role": "user", "content": "And?"}]
        more = g.chat("a", going_on)
        assert more["timings"]["cache_n"] >= fresh["usage"]["prompt_tokens"]


def test_every_door_keeps_its_conversation_across_a_swap(gguf: Path, tmp_path: Path) -> None:
    states = tmp_path / "states"
    with serving(tmp_path, config(gguf, states)) as g:
        claude = anthropic.Anthropic(base_url=g.url, api_key="unused", max_retries=0, timeout=300)
        llama = ollama.Client(host=g.url, timeout=300)

        def by_anthropic() -> str:
            out = claude.messages.create(
                model="a", system=OTHER_SYSTEM, max_tokens=6, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "What is the capital of Spain?"}],
            )  # fmt: skip
            return "".join(b.text for b in out.content if b.type == "text")

        def by_ollama() -> str:
            out = llama.chat(
                model="a", messages=conversation("What is the capital of Peru?"),
                options={"temperature": 0, "num_predict": 6},
            )  # fmt: skip
            return out.message.content or ""

        def by_completions() -> str:
            body = {"model": "a", "prompt": SYSTEM * 2 + "\nQ: 2+2?\nA:", "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            r = httpx.post(f"{g.url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        def by_openai() -> str:
            return str(g.chat("a", conversation("Capital of Chile?"))["choices"][0]["message"])

        doors = [by_openai, by_anthropic, by_ollama, by_completions]
        for door in doors:
            door()
        # Asked again, each answer comes from its slot's cache: llama-server evaluates only the
        # prompt's last token again, as it does after a restore. (Against the first, computed
        # whole, a 270M model's greedy choice can flip on that token's rounding: it did on an
        # AMD EPYC build, "<|im_end|>" for "What".)
        first = [door() for door in doors]
        g.chat("b", conversation("Name a colour."))  # a stops: its four slots are saved
        assert sorted(e["model"] for e in index(states)) == ["a"] * 4
        for n, door in enumerate(doors, 1):
            assert door() == first[n - 1], door.__name__  # the same answer, restored
            assert g.cache("a")["restores"] == n, door.__name__


def test_states_outlive_a_restart_and_untrusted_ones_are_dropped(
    gguf: Path, tmp_path: Path
) -> None:
    states = tmp_path / "states"
    questions = ["Capital of Italy?", "Capital of Japan?", "Capital of Kenya?", "Capital of Peru?"]
    with serving(tmp_path / "one", config(gguf, states)) as g:
        fresh = {q: g.chat("a", conversation(q)) for q in questions}
    # Corral stopped: a's server was saved on the way out (four conversations, four slots).
    saved = {e["file"]: e for e in index(states)}
    assert len(saved) == 4
    files = sorted(saved)
    with (states / files[0]).open("r+b") as f:  # truncated
        f.truncate(1000)
    (states / files[1]).unlink()  # missing
    corrupt = saved[files[2]]  # its size as the index says, its bytes not a state
    (states / files[2]).write_bytes(b"\0" * corrupt["bytes"])
    whole = saved[files[3]]
    with serving(tmp_path / "two", config(gguf, states)) as g:
        logged = g.logged()
        assert "truncated?" in logged
        assert "is missing" in logged
        assert sorted(e["file"] for e in index(states)) == sorted([corrupt["file"], whole["file"]])
        for q in questions:
            back = g.chat("a", conversation(q))
            assert back["choices"][0]["message"] == fresh[q]["choices"][0]["message"]
            prompt = fresh[q]["usage"]["prompt_tokens"]
            if conversation_keys_of(q) == whole["keys"]:  # its own state: nothing again
                assert back["timings"]["cache_n"] >= prompt - 1
            elif conversation_keys_of(q) == corrupt["keys"]:  # refused, dropped: all again
                assert back["timings"]["cache_n"] == 0
            else:  # the state left shares the system prompt: that much is not processed again
                assert 0 < back["timings"]["cache_n"] < prompt - 1
        assert g.cache("a")["restore_failures"] == 1
        assert "its restore failed" in g.logged()
        assert corrupt["file"] not in [e["file"] for e in index(states)]
    # Another server's flags: its states are foreign, never restored.
    with serving(tmp_path / "three", config(gguf, states, flags="--temp 0.5")) as g:
        back = g.chat("a", conversation(questions[2]))
        assert back["timings"]["cache_n"] == 0
        assert g.cache("a")["restores"] == 0


def test_the_budget_holds_and_a_full_disk_stops_saving_not_serving(
    gguf: Path, tmp_path: Path
) -> None:
    states = tmp_path / "states"
    budget_gb = 12e6 / 1024**3  # about one state of this size
    with serving(tmp_path / "budget", config(gguf, states, budget=budget_gb)) as g:
        for q in ["Capital of Italy?", "Capital of Japan?"]:
            g.chat("a", conversation(q))
            g.chat("b", conversation("Name a colour."))
        kept = index(states)
        assert sum(e["bytes"] for e in kept) <= 12e6
        assert len([p for p in states.iterdir() if p.suffix == ".state"]) == len(kept)
    full = tmp_path / "full"
    with tmpfs(full, "64k"), serving(tmp_path / "disk", config(gguf, full)) as g:
        asked = conversation("Capital of Italy?")
        fresh = g.chat("a", asked)
        g.chat("b", conversation("Name a colour."))
        back = g.chat("a", asked)  # nothing could be saved: processed whole, answered
        assert back["choices"][0]["message"] == fresh["choices"][0]["message"]
        assert back["timings"]["cache_n"] == 0
        view = g.cache("a")
        assert view["saves"] == 0
        assert view["save_failures"] >= 1
        assert "not saved" in g.logged() or "dropped" in g.logged()
