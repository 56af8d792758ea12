"""The model servers a configuration names: a started process (`cmd`) or an upstream, and
which of them can run twice at once; `Servers`, a part the `Gateway` owns, knows which runs
where."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from corral.backends.base import Backend
from corral.backends.logs import LogLimits
from corral.backends.orphans import ServerRecord
from corral.backends.process import ProcessBackend, ProcessSpec
from corral.backends.sleep import Napper
from corral.backends.upstream import Hook, UpstreamBackend
from corral.config import HookConfig, ModelConfig
from corral.modelfiles.engine_memory import (
    QUIET,
    READY_LINE,
    EngineFigures,
    reporting,
    split_command,
)
from corral.modelfiles.serving import Memory
from corral.prompt_cache.caches import PromptCaches, Serving, serving
from corral.prompt_cache.server import ServerCache

log = logging.getLogger("corral.gateway")


def process_spec(
    name: str, m: ModelConfig, cmd: str | None = None, env_default: Mapping[str, str] = {}
) -> ProcessSpec:
    """How `m`'s server is started; `cmd`: its command as Corral runs it (default: `m.cmd`);
    `env_default`: variables set unless the model's `env` sets them."""
    assert m.cmd is not None
    env = {**env_default, **m.env}
    if m.sleep is not None and m.sleep.api == "vllm":
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # vLLM serves /sleep and /wake_up only so
    cmd = cmd or m.cmd
    # Packed by what its load allocated: llama-server says so at a verbosity it is started at.
    verbose = reporting(cmd) if m.memory_from_server else None
    return ProcessSpec(
        model=name,
        cmd=verbose or cmd,
        quiet_after_ready=QUIET if verbose else None,
        ready_line=READY_LINE if verbose else None,
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


class Servers:
    """The gateway's model servers, the one owner of which runs where: each model's own server
    (`backends`), a second copy's beside it (a replica on another device: `copy`), the server
    running on each (model, device) (`on`), and the own servers whose stop still waits for its
    device. Runs on the serving loop. `exited(model, server, code)` hears a server that died.
    `caches`: the prompt caches kept across swaps (each started server of a model that keeps
    them gets its own `ServerCache`, `cache_of`)."""

    def __init__(
        self,
        log_dir: Path,
        exited: Callable[[str, Backend, int], None],
        caches: PromptCaches | None = None,
        figures: EngineFigures | None = None,
        log_limits: LogLimits = LogLimits(),
    ) -> None:
        self.log_dir = log_dir
        self.log_limits = log_limits  # each server's log is rotated at these
        self.caches = caches
        self.figures = figures  # what each llama-server reported it allocated (`measured_gb`)
        # The servers this gateway runs, so the next one stops them if this one is killed.
        self.record = ServerRecord(log_dir / "servers.pids")
        self.backends: dict[str, Backend] = {}
        self.on: dict[tuple[str, str], Backend] = {}
        self._spares: dict[tuple[str, str], ProcessBackend] = {}
        # A model's own server whose stop waits for its device: it starts again after.
        self._stopping: dict[str, asyncio.Future[None]] = {}
        self._exited = exited

    def add(self, name: str, m: ModelConfig) -> None:
        """The server of model `name` as `m` describes it, for its next load (none without
        `cmd` or `upstream`); a copy running now keeps its own until it unloads."""
        self.backends.pop(name, None)
        for key in [k for k in self._spares if k[0] == name]:
            del self._spares[key]  # spare copies of the old command
        if m.cmd is not None:
            cmd, keeps, env = m.cmd, False, {}
            if self.caches is not None:
                plan = serving(m, self.caches.settings, self.caches.folder)
                if plan.on and not self.caches.usable():
                    folder = self.caches.folder
                    plan = Serving(m.cmd, False, f"the folder {folder} cannot be written")
                cmd, keeps, env = plan.cmd or m.cmd, plan.on, plan.env
                if plan.why:
                    log.warning("model %s: prompt caches not kept across swaps: %s", name, plan.why)
            spec = process_spec(name, m, cmd, env)
            backend = ProcessBackend(
                spec, self.log_dir, record=self.record, log_limits=self.log_limits
            )
            backend.on_exit = functools.partial(self._exited, name, backend)
            if keeps:
                self._keep_caches(name, backend)
            self.backends[name] = backend
        elif m.upstream is not None:
            self.backends[name] = upstream_backend(name, m)

    def _keep_caches(self, model: str, backend: ProcessBackend) -> None:
        assert self.caches is not None
        backend.hooks = self.caches.server(model, backend.spec.cmd)

    @staticmethod
    def cache_of(backend: Backend) -> ServerCache | None:
        """The prompt caches of `backend`'s server, if it keeps them and runs now with them."""
        if not isinstance(backend, ProcessBackend):
            return None
        cache = backend.hooks
        return cache if isinstance(cache, ServerCache) and cache.active else None

    async def measured_gb(self, backend: Backend, m: ModelConfig) -> float | None:
        """What `backend`'s server reported its load just now allocated, in GB on its device,
        kept in the engine's figures for the next start; None unless `m.memory_from_server`
        and the server said (llama-server's buffer lines)."""
        figures = self.figures
        if figures is None or not m.memory_from_server or not isinstance(backend, ProcessBackend):
            return None
        argv = split_command(backend.spec.cmd, 0)

        def read() -> int | None:  # the log read and the figures file written, off the loop
            return figures.after_load(argv, backend.output_since_start())

        size = await asyncio.to_thread(read)
        return None if size is None else round(Memory(size, "measured").gb, 3)

    def prompt_cache_view(self, model: str) -> dict[str, float | int | str] | None:
        """`model`'s prompt-cache figures (/api/status), None if it keeps none."""
        own = self.backends.get(model)
        if self.caches is None or not isinstance(own, ProcessBackend):
            return None
        if not isinstance(own.hooks, ServerCache):
            return None
        return self.caches.view(model)

    def backend_on(self, model: str, device: str | None) -> Backend:
        """The server of `model`'s copy on `device` (a dispatched request's `device`)."""
        if device is not None:
            backend = self.on.get((model, device))
            if backend is not None:
                return backend
        return self.backends[model]

    def copies(self, model: str) -> list[str]:
        """The devices where `model` runs or loads."""
        return [d for (m, d) in self.on if m == model]

    def copyable(self) -> list[str]:
        """Models that may run twice at once (a replica): started servers whose port Corral
        picks (`${PORT}` in `proxy`). An upstream, or a server on a fixed port, runs once."""
        return [name for name, b in self.backends.items() if not runs_once(b)]

    def every(self) -> list[Backend]:
        """Every server this gateway made (to stop them all)."""
        return [*self.backends.values(), *self._spares.values(), *self.on.values()]

    def free(self, model: str, device: str) -> Backend | None:
        """A server object for `model` on `device`: the model's own, unless another copy uses
        it or it is still stopping elsewhere (an eviction whose stop waits for its device). A
        server that runs once (a fixed port) is always its own: `load` starts it after its stop."""
        own = self.backends.get(model)
        if (
            not isinstance(own, ProcessBackend)
            or runs_once(own)
            or (not own.running and own not in self.on.values())
        ):
            return own
        backend = self._spares.get((model, device))  # beside its own, kept for the next time
        if backend is None:
            backend = ProcessBackend(
                own.spec,
                self.log_dir,
                record=self.record,
                label=device,
                log_limits=self.log_limits,
            )
            backend.on_exit = functools.partial(self._exited, model, backend)
            if isinstance(own.hooks, ServerCache):
                self._keep_caches(model, backend)
            self._spares[model, device] = backend
        return backend

    def stop_pending(self, model: str, backend: Backend | None) -> None:
        """`backend` is to stop: if it is `model`'s own, its next start waits for that."""
        if backend is not None and backend is self.backends.get(model):
            self._stopping.setdefault(model, asyncio.get_running_loop().create_future())

    def stopped(self, model: str, backend: Backend) -> None:
        if backend is self.backends.get(model):
            done = self._stopping.pop(model, None)
            if done is not None and not done.done():
                done.set_result(None)

    def stopping(self, model: str, backend: Backend | None) -> asyncio.Future[None] | None:
        """The stop `backend` (if it is `model`'s own server) must wait for before it starts."""
        if backend is None or backend is not self.backends.get(model):
            return None
        return self._stopping.get(model)
