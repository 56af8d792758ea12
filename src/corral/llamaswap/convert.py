"""llama-swap's file as a Corral `Config`: detection, the key-by-key conversion, and loading with
line numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from corral.config import Config, node_lines, parse_config, read_config_text
from corral.errors import ConfigError, Problem
from corral.llamaswap.devices import (
    alias_of,
    map_groups,
    map_matrix,
    map_peers,
    map_routing,
)
from corral.llamaswap.text import (
    Mapping,
    expand,
    expand_env,
    expand_typed,
    filters_of,
    scalar,
    strip_comments,
    texts,
)

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
    "logTimeFormat",
    "logToStdout",
    "captureBuffer",
    "sendLoadingState",
    "unloadTimeout",
    "routing",
    "peers",
    "matrix",
    "profiles",
    "selectors",
    "performance",
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
_DEFAULT_CONCURRENCY = 10  # llama-swap's in-flight limit when concurrencyLimit is 0 or absent

# Keys llama-swap documents that Corral does not take, with why; any other key is reported too.
_TOP_IGNORED = {
    "logLevel": "Corral logs at INFO; per-model server output goes to server.log_dir",
    "logTimeFormat": "Corral's log lines carry their own timestamps",
    "logToStdout": "Corral logs to stderr; each server's output goes to its log file",
    "metricsMaxInMemory": "Corral exports Prometheus metrics at /metrics",
    "captureBuffer": "request capture is not supported",
    "logRequests": "not supported",
    "startPort": "Corral gives each ${PORT} a port the OS reports free",
    "profiles": "not supported",
    "selectors": "not supported",
    "ui": "Corral's dashboard is at /ui",
    "performance": "not supported",
    "upstream": "Corral's /upstream/{model}/... always loads its model (no ignorePaths)",
}
_MODEL_IGNORED = {
    "timeouts": "Corral's proxy has no per-model timeouts (request_timeout_s bounds the wait)",
    "compat": "not supported",
}


def looks_like_llama_swap(data: object) -> bool:
    """True for a parsed YAML document in llama-swap's format rather than Corral's."""
    if not isinstance(data, dict):
        return False
    if _TOP_ONLY & set(data):
        return True
    models = data.get("models")
    if isinstance(models, dict):
        return any(isinstance(m, dict) and _llama_swap_model(m) for m in models.values())
    return False


def _llama_swap_model(m: dict[str, Any]) -> bool:
    """A model entry only llama-swap writes: its own keys, `env` as a list of K=V, aliases as
    objects, or a `cmd` with comment lines."""
    return bool(
        _MODEL_ONLY & set(m)
        or isinstance(m.get("env"), list)
        or any(isinstance(a, dict) for a in m.get("aliases") or [])
        or any(x.strip().startswith("#") for x in str(m.get("cmd", "")).splitlines())
        or (
            isinstance(m.get("capabilities"), dict) and bool({"in", "out"} & set(m["capabilities"]))
        )
        or (
            isinstance(m.get("filters"), dict)
            and bool({"stripParams", "setParams", "setParamsByID"} & set(m["filters"]))
        )
    )


_TOP_MAPPED = {
    "models",
    "macros",
    "healthCheckTimeout",
    "globalTTL",
    "apiKeys",
    "groups",
    "hooks",
    "includeAliasesInList",
    "unloadTimeout",
    "peers",
    "routing",
    "matrix",
    "sendLoadingState",
}

_MODEL_MAPPED = {  # key -> what it becomes (listed by `corral config check`)
    "cmd": "cmd (comment lines dropped, macros expanded)",
    "cmdStop": "cmd_stop",
    "proxy": "proxy",
    "env": "env",
    "checkEndpoint": "check_endpoint",
    "healthCheckTimeout": "health_timeout_s (at least 15 s, as llama-swap)",
    "aliases": "aliases (their ids)",
    "unlisted": "unlisted",
    "ttl": "ttl_s (-1: globalTTL; 0: never)",
    "concurrencyLimit": "concurrency: in flight at once (0: llama-swap's 10)",
    "useModelName": "upstream_model",
    "macros": "expanded where llama-swap expands them",
    "name": "name (in /v1/models)",
    "description": "description (in /v1/models)",
    "metadata": "metadata (in /v1/models under meta.llamaswap; macros keep their types)",
    "filters": "filters (strip_params, set_params, set_params_by_id: ids become aliases)",
    "unloadTimeout": "stop_grace_s (SIGTERM, then SIGKILL after it)",
    "capabilities": "capabilities (in /v1/models: architecture, capabilities, context_length)",
    "sendLoadingState": "send_loading_state (overrides the global sendLoadingState)",
}


@dataclass
class _Doc:
    """One conversion's context: the document's source, what was mapped or ignored, the
    problems found, and the document-wide settings a model falls back to."""

    source: str
    out: Mapping
    problems: list[Problem]
    data: dict[str, Any]
    macros: dict[str, Any]

    def problem(self, where: str, message: str) -> None:
        self.problems.append(Problem(self.source, None, where, message))


def convert(
    data: dict[str, Any], source: str, lines: dict[str, int] | None = None
) -> tuple[Config, Mapping]:
    """A llama-swap document as a Corral `Config`, and what was mapped or ignored: every key is
    one or the other. `lines`: each key path's line (`a.b.c`), for the errors."""
    out = Mapping()
    problems: list[Problem] = []
    # llama-swap drops comment lines from `cmd` and expands ${env.*} before anything else.
    for m in (data.get("models") or {}).values():
        if isinstance(m, dict) and isinstance(m.get("cmd"), str):
            m["cmd"] = strip_comments(m["cmd"])
    data = expand_env(data, (), problems)
    doc = _Doc(source, out, problems, data, _macros(data, problems))
    server = _top_level(doc)
    models: dict[str, dict[str, Any]] = {}
    for name, m in (data.get("models") or {}).items():
        if not isinstance(m, dict):
            doc.problem(f"models.{name}", "must be a mapping")
            continue
        models[str(name)] = _model(doc, str(name), m)
    devices = map_groups(data.get("groups") or {}, models, source, out, problems)
    routing = data.get("routing")
    if isinstance(routing, dict):
        devices = devices or map_routing(routing, models, source, out, problems)
    elif isinstance(data.get("matrix"), dict):  # before `routing`, llama-swap had it on top
        devices = devices or map_matrix(data["matrix"], models, out, problems, "matrix")
    peers = data.get("peers") or {}
    if isinstance(peers, dict) and peers:
        devices = map_peers(peers, models, devices, out, problems, texts(doc.macros))
    _hooks(data.get("hooks") or {}, models, server, out)
    if problems:
        raise ConfigError(
            [Problem(source, p.line or _line(lines, p.where), p.where, p.message) for p in problems]
        )
    converted: dict[str, Any] = {"models": models}
    if devices:
        converted["devices"] = devices
    if server:
        converted["server"] = server
    try:
        return parse_config(yaml.safe_dump(converted, sort_keys=False), source), out
    except ConfigError as exc:  # name the user's key and line, not those of the converted file
        raise ConfigError([_theirs(p, source, lines) for p in exc.problems]) from None


def _macros(data: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """The document's macros, each expanded with those defined before it."""
    macros: dict[str, Any] = {}
    for k, v in (data.get("macros") or {}).items():
        macros[str(k)] = (
            v if not isinstance(v, str) else expand(v, texts(macros), f"macros.{k}", problems)
        )
    return macros


def _top_level(doc: _Doc) -> dict[str, Any]:
    """The document's own keys, mapped or ignored; returns Corral's `server` section."""
    data, out = doc.data, doc.out
    if doc.macros:
        out.mapped.append(
            (
                "macros",
                "substituted into cmd, cmdStop, proxy, env, checkEndpoint "
                "and aliases (typed in metadata)",
            )
        )
    if data.get("healthCheckTimeout") is not None:
        out.mapped.append(("healthCheckTimeout", "models.*.health_timeout_s"))
    for key in data:
        if key in _TOP_MAPPED:
            continue
        why = _TOP_IGNORED.get(str(key), "not a key Corral knows of llama-swap's format")
        out.ignored.append((str(key), why))
    if "unloadTimeout" in data:
        out.mapped.append(("unloadTimeout", "models.*.stop_grace_s"))
    if "sendLoadingState" in data:
        out.mapped.append(("sendLoadingState", "models.*.send_loading_state"))
    if data.get("globalTTL") is not None:
        out.mapped.append(("globalTTL", "models.*.ttl_s (where a model sets no ttl)"))
    server: dict[str, Any] = {}
    if "includeAliasesInList" in data:
        server["list_aliases"] = data["includeAliasesInList"] is True
        out.mapped.append(("includeAliasesInList", "server.list_aliases"))
    if data.get("apiKeys"):
        server["api_keys"] = [str(k) for k in data["apiKeys"]]
        out.mapped.append(("apiKeys", "server.api_keys (${env.*} expanded)"))
    return server


def _model(doc: _Doc, name: str, m: dict[str, Any]) -> dict[str, Any]:
    """One model's entry as Corral's: its keys mapped or ignored, then its values."""
    where = f"models.{name}"
    typed = dict(doc.macros)
    for k, v in (m.get("macros") or {}).items():
        typed[str(k)] = (
            v
            if not isinstance(v, str)
            else expand(v, texts(typed), f"{where}.macros.{k}", doc.problems)
        )
    for key in m:
        if key in _MODEL_MAPPED:
            doc.out.mapped.append((f"{where}.{key}", _MODEL_MAPPED[str(key)]))
        else:
            why = _MODEL_IGNORED.get(str(key), "not a key Corral knows of llama-swap's format")
            doc.out.ignored.append((f"{where}.{key}", why))
    model: dict[str, Any] = {}
    _commands(doc, m, where, texts(typed), model)
    _listing(doc, name, m, where, typed, model)
    _limits(doc, m, where, model)
    return model


def _commands(
    doc: _Doc, m: dict[str, Any], where: str, own: dict[str, str], model: dict[str, Any]
) -> None:
    """How the model's server starts, stops, is reached and checked."""
    problems, data = doc.problems, doc.data
    if "cmd" in m:
        model["cmd"] = " ".join(expand(str(m["cmd"]), own, f"{where}.cmd", problems).split())
    if "cmdStop" in m:
        model["cmd_stop"] = expand(str(m["cmdStop"]), own, f"{where}.cmdStop", problems)
    model["proxy"] = expand(
        str(m.get("proxy", "http://127.0.0.1:${PORT}")), own, f"{where}.proxy", problems
    ).replace("localhost", "127.0.0.1")
    env = m.get("env") or []
    if env:
        pairs = {}
        for item in env:
            k, sep, v = str(item).partition("=")
            if not sep:
                doc.problem(f"{where}.env", f"{item!r} is not K=V")
                continue
            pairs[k] = expand(v, own, f"{where}.env.{k}", problems)
        model["env"] = pairs
    if "checkEndpoint" in m:
        model["check_endpoint"] = expand(
            str(m["checkEndpoint"]), own, f"{where}.checkEndpoint", problems
        )
    timeout = m.get("healthCheckTimeout", data.get("healthCheckTimeout"))
    if timeout is not None:
        # llama-swap raises anything under 15 s to 15 s.
        try:
            model["health_timeout_s"] = max(15.0, float(timeout))
        except (TypeError, ValueError):
            key = "healthCheckTimeout"
            doc.problem(f"{where}.{key}" if key in m else key, f"{timeout!r} is not seconds")
    loading = m.get("sendLoadingState", data.get("sendLoadingState"))
    if loading is not None:
        model["send_loading_state"] = loading is True
    grace = m.get("unloadTimeout", data.get("unloadTimeout"))
    if grace is not None:
        try:
            model["stop_grace_s"] = float(grace)
        except (TypeError, ValueError):
            doc.problem(f"{where}.unloadTimeout", f"{grace!r} is not seconds")


def _listing(
    doc: _Doc,
    name: str,
    m: dict[str, Any],
    where: str,
    typed: dict[str, Any],
    model: dict[str, Any],
) -> None:
    """The names it answers to and what /v1/models says of it."""
    problems = doc.problems
    own = texts(typed)
    with_id = {**own, "MODEL_ID": name}
    if "useModelName" in m:
        model["upstream_model"] = expand(
            scalar(m["useModelName"]), with_id, f"{where}.useModelName", problems
        )
    aliases = []
    for a in m.get("aliases") or []:
        alias = a.get("id") if isinstance(a, dict) else a
        if alias is not None:
            aliases.append(expand(scalar(alias), with_id, f"{where}.aliases", problems))
    if aliases:
        model["aliases"] = aliases
    for key in ("name", "description"):  # macros work in any value in llama-swap's
        if m.get(key):
            model[key] = expand(scalar(m[key]), with_id, f"{where}.{key}", problems)
    if isinstance(m.get("metadata"), dict):
        model["metadata"] = expand_typed(m["metadata"], typed, f"{where}.metadata", problems, name)
    caps = m.get("capabilities")
    if isinstance(caps, dict):
        model["capabilities"] = {
            "inputs": caps.get("in") or [],
            "outputs": caps.get("out") or [],
            "tools": caps.get("tools") is True,
            "reranker": caps.get("reranker") is True,
            "context": caps.get("context") or 0,
        }
    elif caps is not None:
        doc.out.ignored.append((f"{where}.capabilities", "must be a mapping (in, out, ...)"))
    if isinstance(m.get("filters"), dict):
        model["filters"] = filters_of(m["filters"], own, name, where, problems)
        by_id = model["filters"].get("set_params_by_id", {})
        model["aliases"] = [*aliases, *(i for i in by_id if i != name and i not in aliases)]
    if "unlisted" in m:
        model["unlisted"] = m["unlisted"] is True


def _limits(doc: _Doc, m: dict[str, Any], where: str, model: dict[str, Any]) -> None:
    """How long it stays idle, and how many requests reach it at once."""
    ttl = m.get("ttl", -1)
    if ttl == -1:  # llama-swap's default: use globalTTL
        ttl = doc.data.get("globalTTL")
    if ttl is not None:
        try:
            seconds = float(ttl)
        except (TypeError, ValueError):
            doc.problem(f"{where}.ttl", f"{ttl!r} is not seconds")
        else:
            if seconds > 0:  # llama-swap's 0 (and negative) means never
                model["ttl_s"] = seconds
    # llama-swap lets up to concurrencyLimit requests (0 or absent: 10) reach the server at
    # once: Corral's `concurrency`. Beyond it Corral queues them (llama-swap answers 429).
    limit = m.get("concurrencyLimit", 0)
    try:
        limit = int(limit)
    except (TypeError, ValueError):
        doc.problem(f"{where}.concurrencyLimit", f"{limit!r} is not a number")
        limit = 0
    model["concurrency"] = limit if limit > 0 else _DEFAULT_CONCURRENCY


def _hooks(
    hooks: Any, models: dict[str, dict[str, Any]], server: dict[str, Any], out: Mapping
) -> None:
    """`hooks.on_startup.preload` as `server.preload`; the other hooks are ignored."""
    for key, value in hooks.items() if isinstance(hooks, dict) else ():
        startup = value if key == "on_startup" and isinstance(value, dict) else {}
        for hook, what in startup.items():
            if hook == "preload":
                names = [str(x) for x in what or []]
                known = [n for n in names if n in models or alias_of(n, models)]
                server["preload"] = known
                out.mapped.append(("hooks.on_startup.preload", "server.preload"))
                for n in names:
                    if n not in known:  # llama-swap logs it and starts anyway
                        out.ignored.append(
                            (f"hooks.on_startup.preload.{n}", "no such model: not preloaded")
                        )
            else:
                out.ignored.append((f"hooks.on_startup.{hook}", "not supported"))
        if key != "on_startup":
            out.ignored.append((f"hooks.{key}", "not supported"))


# Corral's key -> llama-swap's, to name the user's key in errors about a converted value.
_THEIRS = {
    "cmd_stop": "cmdStop",
    "check_endpoint": "checkEndpoint",
    "health_timeout_s": "healthCheckTimeout",
    "ttl_s": "ttl",
    "concurrency": "concurrencyLimit",
    "upstream_model": "useModelName",
    "stop_grace_s": "unloadTimeout",
    "send_loading_state": "sendLoadingState",
    "inputs": "in",
    "outputs": "out",
    "strip_params": "stripParams",
    "set_params": "setParams",
    "set_params_by_id": "setParamsByID",
    "api_keys": "apiKeys",
    "preload": "preload",
}
_THEIR_TOP = {"server.api_keys": "apiKeys", "server.preload": "hooks.on_startup.preload"}


def _theirs(p: Problem, source: str, lines: dict[str, int] | None) -> Problem:
    where = p.where
    for ours, theirs in _THEIR_TOP.items():
        if where.startswith(ours):
            where = theirs + where[len(ours) :]
    parts = where.split(".")
    where = ".".join(_THEIRS.get(x, x) for x in parts)
    return Problem(source, _line(lines, where), where, p.message)


def _line(lines: dict[str, int] | None, where: str) -> int | None:
    """The line of `where` (a dotted key path), or of the nearest enclosing key."""
    while lines and where:
        if where in lines:
            return lines[where]
        where = where.rpartition(".")[0]
    return None


def _key_lines(text: str) -> dict[str, int]:
    paths: dict[tuple[str | int, ...], int] = {}
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        node_lines(root, (), paths, [], "")
    return {".".join(map(str, path)): line for path, line in paths.items()}


def load_any(text: str, source: str) -> tuple[Config, Mapping | None]:
    """Corral's format or llama-swap's, whichever `text` is."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None  # parse_config reports it with its line
    if looks_like_llama_swap(data):
        assert isinstance(data, dict)
        return convert(data, source, _key_lines(text))
    return parse_config(text, source), None


def load_config_file(path: str | Path) -> tuple[Config, Mapping | None]:
    """Read a configuration file in Corral's or llama-swap's format (see `load_any`)."""
    return load_any(read_config_text(path), str(path))
