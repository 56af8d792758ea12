"""What a replay runs (`corral replay`, sim/replay.py): the configuration `corral serve` gets
for it (sim backends at `speed`, every time scaled alike, a key per principal of the trace),
and the checks a trace and a speed must pass first."""

from __future__ import annotations

import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from corral.config import Config
from corral.errors import CorralError
from corral.sim.trace import Trace

TOKENS_PER_S = 1000.0  # sim backends produce one token a millisecond: service time resolution


class ReplayError(CorralError):
    """The replay could not run (a bad trace for live use, a server that did not start)."""


def live_config(
    config: Config,
    speed: float,
    port: int,
    folder: Path,
    own_backends: bool = False,
    principals: Collection[str] = (),
) -> dict[str, Any]:
    """`config` as `corral serve` runs it for a replay: sim backends with the configuration's
    times divided by `speed`, every other time scaled alike, files under `folder`.
    `own_backends`: the models' own commands (real servers) are kept, at the trace's speed.
    `principals`: the trace's; each gets a key (`principal_key`), with the weight and class
    the configuration gives it, and the replay itself an admin's (`ADMIN_KEY`)."""
    if own_backends and speed != 1:
        raise ReplayError(f"a replay on the models' own servers runs at 1x, not {speed:g}x")
    spec = config.model_dump(mode="json", by_alias=True, exclude_none=True)

    def scale(d: dict[str, Any], *keys: str) -> None:
        for k in keys:
            if d.get(k) is not None:
                d[k] = d[k] / speed

    for name, m in spec["models"].items():
        m["max_queue"] = 10_000_000  # the trace decides the load; nothing is refused
        m["request_timeout_s"] = 10_000_000
        if own_backends:
            continue
        scale(m, "load_s", "unload_s", "service_s", "unload_delay_s", "ttl_s", "min_resident_s")
        for key in ("cmd", "upstream", "upstream_model", "load_hook", "unload_hook", "cmd_stop"):
            m.pop(key, None)
        m["cmd"] = (
            f"{sys.executable} -m corral sim-backend --model {name} --port ${{PORT}} "
            f"--load-s {m['load_s']:.6f} --unload-s {m['unload_s']:.6f} "
            f"--parallel {m.get('concurrency', 1)} --tokens-per-s {TOKENS_PER_S:g}"
        )
        nap = m.get("sleep")
        if nap is not None:  # a server that sleeps and wakes in the configured times
            # A level-2 wake reloads the weights (`--wake2-s`): the model's deep wake, its
            # `wake_s` when it is configured at level 2.
            deep_s = config.models[name].deep_wake_s / speed
            scale(nap, "wake_s", "sleep_s", "wake2_s")
            m["cmd"] += (
                f" --sleep-s {nap['sleep_s']:.6f} --wake-s {nap['wake_s']:.6f} "
                f"--wake2-s {deep_s:.6f} --memory-gb {m.get('memory_gb', 0):g}"
            )
        prefill = config.models[name].prefill_tok_s
        if prefill is not None:  # conversations: a prompt cache per slot, and its slot API
            state_tok_s = config.prompt_cache.state_tok_s * speed
            m["cmd"] += f" --prefill-tok-s {prefill * speed:.6f} --state-tok-s {state_tok_s:.6f}"
            m["prompt_cache"] = config.keeps_prompt_cache(name)  # the sim's rule, said outright
        m["stop_grace_s"] = m["unload_s"] + 10
    cache = spec.get("prompt_cache", {})
    if cache.get("enabled", True):
        cache["state_tok_s"] = cache.get("state_tok_s", 200_000.0) * speed
        cache["dir"] = str(folder / "prompt-cache")
    scale(spec["scheduler"], "max_wait_s")
    scale(spec["scheduler"]["cost"], "age_weight_s")
    scale(spec.setdefault("batch", {}), "max_wait_s")
    spec["batch"]["max_lines"] = max(spec["batch"].get("max_lines", 0), 1_000_000)
    spec["batch"]["max_queued_requests"] = 100_000_000
    spec["batch"]["max_queued_batches"] = 1_000_000
    spec["server"] = {
        "listen": f"127.0.0.1:{port}",
        "log_dir": str(folder / "logs"),
        "data_dir": str(folder / "data"),
        "store": f"sqlite:///{folder / 'corral.db'}",
    }
    if principals:
        spec["server"]["api_keys"] = [ADMIN_KEY]
        spec["server"]["principals"] = _principals(config, principals)
    return spec


def _principals(config: Config, names: Collection[str]) -> dict[str, Any]:
    """`server.principals` for a replay: each of `names` with its key, and the weight and
    class the configuration gives it."""
    configured = config.server.principals
    return {
        name: {
            "keys": [principal_key(name)],
            **(
                configured[name].model_dump(mode="json", include={"weight", "highest_class"})
                if name in configured
                else {}
            ),
        }
        for name in sorted(names)
    }


ADMIN_KEY = "replay-admin"  # the replay's own calls: batches, status, events


def principal_key(name: str | None) -> str:
    """The key a replayed line of principal `name` is sent with (None: the admin's)."""
    return ADMIN_KEY if name is None else f"replay-{name}"


def auth_headers(name: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {principal_key(name)}"}


# A sim backend is a Python process: it cannot be ready sooner than its interpreter starts.
STARTUP_FLOOR_S = 0.5


def too_fast(config: Config, speed: float) -> list[str]:
    """Models whose scaled load is shorter than a sim backend can start: their live loads
    take longer than the trace says (lower `speed`)."""
    return [
        f"{name} (loads in {m.load_s / speed:.2f} s at {speed:g}x)"
        for name, m in config.models.items()
        if m.load_s / speed < STARTUP_FLOOR_S
    ]


def check_replayable(trace: Trace) -> None:
    """Batch lines go through the Batch API: open loop, at the batch priority."""
    problems = [
        f"line {x.line}: a batch line must be open loop (no `session`)"
        for x in trace.lines
        if x.background and x.session is not None
    ] + [
        f"line {x.line}: batch lines run at `batch.priority` (the Batch API has no per-line "
        "priority); drop `priority`"
        for x in trace.lines
        if x.background and x.priority
    ]
    if problems:
        raise ReplayError("this trace cannot be replayed live:\n  " + "\n  ".join(problems[:20]))
