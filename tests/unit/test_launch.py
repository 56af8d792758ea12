"""`corral launch TOOL`: each tool's configuration from Corral's model listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.cli.launch import Listed, listed, plan, roles, shown

DEMO = {
    "data": [
        {"id": "orchestrator-14b", "capabilities": {"function_calling": True}},
        {"id": "explorer-3b", "capabilities": {"function_calling": True}},
        {"id": "coder-7b", "context_length": 32768, "capabilities": {"function_calling": True}},
        "not a model",
        {"id": 7},
    ]
}


def test_the_listing_gives_each_models_context_and_tools() -> None:
    models = listed(DEMO)
    assert [m.id for m in models] == ["orchestrator-14b", "explorer-3b", "coder-7b"]
    assert models[2].context == 32768
    assert models[2].output == 8192  # a quarter of the context, at most 8,192
    assert models[0].context == 8192  # unsaid: the default
    assert models[0].output == 2048
    assert all(m.tools for m in models)


def test_roles_by_name_else_by_context() -> None:
    main, small = roles(listed(DEMO))
    assert (main.id, small.id) == ("coder-7b", "explorer-3b")
    plain = [Listed("a", 4096, True), Listed("b", 32768, True), Listed("c", 2048, False)]
    main, small = roles(plain)
    assert (main.id, small.id) == ("b", "c")
    with pytest.raises(ValueError, match="no models"):
        roles([])


def test_each_tool_points_at_corral_with_its_models(tmp_path: Path) -> None:
    models = listed(DEMO)
    url = "http://127.0.0.1:9999"
    oc = plan("opencode", url, models, tmp_path)
    (path, text), *_ = oc.files.items()
    assert oc.env == {"OPENCODE_CONFIG": str(path)}
    config = json.loads(text)
    provider = config["provider"]["corral"]
    assert provider["options"]["baseURL"] == f"{url}/v1"
    assert provider["models"]["coder-7b"]["limit"] == {"context": 32768, "output": 8192}
    assert (config["model"], config["small_model"]) == ("corral/coder-7b", "corral/explorer-3b")
    assert config["agent"] == {"explore": {"model": "corral/explorer-3b"}}  # its sub-agent
    aider = plan("aider", url, models, tmp_path)
    assert aider.argv[:5] == ["aider", "--model", "openai/coder-7b", "--weak-model",
                              "openai/explorer-3b"]  # fmt: skip
    meta, settings = aider.files.values()
    assert json.loads(meta)["openai/coder-7b"]["max_input_tokens"] == 32768
    # Its output limit, which aider sends as max_tokens only from a model's settings (YAML).
    import yaml

    limits = {x["name"]: x["extra_params"]["max_tokens"] for x in yaml.safe_load(settings)}
    assert limits["openai/coder-7b"] == 8192
    assert aider.argv[-2] == "--model-settings-file"
    claude = plan("claude", url, models, tmp_path)
    assert claude.env["ANTHROPIC_BASE_URL"] == url
    assert claude.env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "explorer-3b"
    codex = plan("codex", url, models, tmp_path)
    assert f'base_url="{url}/v1"' in " ".join(codex.argv)
    assert codex.argv[-2:] == ["-m", "coder-7b"]
    assert "OPENCODE_CONFIG=" in shown(oc)
    with pytest.raises(ValueError, match="no tool"):
        plan("vim", url, models, tmp_path)
