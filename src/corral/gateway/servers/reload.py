"""`corral serve --watch`: the config file and the models folders are watched
(`watchfiles`), and what changed takes effect without a restart and without dropping a request.

- A model added is served at once (its server starts on its first request, as any).
- A model whose server changed (its command, port, environment, upstream: what `process_spec`
  or the upstream is made of) gets the new server for its next load; the running copy takes no
  new work and unloads once its requests end (`Scheduler.on_restart_requested`), and the queue
  loads the new one. Other changes (priority, concurrency, memory, aliases) apply at once.
- A model removed answers 404 to new requests at once; the requests it holds finish, and it
  unloads once idle (`Scheduler.on_model_removed`).
- A bad edit changes nothing: the error (with its line, from the config's own checks) is
  logged and the previous configuration stays. Changes outside `models:` need a restart and
  say so. A file in a models folder that cannot be served is skipped with a logged line naming
  it and why; the other models are applied, and an error no check foresaw is logged
  without stopping the watch.

The configuration is read again off the event loop and out of the scheduler's process: `load`
runs in a child process at nice 10 (`corral.child`; a models folder's GGUF headers are read
there, and its new files projected by llama-server, which takes seconds), and its `Config`
comes back pickled; the live `Config` object is then changed in place on the loop (its
`models`), so every part that holds it sees the same models.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import watchfiles

from corral.child import ChildDied, ChildError, Children
from corral.config import Config, ModelConfig
from corral.errors import CorralError
from corral.gateway.servers.fleet import process_spec
from corral.gateway.servers.runtime import Gateway

log = logging.getLogger("corral.gateway")
NICE = 10  # a reload yields to the requests it must not delay
SETTLE_S = 0.25  # how often models being restarted or removed are looked at again


def _server(name: str, m: ModelConfig) -> object:
    """What a model's server is made of: a change here needs a new server."""
    if m.cmd is not None:
        return process_spec(name, m)
    return (m.upstream, m.upstream_model, m.upstream_api_key, m.load_hook, m.unload_hook)


class Reloader:
    def __init__(self, gateway: Gateway, paths: list[Path], load: Callable[[], Config]) -> None:
        """`load` reads the configuration again, in a child: a function defined at module
        level or a `functools.partial` of one."""
        self.gateway = gateway
        self.config = gateway.config
        self.paths = paths
        self.load = load
        self.children = Children("corral-reload", NICE)
        self.restarting: set[str] = set()
        self.removing: set[str] = set()

    async def run(self) -> None:
        """Watch until cancelled; each batch of file changes is one reload."""
        settle = asyncio.ensure_future(self._settle())
        try:
            async for _ in watchfiles.awatch(*self.paths, debounce=300, step=50):
                await self.reload()  # never raises: a dead watcher would stop reloading silently
        finally:
            settle.cancel()
            self.children.close()

    async def reload(self) -> list[str]:
        """Read the configuration again and apply it; returns what changed (also logged).
        Reading it (files, GGUF headers, the engine's memory projections: seconds for a folder
        of new models) runs in a child process, so no request or stream waits for it; applying it to
        the live configuration and the scheduler is quick and runs on the loop, which owns
        them. Changes made meanwhile are seen by the next reload."""
        redact = self.gateway.redact
        try:
            # Its secrets found in the thread too (every model's command split: 200 models
            # are tens of milliseconds); the redactor is immutable, replaced on the loop.
            new, redact = await asyncio.to_thread(
                lambda: (loaded := self.children.call(self.load), redact.with_config(loaded))
            )
        except ChildError as exc:  # a bad edit names itself; anything else, with its type
            why = str(exc) if exc.expected else f"{exc.type_name}: {exc}"
            log.error("config not reloaded, the previous one stays: %s", why)
            return []
        except (CorralError, ValueError, ChildDied) as exc:
            log.error("config not reloaded, the previous one stays: %s", exc)
            return []
        except Exception as exc:  # a bug reading some file: say so, keep watching
            log.error(
                "config not reloaded, the previous one stays: %s: %s",
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            return []
        # The new config's secrets are masked too (and the old ones still: their servers'
        # logs stay), before anything of it can reach a status page or a log.
        self.gateway.redact = redact
        lines = self.apply(new)
        for line in lines:
            log.info("config reloaded: %s", line)
        return lines

    def apply(self, new: Config) -> list[str]:
        old = self.config
        sched = self.gateway.scheduler
        assert sched is not None
        lines = [f"skipped {why}" for n, why in new.skipped.items() if old.skipped.get(n) != why]
        old.skipped.clear()
        old.skipped.update(new.skipped)
        for key in ("devices", "scheduler", "server", "batch"):
            if getattr(old, key) != getattr(new, key):
                lines.append(f"`{key}` changed: it takes effect at the next start")
        served = {n: m for n, m in new.models.items() if m.cmd or m.upstream}
        for name in [n for n in old.models if n not in served and n not in self.removing]:
            del old.models[name]  # new requests: 404 at once
            self.gateway.backends.pop(name, None)
            if name in sched.models:
                self.removing.add(name)
                sched.on_model_removed(name)
            lines.append(f"{name} removed (its requests finish first)")
        for name, m in served.items():
            before = old.models.get(name)
            if before is not None and before == m:
                continue
            if name in self.removing:  # back before it was gone: let it finish leaving first
                lines.append(f"{name}: still leaving; save again in a moment to add it back")
                continue
            old.models[name] = m
            if before is None:
                self.gateway.add_backend(name, m)
                sched.on_model_added(name, m)
                lines.append(f"{name} added")
                continue
            sched.on_model_changed(name, m)
            if _server(name, before) != _server(name, m):
                self.gateway.add_backend(name, m)  # for the next load
                self.restarting.add(name)
                if sched.on_restart_requested(name):
                    self.restarting.discard(name)
                lines.append(f"{name}: its server changed; it restarts once its requests end")
            else:
                lines.append(f"{name} changed")
        return lines

    async def _settle(self) -> None:
        """Restart a model that was loading when its server changed, once it is ready; forget
        a removed one once it is unloaded."""
        while True:
            await asyncio.sleep(SETTLE_S)
            sched = self.gateway.scheduler
            if sched is None:
                continue
            for name in list(self.restarting):
                if sched.on_restart_requested(name):
                    self.restarting.discard(name)
            for name in list(self.removing):
                if sched.on_model_removed(name):
                    self.removing.discard(name)
                    log.info("config reloaded: %s is gone", name)
