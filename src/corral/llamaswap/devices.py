"""Where llama-swap's models may run, as Corral devices: `groups` (legacy and under `routing`),
the matrix router, and `peers` (remote servers, each on a device of its own)."""

from __future__ import annotations

import re
from typing import Any

from corral.errors import Problem
from corral.llamaswap.text import Mapping, expand, filters_of

SHARED = "shared"


def map_routing(
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
        devices = map_matrix(settings.get("matrix") or {}, models, out, problems)
        if "groups" in settings:
            out.ignored.append(("routing.router.settings.groups", "unused: the router uses matrix"))
    elif use == "group":
        groups = settings.get("groups") or {}
        prefix = "routing.router.settings.groups"
        devices = map_groups(groups, models, source, out, problems, prefix, lenient=True)
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


def map_matrix(
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
            combos = expand_set(expr, expressions, set())
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


def expand_set(expr: str, sets: dict[str, str], seen: set[str]) -> list[frozenset[str]]:
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
            return expand_set(sets[ref], sets, seen | {ref})
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


def map_peers(
    peers: dict[str, Any],
    models: dict[str, dict[str, Any]],
    devices: list[dict[str, Any]],
    out: Mapping,
    problems: list[Problem],
    macros: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each peer's models as Corral models with `upstream:` (its proxy, with its API key), on a
    device of the peer's own where they all fit at once: requests for them are forwarded, never
    scheduled against the local models. Local models keep their devices (or get `shared`)."""
    if not devices:
        devices = [{"name": SHARED}]
        for local in models.values():
            local.setdefault("devices", [SHARED])
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
                "upstream": expand(
                    str(peer["proxy"]), macros or {}, f"{where}.proxy", problems
                ).rstrip("/"),
                "upstream_model": name,
                "devices": [device],
                "memory_gb": 1.0,
                "load_s": 0.0,
                "unload_s": 0.0,
                "concurrency": _PEER_CONCURRENCY,
            }
            if peer.get("apiKey"):
                key = expand(str(peer["apiKey"]), macros or {}, f"{where}.apiKey", problems)
                model["upstream_api_key"] = key
            if isinstance(filters, dict):
                model["filters"] = filters_of(filters, {}, name, f"{where}.filters", problems)
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


def alias_of(name: str, models: dict[str, dict[str, Any]]) -> bool:
    return any(name in m.get("aliases", []) for m in models.values())


def map_groups(
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
    capacity: dict[str, float] = {SHARED: 1.0}
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
        device = f"group-{gname}" if own else SHARED
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
            sizes.setdefault(SHARED, {})[name] = 1.0  # llama-swap's default group
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
