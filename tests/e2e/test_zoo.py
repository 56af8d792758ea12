"""The model zoo on the real llama-server: a folder of every zoo architecture served
by `corral serve --models DIR` with no YAML, each model answering through the OpenAI door (the
official openai client) and Ollama's (the official ollama client), tools included; the files'
tensors named as llama.cpp's own architecture test names them; `corral zoo` from the shell."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import ollama
import pytest

from corral.modelfiles.folder import find_llama_server
from corral.zoo import ARCHS
from tests.e2e.test_models_folder import serving
from tests.support.gateway import CORRAL
from tests.support.zoo import zoo_folder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo_folder(tmp_path_factory)


def test_every_zoo_model_answers_through_both_doors(zoo: Path, tmp_path: Path) -> None:
    names = [f"{a}-tiny" for a in ARCHS]
    gen = serving(["--models", str(zoo)], tmp_path)
    g, logged = next(gen)
    try:
        client = g.client(max_retries=0, timeout=120)
        assert sorted(m.id for m in client.models.list().data) == sorted(names)
        oc = ollama.Client(host=g.url, timeout=120)
        tags = {m.model or "": m for m in oc.list().models}
        assert sorted(tags) == sorted(f"{n}:latest" for n in names)
        for arch, name in zip(ARCHS, names, strict=True):
            out = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "Hello, who are you?"}],
                max_tokens=4,
                temperature=0,
            )
            assert out.usage is not None
            assert out.usage.prompt_tokens > 5  # the template and the text, tokenized
            assert 1 <= out.usage.completion_tokens <= 4
            # The template takes tools: llama-server is asked with them and answers.
            with_tools = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER],  # type: ignore[list-item]
                max_tokens=4,
            )
            assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")
            answer = oc.chat(
                model=name,
                messages=[{"role": "user", "content": "Hello"}],
                options={"num_predict": 4, "temperature": 0},
            )
            assert answer.done
            assert answer.eval_count
            shown = oc.show(name)
            assert (shown.modelinfo or {})["general.architecture"] == arch
            assert "tools" in (shown.capabilities or [])
        # Tiny models all fit the machine together: every one stayed loaded.
        states = {n: m["state"] for n, m in g.status()["models"].items()}
        assert states == dict.fromkeys(names, "ready")
    finally:
        for _ in gen:
            pass
    assert not [line for line in logged if "skipped" in line]
    # Each packed by llama-server's own projection for its command, kept for the next start.
    engine = [line for line in logged if "GB (engine; the file's estimate" in line]
    assert len(engine) == len(names), logged
    kept = json.loads((tmp_path / "data" / "corral" / "engine-memory.json").read_text())
    assert len(kept) == len(names)
    assert all(v["projected_bytes"] > 0 for v in kept.values())


def test_the_zoo_names_its_tensors_as_llama_cpps_own_architecture_test(
    zoo: Path, tmp_path: Path
) -> None:
    """llama.cpp's test-llama-archs (in the `llama` extra) writes a model of each architecture
    with every tensor its loader may take (fused where the loader takes fused or split ones);
    each of the zoo's tensors is one of them, or a part of a fused one."""
    server = find_llama_server()
    assert server is not None
    tool = Path(server).with_name("test-llama-archs")
    assert tool.exists(), tool
    ref = tmp_path / "ref"
    ref.mkdir()
    for arch in ARCHS:
        subprocess.run(
            [str(tool), "-a", f"^{arch}$", "-o", str(ref)], check=True, capture_output=True
        )
        (made,) = ref.glob(f"{arch}-*.gguf")

        ours, theirs = kinds(zoo / f"{arch}-tiny.gguf"), kinds(made)
        assert ours <= theirs, f"{arch}: {sorted(ours - theirs)}"
        made.unlink()


FUSED = {
    "ffn_gate_up_exps": ("ffn_gate_exps", "ffn_up_exps"),
    "attn_qkv": ("attn_q", "attn_k", "attn_v"),
}


def kinds(path: Path) -> set[str]:
    """A file's tensor names, any layer's as `blk.N.`, fused ones also as their parts."""
    from gguf import GGUFReader

    names = {re.sub(r"^blk\.\d+\.", "blk.N.", t.name) for t in GGUFReader(path).tensors}
    for fused, parts in FUSED.items():
        for name in list(names):
            if f".{fused}." in name:
                names |= {name.replace(fused, part) for part in parts}
    return names


def test_corral_zoo_writes_files_and_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    ok = subprocess.run(
        [CORRAL, "zoo", str(tmp_path), "--arch", "qwen35", "--arch", "deepseek2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepseek2-tiny.gguf", "qwen35-tiny.gguf"]
    assert "hybrid: Gated DeltaNet and attention" in ok.stdout
    bad = subprocess.run(
        [CORRAL, "zoo", str(tmp_path), "--arch", "mamba9"], capture_output=True, text=True
    )
    assert bad.returncode != 0
    assert "no zoo architecture mamba9; there are: qwen3, qwen3moe" in bad.stderr
    assert "Traceback" not in bad.stderr
