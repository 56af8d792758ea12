"""llama-swap's config format, mapped onto Corral's, so its users can switch with the file they
have: `corral serve --config llama-swap.yaml`. Every key is either mapped or reported as ignored
with the reason (`corral config check` prints both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from corral.config import Config, parse_config, read_config_text
from corral.errors import ConfigError, Problem

# Keys only llama-swap's format has: one of them marks a file as llama-swap's.
_TOP_ONLY = {
    "healthCheckTimeout",
    "startPort",
    "macros",
    "groups",
    "hooks",
    "logLevel",
    "globalTTL",
    "apiKeys",
    "includeAliasesInList",
    "metricsMaxInMemory",
    "logRequests",
}
_MODEL_ONLY = {
    "cmdStop",
    "checkEndpoint",
    "concurrencyLimit",
    "ttl",
    "name",
    "description",
    "filters",
    "useModelName",
    "macros",
}
_RESERVED = {"PORT", "MODEL_ID", "PID"}
_MACRO = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_-]*)\}")


@dataclass
class Mapping:
    """What became of each llama-swap key: `mapped` (from -> to) and `ignored` (key, reason)."""

    mapped: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)


def looks_like_llama_swap(data: object) -> bool:
    """True for a parsed YAML document in llama-swap's format rather than Corral's."""
    if not isinstance(data, dict):
        return False
    if _TOP_ONLY & set(data):
        return True
    models = data.get("models")
    if isinstance(models, dict):
        return any(isinstance(m, dict) and _MODEL_ONLY & set(m) for m in models.values())
    return False


def _expand(text: str, macros: dict[str, str], where: str, problems: list[Problem]) -> str:
    """Substitute user macros (which may use each other); leave Corral's own ones."""
    for _ in range(10):  # macros may refer to macros; a cycle is an error, not a hang

        def one(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in _RESERVED or name.startswith("env."):
                return m.group(0)
            if name not in macros:
                problems.append(Problem("", None, where, f"unknown macro ${{{name}}}"))
                return m.group(0)
            return macros[name]

        expanded = _MACRO.sub(one, text)
        if expanded == text:
            return expanded
        text = expanded
    problems.append(Problem("", None, where, "macros refer to each other in a cycle"))
    return text


def convert(data: dict[str, Any], source: str) -> tuple[Config, Mapping]:
    """A llama-swap document as a Corral `Config`, and what was mapped or ignored."""
    out = Mapping()
    problems: list[Problem] = []
    macros = {str(k): str(v) for k, v in (data.get("macros") or {}).items()}
    if macros:
        out.mapped.append(("macros", "substituted into cmd, cmdStop, proxy and env"))
    health_timeout = data.get("healthCheckTimeout")
    if health_timeout is not None:
        out.mapped.append(("healthCheckTimeout", "models.*.health_timeout_s"))
    if "startPort" in data:
        out.ignored.append(("startPort", "Corral gives each ${PORT} a port the OS reports free"))
    for key, why in (
        ("logLevel", "Corral logs at INFO; per-model server output goes to server.log_dir"),
        ("includeAliasesInList", "/v1/models lists model ids only"),
        ("metricsMaxInMemory", "Corral exports Prometheus metrics at /metrics"),
        ("logRequests", "not supported"),
    ):
        if key in data:
            out.ignored.append((key, why))
    global_ttl = data.get("globalTTL")
    if global_ttl is not None:
        out.mapped.append(("globalTTL", "models.*.ttl_s (where a model sets no ttl)"))
    server: dict[str, Any] = {}
    if data.get("apiKeys"):
        server["api_keys"] = [str(k) for k in data["apiKeys"]]
        out.mapped.append(("apiKeys", "server.api_keys"))
    models: dict[str, dict[str, Any]] = {}
    for name, m in (data.get("models") or {}).items():
        if not isinstance(m, dict):
            problems.append(Problem(source, None, f"models.{name}", "must be a mapping"))
            continue
        where = f"models.{name}"
        own = {**macros, **{str(k): str(v) for k, v in (m.get("macros") or {}).items()}}
        model: dict[str, Any] = {}
        if "cmd" in m:
            model["cmd"] = " ".join(_expand(str(m["cmd"]), own, f"{where}.cmd", problems).split())
        if "cmdStop" in m:
            model["cmd_stop"] = _expand(str(m["cmdStop"]), own, f"{where}.cmdStop", problems)
        model["proxy"] = _expand(
            str(m.get("proxy", "http://127.0.0.1:${PORT}")), own, f"{where}.proxy", problems
        ).replace("localhost", "127.0.0.1")
        env = m.get("env") or []
        if env:
            pairs = {}
            for item in env:
                k, sep, v = str(item).partition("=")
                if not sep:
                    problems.append(Problem(source, None, f"{where}.env", f"{item!r} is not K=V"))
                    continue
                pairs[k] = _expand(v, own, f"{where}.env.{k}", problems)
            model["env"] = pairs
        if "checkEndpoint" in m:
            model["check_endpoint"] = str(m["checkEndpoint"])
        if health_timeout is not None:
            model["health_timeout_s"] = float(health_timeout)
        if m.get("aliases"):
            model["aliases"] = [str(a) for a in m["aliases"]]
        if "unlisted" in m:
            model["unlisted"] = m["unlisted"] is True
            out.mapped.append((f"{where}.unlisted", f"{where}.unlisted"))
        ttl = m.get("ttl", global_ttl)
        if "ttl" in m:
            out.mapped.append((f"{where}.ttl", f"{where}.ttl_s"))
        if ttl is not None:
            try:
                seconds = float(ttl)
            except (TypeError, ValueError):
                problems.append(Problem(source, None, f"{where}.ttl", f"{ttl!r} is not seconds"))
            else:
                if seconds > 0:  # llama-swap's 0 (and negative) means never
                    model["ttl_s"] = seconds
        if "concurrencyLimit" in m:
            model["max_queue"] = int(m["concurrencyLimit"])
            out.mapped.append((f"{where}.concurrencyLimit", f"{where}.max_queue"))
        for key, why in (
            ("name", "display only"),
            ("description", "display only"),
            ("filters", "request rewriting is not supported"),
            ("useModelName", "the backend receives Corral's model id"),
        ):
            if key in m:
                out.ignored.append((f"{where}.{key}", why))
        models[str(name)] = model
    devices = _map_groups(data.get("groups") or {}, models, source, out, problems)
    hooks = data.get("hooks") or {}
    for key, value in hooks.items() if isinstance(hooks, dict) else ():
        startup = value if key == "on_startup" and isinstance(value, dict) else {}
        for hook, what in startup.items():
            if hook == "preload":
                server["preload"] = [str(x) for x in what or []]
                out.mapped.append(("hooks.on_startup.preload", "server.preload"))
            else:
                out.ignored.append((f"hooks.on_startup.{hook}", "not supported"))
        if key != "on_startup":
            out.ignored.append((f"hooks.{key}", "not supported"))
    if problems:
        raise ConfigError([Problem(source, p.line, p.where, p.message) for p in problems])
    doc: dict[str, Any] = {"models": models}
    if devices:
        doc["devices"] = devices
    if server:
        doc["server"] = server
    return parse_config(yaml.safe_dump(doc, sort_keys=False), source), out


_SHARED = "shared"


def _map_groups(
    groups: dict[str, Any],
    models: dict[str, dict[str, Any]],
    source: str,
    out: Mapping,
    problems: list[Problem],
) -> list[dict[str, Any]]:
    """llama-swap's groups as Corral devices; returns the devices (none without groups).

    Exclusive groups (the default) and ungrouped models share the device "shared": loading one
    of them evicts what it needs room from, as llama-swap's exclusive unloads other groups.
    A persistent or non-exclusive group stays up beside the others: it gets a device of its
    own. Each model may use only its group's device. In a `swap: false` group the members fit
    side by side: sizes then count members (memory_gb = slots, not gigabytes)."""
    if not groups:
        return []
    home: dict[str, str] = {}
    sizes: dict[str, dict[str, float]] = {}  # device -> member -> size, None for "fills it"
    capacity: dict[str, float] = {_SHARED: 1.0}
    for gname, g in groups.items():
        where = f"groups.{gname}"
        if not isinstance(g, dict):
            problems.append(Problem(source, None, where, "must be a mapping"))
            continue
        members = [str(m) for m in g.get("members") or []]
        for member in members:
            if member not in models:
                problems.append(Problem(source, None, where, f"member {member!r} is no model"))
            elif member in home:
                problems.append(
                    Problem(source, None, where, f"{member!r} is also in group {home[member]!r}")
                )
        swap = g.get("swap", True) is not False
        own = g.get("persistent", False) is True or g.get("exclusive", True) is False
        device = f"group-{gname}" if own else _SHARED
        slots = float(len(members)) if not swap and members else 1.0
        capacity[device] = max(capacity.get(device, 1.0), slots)
        for member in members:
            if member in models and member not in home:
                home[member] = gname
                sizes.setdefault(device, {})[member] = slots  # divided below by capacity
        why = (
            "persistent: a device of its own, so other groups never evict it"
            if g.get("persistent", False) is True
            else "not exclusive: a device of its own, beside the other groups"
            if own
            else "exclusive: shares device 'shared' with the other exclusive groups"
        )
        out.mapped.append((where, f"device {device!r}: {why}"))
        out.mapped.append(
            (
                f"{where}.swap",
                "one member at a time" if swap else "members loaded side by side",
            )
        )
    for name in models:
        if name not in home:
            sizes.setdefault(_SHARED, {})[name] = 1.0  # llama-swap's default group
    devices: list[dict[str, Any]] = []
    for device, held in sizes.items():
        cap = capacity[device]
        sized = cap > 1.0
        devices.append({"name": device, **({"memory_gb": cap} if sized else {})})
        for member, slots in held.items():
            models[member]["devices"] = [device]
            if sized:
                models[member]["memory_gb"] = cap / slots
    return devices


def load_any(text: str, source: str) -> tuple[Config, Mapping | None]:
    """Corral's format or llama-swap's, whichever `text` is."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None  # parse_config reports it with its line
    if looks_like_llama_swap(data):
        assert isinstance(data, dict)
        return convert(data, source)
    return parse_config(text, source), None


def load_config_file(path: str | Path) -> tuple[Config, Mapping | None]:
    """Read a configuration file in Corral's or llama-swap's format (see `load_any`)."""
    return load_any(read_config_text(path), str(path))
