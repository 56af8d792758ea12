"""What Ollama's listings say of a model: clients cache a model's capabilities by
its digest, so the digest changes when the capabilities do; the demo's models say they take
tools (the sim answers them)."""

from __future__ import annotations

from corral.config.models import CapabilitiesConfig, ModelConfig
from corral.gateway.doors.ollama_routes import _capabilities, _entry
from corral.gateway.servers.demo import demo_config


def test_the_digest_changes_with_the_capabilities_and_only_then() -> None:
    plain = ModelConfig(cmd="server --port ${PORT}")
    tools = ModelConfig(cmd="server --port ${PORT}", capabilities=CapabilitiesConfig(tools=True))
    assert _entry("m", plain)["digest"] != _entry("m", tools)["digest"]
    assert _entry("m", tools)["digest"] == _entry("m", tools.model_copy())["digest"]


def test_the_demos_models_say_they_take_tools() -> None:
    config = demo_config()
    for m in config.models.values():
        assert "tools" in _capabilities(m)
