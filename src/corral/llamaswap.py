"""llama-swap's config format, mapped onto Corral's, so its users can switch with the file they
have: `corral serve --config llama-swap.yaml`. Every key is either mapped or reported as ignored
with the reason (`corral config check` prints both).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from corral.config import Config, node_lines, parse_config, read_config_text
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
_RESERVED = {"PORT", "MODEL_ID", "PID"}
_MACRO = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_-]*)\}")
_ENV = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")
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
    )


def _scalar(value: Any) -> str:
    """A macro's value as llama-swap writes it into text (YAML's spelling: true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _strip_comments(cmd: str) -> str:
    """llama-swap drops `#` comment lines from a multi-line `cmd`."""
    return "\n".join(x for x in cmd.splitlines() if not x.strip().startswith("#"))


def _expand_env(value: Any, path: tuple[str | int, ...], problems: list[Problem]) -> Any:
    """`${env.NAME}` replaced everywhere in the document, as llama-swap does before anything
    else; an unset variable is an error naming it (never a literal `${env.NAME}`, which as an
    API key would be a working key anyone could guess)."""
    if isinstance(value, dict):
        return {k: _expand_env(v, (*path, str(k)), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, (*path, i), problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${env." not in value:
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            where = ".".join(map(str, path))
            problems.append(
                Problem(
                    "", None, where, f"environment variable {name} is not set (${{env.{name}}})"
                )
            )
            return m.group(0)
        return os.environ[name]

    return _ENV.sub(one, value)


def _expand_typed(
    value: Any, macros: dict[str, Any], where: str, problems: list[Problem], model: str
) -> Any:
    """Macros in a structured value (metadata): a string that is one macro keeps the macro's
    type (a number stays a number); other strings are expanded as text."""
    if isinstance(value, dict):
        return {k: _expand_typed(v, macros, where, problems, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_typed(v, macros, where, problems, model) for v in value]
    if not isinstance(value, str):
        return value
    whole = _MACRO.fullmatch(value)
    if whole and whole.group(1) in macros:
        return macros[whole.group(1)]
    return _expand(value, {**_texts(macros), "MODEL_ID": model}, where, problems)


def _filters(
    f: dict[str, Any], macros: dict[str, str], model: str, where: str, problems: list[Problem]
) -> dict[str, Any]:
    """llama-swap's `filters` as Corral's: stripParams is a comma-separated string (macros
    expanded); setParamsByID's keys take ${MODEL_ID}."""
    out: dict[str, Any] = {}
    for key in f:
        if key not in ("stripParams", "setParams", "setParamsByID", "strip_params"):
            problems.append(Problem("", None, f"{where}.filters.{key}", "unknown filter"))
    strip = f.get("stripParams", f.get("strip_params"))
    if strip:
        text = _expand(str(strip), macros, f"{where}.filters.stripParams", problems)
        out["strip_params"] = [
            p.strip() for p in text.split(",") if p.strip() != "model" and p.strip()
        ]
    if isinstance(f.get("setParams"), dict):
        out["set_params"] = {k: v for k, v in f["setParams"].items() if k != "model"}
    if isinstance(f.get("setParamsByID"), dict):
        ids = {**macros, "MODEL_ID": model}
        out["set_params_by_id"] = {
            _expand(str(k), ids, f"{where}.filters.setParamsByID", problems): {
                p: v for p, v in (params or {}).items() if p != "model"
            }
            for k, params in f["setParamsByID"].items()
        }
    return out


def _texts(macros: dict[str, Any]) -> dict[str, str]:
    return {k: _scalar(v) for k, v in macros.items()}


def _expand(text: str, macros: dict[str, str], where: str, problems: list[Problem]) -> str:
    """Substitute user macros (which may use each other); leave Corral's own ones."""
    for _ in range(10):  # macros may refer to macros; a cycle is an error, not a hang

        def one(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in macros:
                return macros[name]
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
            m["cmd"] = _strip_comments(m["cmd"])
    data = _expand_env(data, (), problems)
    macros: dict[str, Any] = {}
    for k, v in (data.get("macros") or {}).items():  # may use the macros defined before them
        macros[str(k)] = (
            v if not isinstance(v, str) else _expand(v, _texts(macros), f"macros.{k}", problems)
        )
    if macros:
        out.mapped.append(
            (
                "macros",
                "substituted into cmd, cmdStop, proxy, env, checkEndpoint "
                "and aliases (typed in metadata)",
            )
        )
    health_timeout = data.get("healthCheckTimeout")
    if health_timeout is not None:
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
    global_ttl = data.get("globalTTL")
    if global_ttl is not None:
        out.mapped.append(("globalTTL", "models.*.ttl_s (where a model sets no ttl)"))
    server: dict[str, Any] = {}
    if "includeAliasesInList" in data:
        server["list_aliases"] = data["includeAliasesInList"] is True
        out.mapped.append(("includeAliasesInList", "server.list_aliases"))
    if data.get("apiKeys"):
        server["api_keys"] = [str(k) for k in data["apiKeys"]]
        out.mapped.append(("apiKeys", "server.api_keys (${env.*} expanded)"))
    models: dict[str, dict[str, Any]] = {}
    for name, m in (data.get("models") or {}).items():
        if not isinstance(m, dict):
            problems.append(Problem(source, None, f"models.{name}", "must be a mapping"))
            continue
        where = f"models.{name}"
        typed = dict(macros)
        for k, v in (m.get("macros") or {}).items():
            typed[str(k)] = (
                v
                if not isinstance(v, str)
                else _expand(v, _texts(typed), f"{where}.macros.{k}", problems)
            )
        own = _texts(typed)
        for key in m:
            if key in _MODEL_MAPPED:
                out.mapped.append((f"{where}.{key}", _MODEL_MAPPED[str(key)]))
            else:
                why = _MODEL_IGNORED.get(str(key), "not a key Corral knows of llama-swap's format")
                out.ignored.append((f"{where}.{key}", why))
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
            model["check_endpoint"] = _expand(
                str(m["checkEndpoint"]), own, f"{where}.checkEndpoint", problems
            )
        timeout = m.get("healthCheckTimeout", health_timeout)
        if timeout is not None:
            # llama-swap raises anything under 15 s to 15 s.
            model["health_timeout_s"] = max(15.0, float(timeout))
        loading = m.get("sendLoadingState", data.get("sendLoadingState"))
        if loading is not None:
            model["send_loading_state"] = loading is True
        grace = m.get("unloadTimeout", data.get("unloadTimeout"))
        if grace is not None:
            try:
                model["stop_grace_s"] = float(grace)
            except (TypeError, ValueError):
                problems.append(
                    Problem(source, None, f"{where}.unloadTimeout", f"{grace!r} is not seconds")
                )
        if "useModelName" in m:
            model["upstream_model"] = str(m["useModelName"])
        aliases = []
        for a in m.get("aliases") or []:
            alias = a.get("id") if isinstance(a, dict) else a
            if alias is not None:
                with_id = {**own, "MODEL_ID": str(name)}
                aliases.append(_expand(_scalar(alias), with_id, f"{where}.aliases", problems))
        if aliases:
            model["aliases"] = aliases
        for key in ("name", "description"):
            if m.get(key):
                model[key] = str(m[key])
        if isinstance(m.get("metadata"), dict):
            model["metadata"] = _expand_typed(
                m["metadata"], typed, f"{where}.metadata", problems, str(name)
            )
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
            out.ignored.append((f"{where}.capabilities", "must be a mapping (in, out, ...)"))
        if isinstance(m.get("filters"), dict):
            model["filters"] = _filters(m["filters"], own, str(name), where, problems)
            by_id = model["filters"].get("set_params_by_id", {})
            model["aliases"] = [*aliases, *(i for i in by_id if i != name and i not in aliases)]
        if "unlisted" in m:
            model["unlisted"] = m["unlisted"] is True
        ttl = m.get("ttl", -1)
        if ttl == -1:  # llama-swap's default: use globalTTL
            ttl = global_ttl
        if ttl is not None:
            try:
                seconds = float(ttl)
            except (TypeError, ValueError):
                problems.append(Problem(source, None, f"{where}.ttl", f"{ttl!r} is not seconds"))
            else:
                if seconds > 0:  # llama-swap's 0 (and negative) means never
                    model["ttl_s"] = seconds
        # llama-swap lets up to concurrencyLimit requests (0 or absent: 10) reach the server at
        # once: Corral's `concurrency`. Beyond it Corral queues them (llama-swap answers 429).
        limit = m.get("concurrencyLimit", 0)
        try:
            limit = int(limit)
        except (TypeError, ValueError):
            problems.append(
                Problem(source, None, f"{where}.concurrencyLimit", f"{limit!r} is not a number")
            )
            limit = 0
        model["concurrency"] = limit if limit > 0 else _DEFAULT_CONCURRENCY
        models[str(name)] = model
    devices = _map_groups(data.get("groups") or {}, models, source, out, problems)
    routing = data.get("routing")
    if isinstance(routing, dict):
        devices = devices or _map_routing(routing, models, source, out, problems)
    elif isinstance(data.get("matrix"), dict):  # before `routing`, llama-swap had it on top
        devices = devices or _map_matrix(data["matrix"], models, out, problems, "matrix")
    peers = data.get("peers") or {}
    if isinstance(peers, dict) and peers:
        devices = _map_peers(peers, models, devices, out, problems)
    hooks = data.get("hooks") or {}
    for key, value in hooks.items() if isinstance(hooks, dict) else ():
        startup = value if key == "on_startup" and isinstance(value, dict) else {}
        for hook, what in startup.items():
            if hook == "preload":
                names = [str(x) for x in what or []]
                known = [n for n in names if n in models or _alias_of(n, models)]
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
    if problems:
        raise ConfigError(
            [Problem(source, p.line or _line(lines, p.where), p.where, p.message) for p in problems]
        )
    doc: dict[str, Any] = {"models": models}
    if devices:
        doc["devices"] = devices
    if server:
        doc["server"] = server
    return parse_config(yaml.safe_dump(doc, sort_keys=False), source), out


_SHARED = "shared"


def _map_routing(
    routing: dict[str, Any],
    models: dict[str, dict[str, Any]],
    source: str,
    out: Mapping,
    problems: list[Problem],
) -> list[dict[str, Any]]:
    """llama-swap's `routing`: the group router's groups become devices as the legacy `groups`
    do; the fifo scheduler's priorities become the models' priorities. The matrix router is
    reported (its solver has no Corral equivalent yet)."""
    devices: list[dict[str, Any]] = []
    router = routing.get("router") or {}
    use = router.get("use", "group") if isinstance(router, dict) else "group"
    settings = (router.get("settings") or {}) if isinstance(router, dict) else {}
    for key in routing:
        if key not in ("router", "scheduler"):
            out.ignored.append((f"routing.{key}", "not a key Corral knows of llama-swap's routing"))
    if use == "matrix":
        devices = _map_matrix(settings.get("matrix") or {}, models, out, problems)
        if "groups" in settings:
            out.ignored.append(("routing.router.settings.groups", "unused: the router uses matrix"))
    elif use == "group":
        groups = settings.get("groups") or {}
        prefix = "routing.router.settings.groups"
        devices = _map_groups(groups, models, source, out, problems, prefix, lenient=True)
        if "matrix" in settings:
            why = "unused: the router uses groups"
            out.ignored.append(("routing.router.settings.matrix", why))
    else:
        problems.append(
            Problem(source, None, "routing.router.use", f"must be group or matrix; got {use!r}")
        )
    scheduler = routing.get("scheduler") or {}
    if isinstance(scheduler, dict):
        fifo = ((scheduler.get("settings") or {}).get("fifo") or {}) if scheduler else {}
        for name, priority in (fifo.get("priority") or {}).items():
            if str(name) in models:
                models[str(name)]["priority"] = int(priority)
            else:
                out.ignored.append(
                    (f"routing.scheduler.settings.fifo.priority.{name}", "no such model")
                )
        if scheduler:
            out.mapped.append(
                ("routing.scheduler", "model priorities (Corral's policy orders by them)")
            )
    return devices


_MATRIX = "matrix"


def _map_matrix(
    matrix: dict[str, Any],
    models: dict[str, dict[str, Any]],
    out: Mapping,
    problems: list[Problem],
    where: str = "routing.router.settings.matrix",
) -> list[dict[str, Any]]:
    """The matrix router's sets on one device, "matrix", sized by its largest set: each model
    in a set takes one slot, so up to that many of them run together; a model in no set fills
    the device (llama-swap runs it alone). An approximation, reported as such: Corral lets any
    members share the device up to the largest set's size, where llama-swap allows exactly the
    listed combinations."""
    names = {str(k): str(v) for k, v in (matrix.get("vars") or {}).items()}
    expressions = {str(k): str(v) for k, v in (matrix.get("sets") or {}).items()}
    sets: list[frozenset[str]] = []
    for sname, expr in expressions.items():
        try:
            combos = _expand_set(expr, expressions, set())
        except ValueError as exc:
            problems.append(Problem("", None, f"{where}.sets.{sname}", str(exc)))
            continue
        for combo in combos:
            members = frozenset(names.get(x, x) for x in combo)
            unknown = sorted(m for m in members if m not in models)
            for m in unknown:
                out.ignored.append((f"{where}.sets.{sname}.{m}", "no such model"))
            members = frozenset(m for m in members if m in models)
            if members:
                sets.append(members)
    if not sets:
        return []
    slots = float(max(len(x) for x in sets))
    together = set().union(*sets)
    for name, model in models.items():
        model["devices"] = [_MATRIX]
        model["memory_gb"] = 1.0 if name in together else slots
    out.mapped.append(
        (
            where,
            f"device {_MATRIX!r} with {slots:g} slots: up to {slots:g} of the sets' models run "
            "together, others alone (approximates the listed combinations)",
        )
    )
    if matrix.get("evict_costs"):
        out.ignored.append((f"{where}.evict_costs", "Corral weighs measured load times"))
    return [{"name": _MATRIX, "memory_gb": slots}]


def _expand_set(expr: str, sets: dict[str, str], seen: set[str]) -> list[frozenset[str]]:
    """A matrix set expression (`a & b`, `a | b`, parentheses, `+other`) as its combinations."""
    tokens = re.findall(r"\+?[A-Za-z0-9_./:-]+|[&|()]", expr)
    pos = 0

    def atom() -> list[frozenset[str]]:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"incomplete expression {expr!r}")
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            inner = alternatives()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise ValueError(f"unbalanced parentheses in {expr!r}")
            pos += 1
            return inner
        if tok.startswith("+"):
            ref = tok[1:]
            if ref not in sets or ref in seen:
                raise ValueError(f"+{ref} names no set (or refers to itself)")
            return _expand_set(sets[ref], sets, seen | {ref})
        if tok in "&|)":
            raise ValueError(f"unexpected {tok!r} in {expr!r}")
        return [frozenset({tok})]

    def conjunction() -> list[frozenset[str]]:
        nonlocal pos
        result = atom()
        while pos < len(tokens) and tokens[pos] == "&":
            pos += 1
            right = atom()
            result = [a | b for a in result for b in right]
        return result

    def alternatives() -> list[frozenset[str]]:
        nonlocal pos
        result = conjunction()
        while pos < len(tokens) and tokens[pos] == "|":
            pos += 1
            result = result + conjunction()
        return result

    combos = alternatives()
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos]!r} in {expr!r}")
    return combos


_PEER_CONCURRENCY = 64  # a peer is another server's business: Corral does not hold its requests


def _map_peers(
    peers: dict[str, Any],
    models: dict[str, dict[str, Any]],
    devices: list[dict[str, Any]],
    out: Mapping,
    problems: list[Problem],
) -> list[dict[str, Any]]:
    """Each peer's models as Corral models with `upstream:` (its proxy, with its API key), on a
    device of the peer's own where they all fit at once: requests for them are forwarded, never
    scheduled against the local models. Local models keep their devices (or get `shared`)."""
    if not devices:
        devices = [{"name": _SHARED}]
        for local in models.values():
            local.setdefault("devices", [_SHARED])
    # As llama-swap: a peer model is always `<peer>/<model>`; the bare name also works when
    # exactly one peer has it and no local model or alias takes it.
    offered: dict[str, int] = {}
    for peer in peers.values():
        for name in (peer or {}).get("models") or [] if isinstance(peer, dict) else []:
            offered[str(name)] = offered.get(str(name), 0) + 1
    local_names = set(models) | {a for m in models.values() for a in m.get("aliases", [])}
    for pid, peer in peers.items():
        where = f"peers.{pid}"
        if not isinstance(peer, dict) or not peer.get("proxy"):
            problems.append(Problem("", None, where, "needs `proxy` (the peer's base URL)"))
            continue
        names = [str(m) for m in peer.get("models") or []]
        if not names:
            problems.append(Problem("", None, f"{where}.models", "list the peer's models"))
            continue
        device = f"peer-{pid}"
        devices.append({"name": device, "memory_gb": float(len(names))})
        filters = peer.get("filters")
        for name in names:
            model: dict[str, Any] = {
                "upstream": str(peer["proxy"]).rstrip("/"),
                "upstream_model": name,
                "devices": [device],
                "memory_gb": 1.0,
                "load_s": 0.0,
                "unload_s": 0.0,
                "concurrency": _PEER_CONCURRENCY,
            }
            if peer.get("apiKey"):
                model["upstream_api_key"] = str(peer["apiKey"])
            if isinstance(filters, dict):
                model["filters"] = _filters(filters, {}, name, f"{where}.filters", problems)
            if offered[name] == 1 and name not in local_names:
                model["aliases"] = [name]
            models[f"{pid}/{name}"] = model
        out.mapped.append(
            (where, f"models {', '.join(names)} forwarded to {peer['proxy']} (device {device!r})")
        )
        for key in peer:
            if key == "timeouts":
                out.ignored.append((f"{where}.timeouts", "no per-peer proxy timeouts"))
            elif key not in ("proxy", "apiKey", "models", "filters"):
                out.ignored.append((f"{where}.{key}", "not a key Corral knows of a peer"))
    return devices


def _alias_of(name: str, models: dict[str, dict[str, Any]]) -> bool:
    return any(name in m.get("aliases", []) for m in models.values())


def _map_groups(
    groups: dict[str, Any],
    models: dict[str, dict[str, Any]],
    source: str,
    out: Mapping,
    problems: list[Problem],
    prefix: str = "groups",
    lenient: bool = False,
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
        where = f"{prefix}.{gname}"
        if not isinstance(g, dict):
            problems.append(Problem(source, None, where, "must be a mapping"))
            continue
        members = [str(m) for m in g.get("members") or []]
        if lenient:  # routing groups: llama-swap's own example names models it does not define
            for member in members:
                if member not in models:
                    out.ignored.append((f"{where}.members.{member}", "no such model"))
            members = [m for m in members if m in models]
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
