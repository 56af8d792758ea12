"""The built-in demo that `corral serve` runs without a config: three simulated model servers
with realistic load times, like an agent framework's orchestrator, explorer and coder."""

from __future__ import annotations

import json
import shlex
import sys

from corral.config import Config, parse_config

# name: (load_s, tokens_per_s, parallel, aliases, answer_tokens). Each answers like a model:
# about answer_tokens long whatever max_tokens a client sends (OpenCode sends 32,000).
DEMO_MODELS = {
    "orchestrator-14b": (6.0, 30.0, 1, ["orchestrator"], 60),
    "explorer-3b": (2.0, 90.0, 2, ["explorer"], 80),
    "coder-7b": (4.0, 45.0, 1, ["coder"], 120),
}


def demo_config(listen: str = "127.0.0.1:8080") -> Config:
    python = shlex.quote(sys.executable)
    models = {}
    for name, (load_s, tps, parallel, aliases, answer_tokens) in DEMO_MODELS.items():
        models[name] = {
            "load_s": load_s,
            "unload_s": 0.5,
            "concurrency": parallel,
            "aliases": aliases,
            "cmd": f"{python} -m corral sim-backend --model ${{MODEL_ID}} --port ${{PORT}} "
            f"--load-s {load_s:g} --tokens-per-s {tps:g} --parallel {parallel} "
            f"--answer-tokens {answer_tokens}",
            "stop_grace_s": 2,
            # The sim answers tools (tool_choice honoured): said, so clients offer them.
            "capabilities": {
                "inputs": ["text"],
                "outputs": ["text"],
                "tools": True,
                "context": 32768,
            },
        }
    return parse_config(
        json.dumps({"models": models, "server": {"listen": listen}}), "<built-in demo>"
    )
