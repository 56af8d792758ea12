"""Restores into a llama-server whose KV cache is full, through `corral serve` on the real
server and the packaged gemma GGUF. llama-server refuses a restore into a unified cache
without room for it ("No available space in KV cache"), and a request that does not fit makes
it drop idle slots' caches unsaved; Corral makes room first (the least recently used idle slot,
saved, then erased), so a conversation that comes back is restored and reused, and the one
that made room comes back in its turn. Which servers share one cache among their slots is
read from their flags as llama-server itself reads them (checked against its own `/slots`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.backends.process import free_port
from corral.modelfiles.folder import find_llama_server
from corral.prompt_cache.blame import kv_unified
from tests.e2e.test_prompt_cache import SERVER, SYSTEM, gguf, index, serving
from tests.helpers import wait_http_ok

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

__all__ = ["gguf"]  # the module's fixture, shared

CONTEXT = 768  # the whole cache: two of these conversations fit in it, three do not


def talk(who: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"{who}. {SYSTEM}"}, {"role": "user", "content": who}]


@pytest.mark.parametrize(
    "flags", ["", "--parallel 2", "--parallel 2 -kvu", "--parallel 3 --kv-unified"]
)
def test_which_servers_share_one_cache_is_read_as_llama_server_reads_it(
    gguf: Path, flags: str
) -> None:
    port = free_port()
    binary = str(find_llama_server())
    argv = [binary, "-m", str(gguf), "--port", str(port), "-c", "1024", *flags.split()]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=120)
        slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    shared = all(s["n_ctx"] == 1024 for s in slots) and len(slots) > 1
    split = all(s["n_ctx"] == 1024 // len(slots) for s in slots)
    assert shared != split  # the server says one or the other
    assert kv_unified(argv) is shared


def test_a_full_cache_makes_room_and_every_conversation_comes_back_reused(
    gguf: Path, tmp_path: Path
) -> None:
    states = tmp_path / "states"
    cmd = f"{SERVER} -m {gguf} --port ${{PORT}} --ctx-size {CONTEXT} -- --no-repack"
    text = f"""
devices: [{{name: cpu}}]
prompt_cache: {{dir: {states}, max_gb: 1, min_tokens: 64}}
models:
  a: {{cmd: "{cmd}", load_s: 2, health_timeout_s: 240}}
  b: {{cmd: "{cmd}", load_s: 2, health_timeout_s: 240}}
"""
    with serving(tmp_path, text) as g:
        first = g.chat("a", talk("Alice"))
        assert 2 * first["usage"]["prompt_tokens"] < CONTEXT < 3 * first["usage"]["prompt_tokens"]
        g.chat("b", talk("Bob"))  # a swap: Alice's conversation is saved
        g.chat("a", talk("Carol"))
        g.chat("a", talk("Dave"))  # Carol and Dave fill two thirds of the cache and more
        back = g.chat("a", talk("Alice"))  # no room for Alice's beside both: Carol's slot makes it
        assert back["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] // 2
        view = g.cache("a")
        assert (view["restores"], view["honoured"], view["restore_failures"]) == (1, 1, 0)
        assert view["no_room"] == 0  # room was made, not waited for
        saved = [s for s in index(states) if s["model"] == "a"]
        assert len(saved) == 2  # Alice's, and Carol's saved before its slot was erased
        carol = g.chat("a", talk("Carol"))  # its turn: restored (Dave's slot makes room)
        assert carol["timings"]["cache_n"] >= carol["usage"]["prompt_tokens"] // 2
        view = g.cache("a")
        assert (view["restores"], view["honoured"], view["restore_failures"]) == (2, 2, 0)
        assert view["not_honoured"] == 0
