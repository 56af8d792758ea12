"""The gateway's prompt caches (`PromptCaches`): the saved states on disk, which models keep
theirs (`serving`: the command that starts a model's server, with the flags that make restores
exact), and what they did (saves, restores, tokens not processed again), per model.

Which models: `config.server.prompt_cache_why_not` (the configuration decides, so that the
scheduler prices swaps the same way)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral.atomic import LatestText
from corral.backends.process import escape_macros
from corral.config import ModelConfig, PromptCacheConfig
from corral.config.server import prompt_cache_why_not
from corral.prompt_cache.blame import CAUSES, Cause, StateFacts, no_facts
from corral.prompt_cache.server import ServerCache
from corral.prompt_cache.slots import Moved
from corral.prompt_cache.states import SavedStates

log = logging.getLogger("corral.prompt_cache")

# What makes a restore exact: without --swa-full a sliding-window model's saved cache is not
# reused (llama.cpp #26676): the whole conversation is processed again.
EXACT = ("--swa-full",)
# What keeps every restore: on a new task llama-server saves its idle slots to its RAM prompt
# cache and, with a unified KV cache (its default), clears them, so of several conversations
# restored into one server only the first request's was reused (make bench-slot-restores).
# An environment variable, not a flag: a server without the setting ignores it.
KEEP_IDLE_SLOTS = ("LLAMA_ARG_CACHE_IDLE_SLOTS", "false")
VERDICTS = "verdicts.json"  # in the states' folder: server fingerprint -> why not kept
MAX_VERDICTS = 1024
# A model found not kept is tried again (a probe: its next server saves, the one after restores)
# after this many starts of its servers; each probe its state explains failing doubles the wait.
PROBE_FIRST_STARTS = 4
PROBE_MAX_STARTS = 64


def recorded_verdicts(folder: Path) -> dict[str, str]:
    """The prompt caches found not kept in earlier runs: server fingerprint -> why. A file
    that cannot be read or trusted is no verdict (the restores are verified again)."""
    return _whys(_read_verdicts(folder))


def _read_verdicts(folder: Path) -> dict[str, object]:
    try:
        raw = json.loads((folder / VERDICTS).read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _whys(raw: dict[str, object]) -> dict[str, str]:
    # Only a verdict the model's state explains is one (older records, without a cause, may
    # have blamed the model for a placement's failure).
    return {
        k: v["why"]
        for k, v in raw.items()
        if isinstance(k, str)
        and isinstance(v, dict)
        and isinstance(v.get("why"), str)
        and v.get("cause") == "model_state"
    }


def folder_of(settings: PromptCacheConfig, log_dir: Path) -> Path:
    """Where the saved states live: `prompt_cache.dir`, else beside the servers' logs."""
    return Path(settings.dir).expanduser() if settings.dir else log_dir / "prompt-cache"


@dataclass(frozen=True, slots=True)
class Serving:
    """How a model's server is started: `cmd` and `env` (set where the model's own `env`
    does not say), and whether its prompt caches are kept (`on`); `why` says why not, where it
    could have been."""

    cmd: str | None
    on: bool
    why: str = ""
    env: dict[str, str] = field(default_factory=dict)


def serving(m: ModelConfig, settings: PromptCacheConfig, folder: Path) -> Serving:
    """`m`'s command with the prompt cache's flags (`--slot-save-path folder`, `--swa-full`)
    and idle slots kept in its KV cache (`KEEP_IDLE_SLOTS`, unless its command or `env`
    names that setting) when its prompt caches are kept (`prompt_cache_why_not`), else as it
    is."""
    cmd = m.cmd
    why = prompt_cache_why_not(m, settings)
    if cmd is None or why is not None:
        return Serving(cmd, False, why or "")
    argv = shlex.split(cmd)
    extra = ["--slot-save-path", shlex.quote(escape_macros(str(folder)))]
    extra += [f for f in EXACT if f not in argv]
    if Path(argv[0]).name == "llama-cpp-server" and "--" not in argv:
        extra.insert(0, "--")  # the wrapper passes what follows `--` to llama-server
    name, value = KEEP_IDLE_SLOTS
    said = name in m.env or any("cache-idle-slots" in a for a in argv)
    return Serving(f"{cmd} {' '.join(extra)}", True, env={} if said else {name: value})


@dataclass
class CacheStats:
    """What one model's prompt caches did since Corral started."""

    saves: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    save_failures: int = 0
    restores: int = 0
    restored_tokens: int = 0  # tokens its server did not process again
    restore_ms: float = 0.0
    restore_failures: int = 0
    no_room: int = 0  # restores put off: the server's KV cache had no room (busy slots held it)
    honoured: int = 0  # restores whose tokens the next answer reused (its timings say)
    not_honoured: int = 0  # restores the server reported, then processed the prompt again
    # The not honoured ones by cause (blame.py): only `model_state` is the model's own.
    not_honoured_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))


class PromptCaches:
    """The saved states of every model (one folder, one budget) and their figures."""

    def __init__(
        self,
        settings: PromptCacheConfig,
        folder: Path,
        timeout_s: float = 30.0,
        state_facts: Callable[[Path | None], StateFacts | None] = no_facts,
    ):
        """`state_facts`: what a model's file says of its state (which restores its own state
        explains failing: blame.py); it reads files, and is called off the serving loop."""
        self.settings = settings
        self.state_facts = state_facts
        self.folder = folder
        self.timeout_s = timeout_s
        self.states = SavedStates(
            folder, int(settings.max_gb * 1024**3), min_tokens=settings.min_tokens
        )
        self._stats: dict[str, CacheStats] = {}
        self._loaded = False
        self._verdicts: dict[str, object] = {}  # verdicts.json as read at `load`, then kept
        self._verdicts_file = LatestText(
            folder / VERDICTS,
            failed=lambda exc: log.warning(
                "prompt cache: verdicts not kept for the next run: %s", exc
            ),
        )
        self._lost: dict[str, str] = {}  # model -> why its prompt caches are not kept
        # The restores each model's state explained failing against those honoured, since its
        # caches were (again) kept: what a verdict weighs.
        self._tally: dict[str, tuple[int, int]] = {}
        self._starts: dict[str, int] = {}  # a model not kept: its servers' starts since
        self._probe_every: dict[str, int] = {}  # ... and how many make a probe
        self._probing: set[str] = set()  # not kept, saved and restored once more to verify
        # Told when a model's prompt caches turn out not to be kept (the scheduler prices its
        # swaps as a whole prefill again from then on), and when a probe finds them kept again.
        self.on_lost: Callable[[str], None] | None = None
        self.on_found: Callable[[str], None] | None = None

    def load(self) -> None:
        """Read back the states and verdicts earlier runs saved (once; it reads files: call
        it before serving, or off the loop)."""
        if not self._loaded:
            self._loaded = True
            self.states.load()
            self._verdicts = _read_verdicts(self.folder)

    def usable(self) -> bool:
        """Whether the folder is there to be written: llama-server refuses to start with a
        --slot-save-path that is not a folder, so without one no server gets the flag."""
        self.load()
        return self.folder.is_dir() and os.access(self.folder, os.W_OK | os.X_OK)

    def server(self, model: str, cmd: str) -> ServerCache:
        """The prompt caches of a new server of `model`, started by `cmd`."""
        self.load()
        return ServerCache(model, cmd, self)

    def stats(self, model: str) -> CacheStats:
        return self._stats.setdefault(model, CacheStats())

    def saved(self, model: str, moved: Moved) -> None:
        s = self.stats(model)
        s.saves += 1
        s.saved_bytes += moved.bytes
        s.save_ms += moved.ms
        log.info(
            "model %s: saved a conversation of %d tokens (%d bytes, %.0f ms)",
            model,
            moved.tokens,
            moved.bytes,
            moved.ms,
        )

    def restored(self, model: str, moved: Moved) -> None:
        s = self.stats(model)
        s.restores += 1
        s.restored_tokens += moved.tokens
        s.restore_ms += moved.ms

    def kept(self, model: str) -> bool:
        """Whether `model`'s states are saved and restored now: unless its restores proved
        useless, and then during a probe (`recall`)."""
        return model not in self._lost or model in self._probing

    def recall(self, model: str, fingerprint: str) -> None:
        """A server of `model` made as `fingerprint` says started: if an earlier run found such
        a server's restores useless, its caches are not kept from the start. A model not kept
        is probed once every `PROBE_FIRST_STARTS` of its servers' starts (doubling after each
        probe that fails, up to `PROBE_MAX_STARTS`): this server saves its conversations
        again and the next restores them, and a restore reused brings it back (`verdict`)."""
        self.load()
        why = _whys(self._verdicts).get(fingerprint) if fingerprint else None
        if why is not None and model not in self._lost:
            self._lose(model, f"{why} (found in an earlier run; tried again every few starts)")
        if model not in self._lost or model in self._probing:
            return
        starts = self._starts.get(model, 0) + 1
        if starts < self._probe_every.setdefault(model, PROBE_FIRST_STARTS):
            self._starts[model] = starts
            return
        self._starts[model] = 0
        self._probing.add(model)
        log.info(
            "model %s: prompt caches tried again: this server saves its conversations and the "
            "next restores them; one reused brings them back",
            model,
        )

    def verdict(
        self,
        model: str,
        restored: int,
        reused: int,
        fingerprint: str = "",
        cause: Cause = "dropped",
    ) -> None:
        """After a restore of `restored` tokens, the server reused `reused` of the prompt. At
        least half: honoured (a model not kept is kept again: `on_found` is told). Less: not
        honoured, counted by its `cause` (blame.py). Only `model_state` is the model's own (a
        hybrid's or recurrent model's state cannot be rolled back to where the conversation
        goes on; a sliding-window one's without --swa-full): once those outnumber honoured
        restores since the model's caches were last kept, they are not kept: said once with
        why, nothing is saved or restored for it but probes (`recall`), and `on_lost` is told.
        The other causes are the placement's or the conversation's: no verdict."""
        s = self.stats(model)
        honoured, failed = self._tally.get(model, (0, 0))
        if 2 * reused >= restored:
            s.honoured += 1
            self._tally[model] = (honoured + 1, failed)
            if model in self._lost:
                self._found(model, restored, reused, fingerprint)
            return
        s.not_honoured += 1
        s.restore_failures += 1
        s.not_honoured_by[cause] += 1
        if cause != "model_state":
            return
        self._tally[model] = (honoured, failed + 1)
        if model in self._lost:
            if model in self._probing:  # the probe failed: the next waits twice as long
                self._probing.discard(model)
                every = self._probe_every.get(model, PROBE_FIRST_STARTS)
                self._probe_every[model] = min(2 * every, PROBE_MAX_STARTS)
            return
        if failed + 1 <= honoured:
            return
        why = (
            f"its server restored {restored} tokens of a saved conversation and then reused "
            f"{reused} of them (timings.cache_n): it processed the prompt again, as a model "
            "whose state cannot be rolled back does (hybrid and recurrent models; "
            "sliding-window ones without --swa-full)"
        )
        self._lose(model, why)
        if fingerprint:
            self._record(fingerprint, model, why)

    def _lose(self, model: str, why: str) -> None:
        self._lost[model] = why
        self._starts[model] = 0
        log.warning(
            "model %s: prompt caches not kept across swaps from now on: %s; its swaps are "
            "priced as the whole prefill again",
            model,
            why,
        )
        if self.on_lost is not None:
            self.on_lost(model)

    def _found(self, model: str, restored: int, reused: int, fingerprint: str) -> None:
        del self._lost[model]
        self._probing.discard(model)
        self._starts.pop(model, None)
        self._probe_every.pop(model, None)
        self._tally[model] = (1, 0)
        log.warning(
            "model %s: prompt caches kept again: its server reused %d of %d restored tokens",
            model,
            reused,
            restored,
        )
        if fingerprint:
            self._record(fingerprint, model, None)
        if self.on_found is not None:
            self.on_found(model)

    def _record(self, fingerprint: str, model: str, why: str | None) -> None:
        """Keep the verdict for the next runs (None: forget it; the oldest go past
        MAX_VERDICTS), written off the loop; a folder that cannot be written keeps it for this
        run only."""
        kept = self._verdicts
        if why is None:
            if kept.pop(fingerprint, None) is None:
                return
        else:
            kept[fingerprint] = {
                "model": model,
                "why": why,
                "at": time.time(),
                "cause": "model_state",
            }
        while len(kept) > MAX_VERDICTS:
            del kept[next(iter(kept))]
        self._verdicts_file.write(json.dumps(kept))

    def written(self, timeout_s: float | None = None) -> bool:
        """Block until the states' index and the verdicts on disk are the latest."""
        return self.states.written(timeout_s) and self._verdicts_file.wait(timeout_s)

    def verified(self, model: str) -> str:
        """`kept and verified` (a restore was honoured), `kept` (none verified yet), or
        `not kept: why`."""
        if model in self._lost:
            trying = "; trying again now" if model in self._probing else ""
            return f"not kept: {self._lost[model]}{trying}"
        return "kept and verified" if self.stats(model).honoured else "kept"

    def view(self, model: str) -> dict[str, float | int | str]:
        """The figures /api/status shows for `model`."""
        held = self.states.states(model)
        s = self.stats(model)
        return {
            "verified": self.verified(model),
            "honoured": s.honoured,
            "not_honoured": s.not_honoured,
            **{f"not_honoured_{cause}": n for cause, n in s.not_honoured_by.items()},
            "states": len(held),
            "bytes": sum(x.bytes for x in held),
            "saves": s.saves,
            "save_failures": s.save_failures,
            "restores": s.restores,
            "restore_failures": s.restore_failures,
            "no_room": s.no_room,
            "restored_tokens": s.restored_tokens,
            "save_ms": round(s.save_ms, 1),
            "restore_ms": round(s.restore_ms, 1),
        }
