"""A value that fits a JSON schema, for the simulated server's structured output:
what a model constrained by the schema would answer, deterministic in the schema and the words
it is given.

It covers the schemas clients send: pydantic's (`$defs` and `$ref`, `anyOf` with null for
optional fields, enums, `const`, `allOf`, tuples as `prefixItems`), zod's and hand-written ones
(type lists, `definitions`, formats, length, size and range bounds, `additionalProperties`).
Schemas come from clients, so the walk is bounded: references nest at most `MAX_DEPTH` deep (a
recursive model gets its null or empty branch there), arrays hold at most `MAX_ITEMS`, and the
value at most `MAX_NODES` parts.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 12
MAX_ITEMS = 16
MAX_NODES = 5000

# Strings for the formats pydantic, zod and OpenAI's structured outputs name.
_FORMATS = {
    "date-time": "2026-11-26T12:00:00Z",
    "date": "2026-11-26",
    "time": "12:00:00Z",
    "duration": "P1D",
    "email": "user@example.com",
    "idn-email": "user@example.com",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "regex": ".*",
    "json-pointer": "/a",
}
# Strings tried against a `pattern`, after the words (a guess: no regex is inverted here).
_PATTERN_TRIES = ("a", "A", "0", "abc", "ABC", "123", "a1", "A1", "aaa-000", "x@y.z", "")


@dataclass(frozen=True)
class Cues:
    """What a prompt gives a value: its numbers and its quoted texts, which a model asked for a
    tool's arguments or a JSON answer takes from it (`magic_function(3)`, "a customer named
    '你好啊集团'", "a JSON with 'setup' and 'punchline' keys")."""

    numbers: tuple[float, ...] = ()
    quoted: tuple[str, ...] = ()
    named: tuple[tuple[str, str], ...] = ()  # `name: value` pairs ("with subagent: explore")


_NAMED = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]{0,63}):[ \t]*([^\s,;'\"]{1,200})")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_QUOTED = re.compile(r"'([^'\n]{1,200})'|\"([^\"\n]{1,200})\"|“([^”\n]{1,200})”")
MAX_CUES = 16
MAX_CUE_TEXT = 20_000  # characters of a prompt read for cues


def cues_of(text: str) -> Cues:
    """The numbers and quoted texts in `text` (its first `MAX_CUE_TEXT` characters, at most
    `MAX_CUES` of each)."""
    text = text[:MAX_CUE_TEXT]
    numbers = tuple(float(m) for m in _NUMBER.findall(text)[:MAX_CUES])
    quoted = tuple(next(g for g in m if g) for m in _QUOTED.findall(text)[:MAX_CUES])
    named = tuple((k.lower(), v.rstrip(".")) for k, v in _NAMED.findall(text)[:MAX_CUES])
    return Cues(numbers, quoted, named)


def keys_of(cues: Cues) -> list[str]:
    """The quoted names a prompt asks a JSON object's keys by (`'setup' and 'punchline'`)."""
    return [q for q in cues.quoted if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", q)]


class _Budget:
    def __init__(self) -> None:
        self.nodes = 0


def fill(
    schema: Any, words: list[str] | None = None, cues: Cues | None = None, optional: bool = True
) -> Any:
    """A JSON value valid under `schema` (the subset above); text values are the prompt's
    quoted texts (`cues`) in turn, then made of `words`; numbers the prompt's in turn, where
    they fit. `optional`: fill optional properties too (an object asked for whole); else only
    those required or given by name in the prompt (a tool's arguments: a model leaves out
    OpenCode's `task_id`, "only set if you mean to resume a previous task")."""
    source = itertools.cycle(words or ["answer"])
    return _Fill(schema, source, cues or Cues(), optional).value(schema, 0)


class _Fill:
    def __init__(self, root: Any, words: Iterator[str], cues: Cues, optional: bool) -> None:
        self.root = root
        self.optional = optional
        self.words = words
        self.quoted = iter(cues.quoted)
        self.named = cues.named
        self.field = ""  # the property being filled: a `name: value` cue for it wins
        self.numbers = list(cues.numbers)  # taken in turn: "add 2 and 3" gives a=2, b=3
        self.budget = _Budget()

    def value(self, schema: Any, depth: int) -> Any:
        self.budget.nodes += 1
        if not isinstance(schema, dict):
            return None if schema is False else "x"  # `true` or junk: anything fits
        if depth > MAX_DEPTH or self.budget.nodes > MAX_NODES:
            return self._least(schema, depth)
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            if target is not None:
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                return self.value({**target, **rest} if rest else target, depth + 1)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[0]
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return self.value({**base, **self._pick(branches)}, depth + 1)
        parts = schema.get("allOf")
        if isinstance(parts, list) and parts:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                part = self._resolve(part["$ref"]) if _is_ref(part) else part
                if isinstance(part, dict):
                    merged = _merge(merged, part)
            return self.value(merged, depth + 1)
        kind = self._kind(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            return self._number(schema, kind == "integer")
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        return "x"

    # --- the kinds ----------------------------------------------------------------------------
    def _kind(self, schema: dict[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):  # ["string", "null"]: the first that is not null
            kinds = [k for k in kind if isinstance(k, str)]
            kind = next((k for k in kinds if k != "null"), kinds[0] if kinds else None)
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return ""

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        out: dict[str, Any] = {}
        for key, sub in props.items():
            # Optional fields are filled too, as a model asked for them would, until the walk
            # nears its bounds; then only what the schema requires.
            roomy = depth < MAX_DEPTH // 2 and self.budget.nodes < MAX_NODES // 2
            wanted = self.optional or any(k == key.lower() for k, _ in self.named)
            if key in required or (wanted and roomy):
                self.field = key
                out[key] = self.value(sub, depth + 1)
        for key in required:
            if key not in out:
                out[key] = "x"
        extra = schema.get("additionalProperties")
        if not props and isinstance(extra, dict):
            out["key"] = self.value(extra, depth + 1)
        least = schema.get("minProperties")
        if isinstance(least, int) and not isinstance(least, bool):
            for i in range(min(least, MAX_ITEMS) - len(out)):
                out[f"key{i}"] = self.value(extra, depth + 1) if isinstance(extra, dict) else "x"
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list):  # a tuple
            return [self.value(s, depth + 1) for s in prefix[:MAX_ITEMS]]
        items = schema.get("items")
        if isinstance(items, list):  # the older tuple form
            return [self.value(s, depth + 1) for s in items[:MAX_ITEMS]]
        least, most = _whole(schema.get("minItems"), 0), _whole(schema.get("maxItems"), None)
        n = max(least, 1 if depth < MAX_DEPTH // 2 else 0)
        if most is not None:
            n = min(n, most)
        n = min(n, MAX_ITEMS)
        out = [self.value(items, depth + 1) for _ in range(n)]
        if schema.get("uniqueItems"):
            out = _distinct(out)
        return out

    def _number(self, schema: dict[str, Any], integer: bool) -> int | float:
        """The prompt's next number that fits (taken), else one in range."""
        for i, n in enumerate(self.numbers):
            value = int(n) if integer and n.is_integer() else n
            if (not integer or isinstance(value, int)) and _fits(schema, value):
                del self.numbers[i]
                return value
        return _number(schema, integer)

    def _named(self) -> str | None:
        """The value the prompt gives by this field's name, or one of its words
        (`subagent_type` takes "subagent: explore")."""
        words = {w for w in self.field.lower().split("_") if len(w) > 2} | {self.field.lower()}
        return next((v for k, v in self.named if k in words), None)

    def _string(self, schema: dict[str, Any]) -> str:
        fmt = schema.get("format")
        text = _FORMATS.get(fmt) if isinstance(fmt, str) else None
        if text is None:
            text = self._named() or next(self.quoted, None) or next(self.words)
        least = _whole(schema.get("minLength"), 0)
        most = _whole(schema.get("maxLength"), None)
        while len(text) < min(least, 4096):
            text += " " + next(self.words)
        if most is not None:
            text = text[:most].rstrip() if len(text[:most].rstrip()) >= least else text[:most]
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            # Only short texts are tried: a client's pattern may backtrack for ever on a long one.
            tries = [text, *_PATTERN_TRIES] if len(text) <= 64 else list(_PATTERN_TRIES)
            text = _matching(pattern, tries, least, most) or text
        return text

    # --- helpers ------------------------------------------------------------------------------
    def _resolve(self, ref: str) -> dict[str, Any] | None:
        """`#/...` inside the root schema (`$defs`, `definitions`, any pointer); None if absent."""
        if not ref.startswith("#"):
            return None
        node: Any = self.root
        for raw in ref[1:].split("/")[1:] if ref != "#" else []:
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def _pick(self, branches: list[Any]) -> dict[str, Any]:
        """The branch to fill: the first that is not null (an optional field gets its value)."""
        for branch in branches:
            if isinstance(branch, dict) and not _is_null(branch):
                return branch
        first = branches[0]
        return first if isinstance(first, dict) else {}

    def _least(self, schema: dict[str, Any], depth: int) -> Any:
        """The smallest value that fits, where the walk must stop: null if allowed, else an
        empty container or a plain value."""
        branches = schema.get("anyOf") or schema.get("oneOf") or []
        if isinstance(branches, list) and any(
            isinstance(b, dict) and _is_null(b) for b in branches
        ):
            return None
        kind = self._kind(schema)
        if kind == "array":
            return []
        if kind == "object":
            return {}
        if kind in ("integer", "number"):
            return _number(schema, kind == "integer")
        return {"boolean": True, "null": None}.get(kind, "x")


def _fits(schema: dict[str, Any], value: float) -> bool:
    """Whether `value` is within the schema's bounds (and a multiple of `multipleOf`)."""

    def bound(key: str) -> float | None:
        b = schema.get(key)
        return float(b) if isinstance(b, int | float) and not isinstance(b, bool) else None

    low, high = bound("minimum"), bound("maximum")
    xlow, xhigh, step = bound("exclusiveMinimum"), bound("exclusiveMaximum"), bound("multipleOf")
    return not (
        (low is not None and value < low)
        or (high is not None and value > high)
        or (xlow is not None and value <= xlow)
        or (xhigh is not None and value >= xhigh)
        or (step is not None and (step <= 0 or not (value / step).is_integer()))
    )


def _is_ref(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("$ref"), str)


def _is_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or schema.get("const", 0) is None


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = [*a["required"], *b["required"]]
    return out


def _whole(value: Any, default: int | None) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    """A value in range (1 when unbounded; else near the lower bound, or the upper), a
    multiple of `multipleOf` if given."""

    def bound(key: str) -> float | None:
        v = schema.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        return None

    low, high = bound("minimum"), bound("maximum")
    xlow, xhigh = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    step = bound("multipleOf")
    lo = max(x for x in (low, xlow, -math.inf) if x is not None)
    hi = min(x for x in (high, xhigh, math.inf) if x is not None)
    open_lo, open_hi = xlow is not None and xlow == lo, xhigh is not None and xhigh == hi
    if step is not None and step > 0:
        if math.isfinite(lo):
            value = (math.floor(lo / step) + 1 if open_lo else math.ceil(lo / step)) * step
        elif math.isfinite(hi):
            value = (math.ceil(hi / step) - 1 if open_hi else math.floor(hi / step)) * step
        else:
            value = step
        return int(value) if integer else value
    if integer:
        ilo = (math.floor(lo) + 1 if open_lo else math.ceil(lo)) if math.isfinite(lo) else None
        ihi = (math.ceil(hi) - 1 if open_hi else math.floor(hi)) if math.isfinite(hi) else None
        if ilo is not None:
            return ilo
        return min(1, ihi) if ihi is not None else 1
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2 if open_lo or open_hi else lo
    if math.isfinite(lo):
        return lo + 0.5 if open_lo else lo
    if math.isfinite(hi):
        return min(1.0, hi - 0.5 if open_hi else hi)
    return 1.5


def _distinct(values: list[Any]) -> list[Any]:
    """Unique items: equal ones are changed (strings and numbers get a suffix) or dropped."""
    out: list[Any] = []
    for i, v in enumerate(values):
        if v in out:
            if isinstance(v, str):
                v = f"{v}{i}"
            elif isinstance(v, int | float) and not isinstance(v, bool):
                v = v + i
            else:
                continue
        out.append(v)
    return out


def _matching(pattern: str, tries: list[str], least: int, most: int | None) -> str | None:
    try:
        rx = re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    for text in tries:
        if rx.search(text) and len(text) >= least and (most is None or len(text) <= most):
            return text
    return None
