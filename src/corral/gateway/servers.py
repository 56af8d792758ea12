"""The model servers a configuration names: a started process (`cmd`) or an upstream, and
which of them can run twice at once."""

from __future__ import annotations

from corral.backends.base import Backend
from corral.backends.process import ProcessBackend, ProcessSpec
from corral.backends.sleep import Napper
from corral.backends.upstream import Hook, UpstreamBackend
from corral.config import HookConfig, ModelConfig


def process_spec(name: str, m: ModelConfig) -> ProcessSpec:
    assert m.cmd is not None
    env = dict(m.env)
    if m.sleep is not None and m.sleep.api == "vllm":
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # vLLM serves /sleep and /wake_up only so
    return ProcessSpec(
        model=name,
        cmd=m.cmd,
        proxy=m.proxy,
        env=env,
        check_endpoint=None if m.check_endpoint.lower() == "none" else m.check_endpoint,
        health_timeout_s=m.health_timeout_s,
        stop_grace_s=m.stop_grace_s,
        cmd_stop=m.cmd_stop,
        served_name=m.upstream_model,
    )


def runs_once(b: Backend) -> bool:
    """An upstream, or a started server on a fixed port (no `${PORT}` in `proxy`): it can
    have no second copy, on another device or while it stops."""
    return not isinstance(b, ProcessBackend) or "${PORT}" not in b.spec.proxy


def napper(name: str, m: ModelConfig) -> Napper | None:
    """How `m`'s server sleeps and wakes (None without `sleep:`)."""
    if m.sleep is None:
        return None
    return Napper(
        name,
        m.sleep.api,
        m.sleep.level,
        m.upstream_model or name,
        m.sleep.warmup,
        m.health_timeout_s,
    )


def upstream_backend(name: str, m: ModelConfig) -> UpstreamBackend:
    assert m.upstream is not None

    def hook(h: HookConfig | None) -> Hook | None:
        return None if h is None else Hook(h.method, h.path, h.json_body)

    # An upstream is checked only if asked: Ollama, for one, has no /health.
    check = m.check_endpoint if "check_endpoint" in m.model_fields_set else None
    return UpstreamBackend(
        name,
        m.upstream,
        m.upstream_model,
        hook(m.load_hook),
        hook(m.unload_hook),
        None if check is None or check.lower() == "none" else check,
        m.health_timeout_s,
        m.upstream_api_key,
        napper(name, m),
    )
