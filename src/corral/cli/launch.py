"""`corral launch TOOL`: an agent tool wired to a running Corral in one command, as
`ollama launch` does for Ollama: the tool's configuration made from Corral's model listing (its
models by role, each one's context and a sane output limit, the provider that speaks Corral's
API), then the tool started with it, unchanged. `--print` shows what it would run instead.

Tools: OpenCode (an OpenAI-compatible provider, its config in `OPENCODE_CONFIG`), aider (the
OpenAI provider, a model metadata file for the context, a settings file for the output limit,
which it sends as `max_tokens`), Claude Code (Anthropic's variables) and
Codex (a `model_providers` entry given with `-c`, the Responses API)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from corral.console import fail, out_console

TOOLS = ("opencode", "aider", "claude", "codex")
DEFAULT_CONTEXT = 8192  # a model whose listing says no context
KEY = "corral"  # any key: Corral checks none unless server.api_keys says so


@dataclass(frozen=True)
class Listed:
    """A model as Corral's /v1/models lists it."""

    id: str
    context: int
    tools: bool

    @property
    def output(self) -> int:
        """The output limit a tool asks for: a quarter of the context, at most 8,192 (OpenCode
        asks 32,000 by default, more than a local model's whole window)."""
        return max(256, min(self.context // 4, 8192))


def listed(data: dict[str, Any]) -> list[Listed]:
    """The models of a /v1/models answer."""
    out = []
    for m in data.get("data") or []:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        ctx = m.get("context_length")
        raw = m.get("capabilities")
        caps: dict[str, Any] = raw if isinstance(raw, dict) else {}
        tools = bool(caps.get("function_calling")) or "tools" in (
            m.get("supported_parameters") or []
        )
        context = ctx if isinstance(ctx, int) and ctx > 0 else DEFAULT_CONTEXT
        out.append(Listed(m["id"], context, tools))
    return out


def roles(models: list[Listed]) -> tuple[Listed, Listed]:
    """The main model and the small one (titles, summaries, a weak model): by name where the
    names say (coder, orchestrator; explorer, small, mini), else the widest context and the
    narrowest, tool-capable first."""
    if not models:
        raise ValueError("Corral serves no models: nothing to launch a tool on")

    def named(*words: str) -> Listed | None:
        return next((m for w in words for m in models if w in m.id.lower()), None)

    ranked = sorted(models, key=lambda m: (not m.tools, -m.context))
    main = named("coder", "orchestrator", "main") or ranked[0]
    small = named("explorer", "small", "mini", "fast") or ranked[-1]
    return main, small


@dataclass(frozen=True)
class Launch:
    """What starts the tool: its command, the environment it adds, files to write first."""

    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str]


def plan(tool: str, url: str, models: list[Listed], home: Path) -> Launch:
    """How `tool` is started on the Corral at `url` serving `models`; `home`: where its
    configuration files go."""
    main, small = roles(models)
    v1 = f"{url.rstrip('/')}/v1"
    if tool == "opencode":
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "corral": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "Corral",
                    "options": {"baseURL": v1, "apiKey": KEY},
                    "models": {
                        m.id: {
                            "name": m.id,
                            "tool_call": m.tools,
                            "limit": {"context": m.context, "output": m.output},
                        }
                        for m in models
                    },
                }
            },
            "model": f"corral/{main.id}",
            "small_model": f"corral/{small.id}",
            # Its explore sub-agent (`@explore`, or the task tool) on the small model: the
            # orchestrator, explorer, coder split that Corral keeps each resident for.
            "agent": {"explore": {"model": f"corral/{small.id}"}},
        }
        path = home / "opencode.json"
        text = json.dumps(config, indent=2)
        return Launch(["opencode"], {"OPENCODE_CONFIG": str(path)}, {path: text})
    if tool == "aider":
        meta = {
            f"openai/{m.id}": {
                "max_input_tokens": m.context,
                "max_output_tokens": m.output,
                "litellm_provider": "openai",
                "mode": "chat",
            }
            for m in models
        }
        # aider sends no max_tokens unless a model's settings say so (`extra_params`): a small
        # model that never stops would write until its whole context is full.
        settings = [{"name": f"openai/{m.id}", "extra_params": {"max_tokens": m.output}}
                    for m in models]  # fmt: skip
        path = home / "aider.model.metadata.json"
        settings_path = home / "aider.model.settings.yml"  # JSON is YAML
        argv = ["aider", "--model", f"openai/{main.id}", "--weak-model", f"openai/{small.id}",
                "--openai-api-base", v1, "--openai-api-key", KEY,
                "--model-metadata-file", str(path),
                "--model-settings-file", str(settings_path)]  # fmt: skip
        files = {path: json.dumps(meta, indent=2), settings_path: json.dumps(settings, indent=2)}
        return Launch(argv, {}, files)
    if tool == "claude":
        env = {
            "ANTHROPIC_BASE_URL": url.rstrip("/"),
            "ANTHROPIC_AUTH_TOKEN": KEY,
            "ANTHROPIC_MODEL": main.id,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": main.id,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": main.id,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": small.id,
            "ANTHROPIC_SMALL_FAST_MODEL": small.id,
        }
        return Launch(["claude"], env, {})
    if tool == "codex":
        provider = (
            f'{{name="Corral", base_url="{v1}", wire_api="responses", env_key="CORRAL_API_KEY"}}'
        )
        argv = ["codex", "-c", f"model_providers.corral={provider}", "-c", "model_provider=corral",
                "-m", main.id]  # fmt: skip
        return Launch(argv, {"CORRAL_API_KEY": KEY}, {})
    raise ValueError(f"no tool {tool!r}; there are: {', '.join(TOOLS)}")


def shown(launch: Launch) -> str:
    """The launch as a person would type it (files first, then the command line)."""
    lines = [f"# {path}\n{text}" for path, text in launch.files.items()]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    lines.append(" ".join(filter(None, [env, shlex.join(launch.argv)])))
    return "\n".join(lines)


def launch_cmd(
    tool: Annotated[str, typer.Argument(help=f"The tool: {', '.join(TOOLS)}.")],
    url: Annotated[str, typer.Option(help="The running Corral.")] = "http://127.0.0.1:8080",
    print_only: Annotated[
        bool, typer.Option("--print", help="Print its configuration and command; start nothing.")
    ] = False,
    args: Annotated[
        list[str] | None, typer.Argument(help="Passed on to the tool (after --).")
    ] = None,
) -> None:
    """Start an agent tool (OpenCode, aider, Claude Code, Codex) on this Corral's models: its
    configuration made from Corral's model listing (main and small models, each one's context
    and output limit, the right provider), then the tool itself."""
    import httpx

    from corral.config import data_dir

    if tool not in TOOLS:
        raise fail(f"no tool {tool!r}; corral launch knows: {', '.join(TOOLS)}")
    try:
        answer = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10)
        answer.raise_for_status()
        models = listed(answer.json())
    except (httpx.HTTPError, ValueError) as exc:
        raise fail(
            f"no Corral answers at {url} ({exc}): start it (make run, or corral serve)"
        ) from None
    try:
        how = plan(tool, url, models, data_dir() / "launch")
    except ValueError as exc:
        raise fail(str(exc)) from None
    how = Launch(how.argv + list(args or []), how.env, how.files)
    if print_only:
        out_console.print(shown(how), markup=False, highlight=False, soft_wrap=True)
        return
    binary = shutil.which(how.argv[0])
    if binary is None:
        raise fail(
            f"{how.argv[0]} is not installed (or not on PATH); `corral launch {tool} --print` "
            "shows its configuration for Corral"
        )
    for path, text in how.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    os.execvpe(binary, how.argv, {**os.environ, **how.env})
