"""llama-server's slot API through `prompt_cache.slots`, on a real llama-server with
the packaged gemma GGUF: a conversation's cache saved to a file and restored into a slot is
reused (its prompt is not processed again) and gives the same answer at temperature 0; a
truncated, foreign or missing file is refused with a clear `SlotError`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.backends.process import free_port
from corral.prompt_cache.keys import chat_keys
from corral.prompt_cache.slots import SlotError, Slots
from corral.prompt_cache.states import SavedState, SavedStates, fingerprint
from tests.helpers import wait_http_ok
from tests.support.gemma import gemma_gguf

SERVER = Path(sys.executable).parent / "llama-cpp-server"
# llama-server's own flags (after the wrapper's `--`); --swa-full: gemma3's sliding-window
# cache restores only whole (llama.cpp #26676).
FLAGS = ["--parallel", "2", "--swa-full", "--no-repack"]
SYSTEM = "You answer in one word. " + "Rayleigh scattering makes the sky blue. " * 30
ASKED = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of Italy?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    gguf = gemma_gguf(tmp_path_factory.mktemp("gguf") / "gemma.gguf")
    saves = tmp_path_factory.mktemp("saves")
    port = free_port()
    cmd = [str(SERVER), "-m", str(gguf), "--port", str(port), "--ctx-size", "4096", "--"]
    cmd += [*FLAGS, "--slot-save-path", str(saves)]
    log_path = saves.parent / "llama-server.log"
    log = log_path.open("wb")
    # Its own process group: the `llama-cpp-server` wrapper exits on SIGTERM before the
    # llama-server it started, which a signal to the wrapper alone left running after the suite.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            assert proc.poll() is None, log_path.read_text()[-2000:]
            with contextlib.suppress(AssertionError):
                wait_http_ok(f"{url}/health", timeout_s=0.5)
                break
        else:
            pytest.fail(f"llama-server did not start: {log_path.read_text()[-2000:]}")
        yield url, gguf, saves
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


def chat(url: str, slot: int) -> dict[str, Any]:
    body = {"messages": ASKED, "max_tokens": 6, "temperature": 0, "id_slot": slot}
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "cache_prompt": True}, timeout=300)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def test_a_restored_state_is_reused_and_answers_the_same(server: tuple[str, Path, Path]) -> None:
    url, gguf, saves = server

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            slots = Slots(url, client)
            assert [s.id for s in await slots.list()] == [0, 1]
            first = chat(url, 0)
            assert first["timings"]["cache_n"] == 0  # processed whole
            prompt_n = first["timings"]["prompt_n"]
            states = SavedStates(saves, max_bytes=10**9, min_tokens=100)
            states.load()
            name = states.new_file("gemma")
            saved = await slots.save(0, name)
            assert saved.tokens >= prompt_n
            assert saved.bytes == (saves / name).stat().st_size
            made = fingerprint(gguf, ["--ctx-size", "4096", *FLAGS])
            assert states.worth_saving(saved.tokens)
            states.add(
                SavedState(name, "gemma", made, chat_keys(ASKED), saved.tokens, saved.bytes, 0.0)
            )
            # The server stops and starts again: here, slot 1 never saw the conversation.
            best = states.best("gemma", made, chat_keys(ASKED))
            assert best is not None
            restored = await slots.restore(1, best[0].file)
            assert restored.tokens == saved.tokens
            again = chat(url, 1)
            assert again["timings"]["cache_n"] >= prompt_n - 1  # not processed again
            assert again["timings"]["prompt_n"] <= 2
            assert (
                again["choices"][0]["message"]["content"]
                == first["choices"][0]["message"]["content"]
            )
            assert await slots.erase(1) >= saved.tokens

    asyncio.run(run())


def test_a_truncated_missing_or_unsafe_file_is_refused_clearly(
    server: tuple[str, Path, Path],
) -> None:
    url, _, saves = server

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            slots = Slots(url, client)
            chat(url, 0)
            saved = await slots.save(0, "whole.state")
            (saves / "cut.state").write_bytes(
                (saves / "whole.state").read_bytes()[: saved.bytes // 3]
            )
            for name in ("cut.state", "absent.state"):
                with pytest.raises(SlotError, match=r"POST /slots/1: 400: Unable to restore slot"):
                    await slots.restore(1, name)
            with pytest.raises(SlotError, match="Invalid filename"):
                await slots.restore(1, "../escape.state")
            with pytest.raises(SlotError, match="ConnectError"):
                await Slots("http://127.0.0.1:9", client).list()

    asyncio.run(run())
