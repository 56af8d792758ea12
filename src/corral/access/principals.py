"""Principals, their keys and the ring that finds a principal by its key: no I/O.

A key is a random secret shown once; Corral keeps its SHA-256 digest only (a key has 256 bits
of entropy, so a fast digest is as safe as a slow one and costs a microsecond per request). A
presented key is hashed and its digest compared in constant time with the one stored under it."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from corral.access.limits import NO_LIMITS, Limits

Role = Literal["admin", "user"]
ROLES: tuple[Role, ...] = ("admin", "user")
ServiceClass = Literal["interactive", "batch"]
CLASSES: tuple[ServiceClass, ...] = ("interactive", "batch")
KEY_PREFIX = "crl-"
DIGEST_PREFIX = "sha256:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Principal:
    """Who made a request: a name, a role (`admin` may do everything; `user` may not use the
    admin routes), the models it may use (names or globs; none: every model), the limits
    on its model calls, its weight in fair shares (core/shares.py) and the highest service
    class it may ask for (`batch`: its calls run as background work)."""

    name: str
    role: Role
    models: tuple[str, ...] = ()
    limits: Limits = NO_LIMITS
    weight: float = 1.0
    highest_class: ServiceClass = "interactive"

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        """Whether this principal may use `model` (a served model's name, aliases resolved)."""
        return may_use(self.models, model)


def may_use(globs: Iterable[str], model: str) -> bool:
    """Whether `model` matches one of `globs` (shell-style, case-sensitive); no globs: every
    model."""
    globs = tuple(globs)
    return not globs or any(fnmatch.fnmatchcase(model, g) for g in globs)


# The caller when no key is configured at all: Corral is open, as it was before keys.
ANYONE = Principal("anyone", "admin")
# The caller of an open route (/health, /metrics, /ui) that sent no key while keys exist: a
# user no principal can be (its name is not a valid one), so it sees nobody's requests.
NO_KEY = Principal("(no key)", "user")
# `server.api_keys`: each key an admin's.
API_KEYS = Principal("admin", "admin")
SCOPE_KEY = "corral.principal"  # the ASGI scope's key for the caller's `Principal`


def caller(scope: Mapping[str, Any]) -> Principal:
    """The principal that made the request of `scope` (`ANYONE` where no key exists)."""
    who = scope.get(SCOPE_KEY, ANYONE)
    assert isinstance(who, Principal)
    return who


def owner_made(who: Principal) -> str | None:
    """The owner recorded for what `who` makes: its name; None for `ANYONE` (no keys)."""
    return None if who is ANYONE else who.name


def owner_seen(who: Principal) -> str | None:
    """The owner whose things `who` may see: its own name for a user; None (all) for an
    admin."""
    return None if who.admin else who.name


def new_key() -> str:
    """A new key: `crl-` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str | bytes) -> str:
    """The hex SHA-256 of `key`, as kept."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def key_id(key_digest: str) -> str:
    """The public name of a key: the first 12 hex digits of its digest."""
    return "key_" + key_digest[:12]


def digest_of_configured(key: str) -> str:
    """The digest of a key written in the config: the key itself, or `sha256:<64 hex digits>`
    (its digest, so the file need not hold the secret). ValueError for a malformed digest."""
    if key.startswith(DIGEST_PREFIX):
        hexed = key[len(DIGEST_PREFIX) :].lower()
        if not _HEX64.fullmatch(hexed):
            raise ValueError(f"{key[:16]}...: a digest is sha256: and 64 hex digits")
        return hexed
    return digest(key)


def check_name(name: str) -> str:
    """`name` if it can name a principal, else ValueError saying what can."""
    if not NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} cannot name a principal: 1-64 letters, digits, '.', '_', '@' or '-', "
            "starting with a letter or digit"
        )
    return name


def configured_keys(
    api_keys: Iterable[str], principals: Iterable[tuple[Principal, list[str]]]
) -> list[tuple[str, Principal]]:
    """(digest, principal) of each key a configuration names: `server.api_keys` (each an
    admin's) and each principal's keys."""
    out = [(digest(k), API_KEYS) for k in api_keys]
    for who, keys in principals:
        out += [(digest_of_configured(k), who) for k in keys]
    return out


class KeyRing:
    """The principals' keys by digest. Empty: no key is configured, every caller is `ANYONE`."""

    def __init__(self, keys: Iterable[tuple[str, Principal]] = ()) -> None:
        by_digest: dict[bytes, Principal] = {}
        for hexed, who in keys:
            by_digest.setdefault(bytes.fromhex(hexed), who)
        self._entries = tuple(by_digest.items())

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, key: bytes) -> Principal | None:
        """The principal whose key `key` is, or None."""
        if not key:
            return None
        # Every stored digest is compared, each in constant time and none skipped: how long a
        # refusal takes says nothing of the keys (tens of keys: a few microseconds).
        d = hashlib.sha256(key).digest()
        found = None
        for stored, who in self._entries:
            if hmac.compare_digest(d, stored):
                found = who
        return found

    def principals(self) -> list[Principal]:
        return sorted({who for _, who in self._entries}, key=lambda p: p.name)
