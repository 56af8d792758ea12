"""The keys `corral keys` keeps: `keys.json` in the data directory, digests only.

    {"version": 1,
     "principals": {"alice": {"role": "user", "models": ["qwen*"],
                              "limits": {"requests_per_minute": 60}}},
     "keys": [{"id": "key_...", "principal": "alice", "sha256": "<hex>",
               "created_at": 1733100000.0, "revoked_at": null}]}

Written whole (`atomic.replace_text`, mode 0600) under an exclusive lock on `keys.json.lock`,
so two `corral keys` at once never lose each other's key. Read by `corral serve` at start and
again when it changes (`Access`): an entry that is not well formed is skipped and named; a
file that cannot be read or parsed at all is an error at start (Corral never opens up because
a key file is damaged) and, later, keeps the keys read before."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import getpass
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.access.limits import NO_LIMITS, Limits
from corral.access.principals import (
    CLASSES,
    ROLES,
    Principal,
    Role,
    ServiceClass,
    check_name,
    digest,
    key_id,
    new_key,
)
from corral.atomic import replace_text
from corral.errors import CorralError

KEY_FILE = "keys.json"
MAX_FILE_BYTES = 16 * 1024 * 1024


class KeyFileError(CorralError):
    """The key file cannot be read, parsed or changed as asked."""


@dataclass(frozen=True)
class StoredKey:
    id: str
    principal: str
    sha256: str
    created_at: float
    revoked_at: float | None = None
    created_by: str = ""  # the account that ran `corral keys create` (the audit log's who)
    revoked_by: str = ""


@dataclass(frozen=True)
class KeyBook:
    """What the file holds: each principal (its role and models), every key (revoked ones
    too), and the entries skipped as malformed (`problems`, each naming its entry)."""

    principals: dict[str, Principal]
    keys: list[StoredKey]
    problems: list[str]

    def live(self) -> list[tuple[str, Principal]]:
        """(digest, principal) of each key not revoked whose principal is well formed."""
        return [
            (k.sha256, self.principals[k.principal])
            for k in self.keys
            if k.revoked_at is None and k.principal in self.principals
        ]


class KeyFile:
    """`keys.json` in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / KEY_FILE

    def stamp(self) -> tuple[int, int] | None:
        """The file's (mtime in ns, size), None if it does not exist: a change to look for."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def read(self) -> KeyBook:
        """The book (empty if there is no file); KeyFileError if the file cannot be read or is
        not a key file at all."""
        return _book(self.path, self._data())

    def _data(self) -> dict[str, Any]:
        """The file's object (an empty key file's if there is none); KeyFileError as `read`."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {"version": 1, "principals": {}, "keys": []}
        except OSError as exc:
            raise KeyFileError(f"{self.path}: cannot read the key file: {exc}") from exc
        if len(raw) > MAX_FILE_BYTES:
            raise KeyFileError(f"{self.path}: over {MAX_FILE_BYTES} bytes; not a key file")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise KeyFileError(
                f"{self.path}: not JSON ({exc}); restore it from a backup, or move it away and "
                "create the keys again with `corral keys create`"
            ) from exc
        if not isinstance(data, dict) or data.get("version") != 1:
            raise KeyFileError(f'{self.path}: not a Corral key file (no "version": 1)')
        return data

    def create(
        self,
        principal: str,
        role: Role | None,
        models: list[str] | None = None,
        limits: Limits | None = None,
        weight: float | None = None,
        highest_class: ServiceClass | None = None,
    ) -> tuple[str, StoredKey, Principal]:
        """A new key for `principal` (made with `role`, default user, if new): the key itself
        (shown once, never kept), its entry and the principal. `models` (names or globs)
        replaces the models it may use, `limits` its limits, `weight` its weight in fair
        shares, `highest_class` the highest service class it may ask for. KeyFileError if
        `principal` exists with another role."""
        check_name(principal)
        with self._locked():
            data = self._data()  # a file this cannot parse is never overwritten
            roles = data.setdefault("principals", {})
            if not isinstance(roles, dict):
                raise KeyFileError(f'{self.path}: "principals" is not an object; mend it first')
            had = _book(self.path, data).principals.get(principal)
            if had is not None and role is not None and had.role != role:
                raise KeyFileError(
                    f"{principal} is already a {had.role}; a principal has one role (revoke its "
                    "keys and create them under another name, or leave out --role)"
                )
            who = Principal(
                principal,
                had.role if had is not None else (role or "user"),
                tuple(models) if models is not None else (had.models if had else ()),
                limits if limits is not None else (had.limits if had else NO_LIMITS),
                weight if weight is not None else (had.weight if had else 1.0),
                highest_class or (had.highest_class if had else "interactive"),
            )
            bounds = {k: v for k, v in dataclasses.asdict(who.limits).items() if v is not None}
            roles[principal] = {
                "role": who.role,
                **({"models": list(who.models)} if who.models else {}),
                **({"limits": bounds} if bounds else {}),
                **({"weight": who.weight} if who.weight != 1.0 else {}),
                **(
                    {"highest_class": who.highest_class}
                    if who.highest_class != "interactive"
                    else {}
                ),
            }
            key = new_key()
            hexed = digest(key)
            entry = StoredKey(key_id(hexed), principal, hexed, time.time(), None, _account())
            data.setdefault("keys", []).append(entry.__dict__.copy())
            self._write(data)
        return key, entry, who

    def revoke(self, ref: str) -> list[StoredKey]:
        """Revoke the key with id `ref`, or every key of principal `ref`: the keys revoked now.
        KeyFileError if `ref` names no key that is not revoked yet."""
        with self._locked():
            data = self._data()
            now = time.time()
            done = []
            for k in data.get("keys", []):
                if not isinstance(k, dict) or k.get("revoked_at") is not None:
                    continue
                if ref in (k.get("id"), k.get("principal")):
                    k["revoked_at"] = now
                    k["revoked_by"] = _account()
                    done.append(k)
            if not done:
                raise KeyFileError(
                    f"no key to revoke with id or principal {ref!r} in {self.path} "
                    "(`corral keys list` shows them)"
                )
            self._write(data)
        return [_stored(k) for k in done]

    def _write(self, data: dict[str, Any]) -> None:
        replace_text(self.path, json.dumps(data, indent=1) + "\n")
        os.chmod(self.path, 0o600)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(KEY_FILE + ".lock")
        with lock.open("a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _book(path: Path, data: dict[str, Any]) -> KeyBook:
    problems: list[str] = []
    found: dict[str, Principal] = {}
    principals = data.get("principals", {})
    if not isinstance(principals, dict):
        problems.append(f'{path}: "principals" is not an object; no principal read')
        principals = {}
    for name, spec in principals.items():
        role = spec.get("role") if isinstance(spec, dict) else None
        if role not in ROLES:
            problems.append(f"{path}: principal {name!r}: role {role!r} is not admin or user")
            continue
        models = spec.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            problems.append(f"{path}: principal {name!r}: models is not a list of names")
            continue
        bounds = spec.get("limits", {})
        fields = Limits.__dataclass_fields__
        if not isinstance(bounds, dict) or not all(
            k in fields and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in bounds.items()
        ):
            problems.append(
                f"{path}: principal {name!r}: limits must map {', '.join(fields)} to whole "
                "numbers of at least 1"
            )
            continue
        weight = spec.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0 < weight <= 1000
        ):
            problems.append(
                f"{path}: principal {name!r}: weight must be a number above 0, at most 1000"
            )
            continue
        highest = spec.get("highest_class", "interactive")
        if highest not in CLASSES:
            problems.append(
                f"{path}: principal {name!r}: highest_class must be interactive or batch"
            )
            continue
        found[name] = Principal(name, role, tuple(models), Limits(**bounds), float(weight), highest)
    keys: list[StoredKey] = []
    entries = data.get("keys", [])
    if not isinstance(entries, list):
        problems.append(f'{path}: "keys" is not a list; no key read')
        entries = []
    for i, k in enumerate(entries):
        try:
            keys.append(_stored(k))
        except (TypeError, ValueError) as exc:
            problems.append(f"{path}: keys[{i}] skipped: {exc}")
    return KeyBook(found, keys, problems)


def _stored(k: object) -> StoredKey:
    if not isinstance(k, dict):
        raise TypeError("not an object")
    hexed = k.get("sha256")
    if not isinstance(hexed, str) or len(hexed) != 64:
        raise ValueError('"sha256" is not 64 hex digits')
    bytes.fromhex(hexed)
    principal = k.get("principal")
    if not isinstance(principal, str):
        raise ValueError('"principal" is not a name')
    created = k.get("created_at", 0.0)
    revoked = k.get("revoked_at")
    if not isinstance(created, int | float) or not (
        revoked is None or isinstance(revoked, int | float)
    ):
        raise ValueError('"created_at" and "revoked_at" are epoch seconds')
    return StoredKey(
        str(k.get("id") or key_id(hexed)),
        principal,
        hexed.lower(),
        float(created),
        None if revoked is None else float(revoked),
        str(k.get("created_by") or "")[:64],
        str(k.get("revoked_by") or "")[:64],
    )


def _account() -> str:
    """The account running this command (who made or revoked a key, for the audit log)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        return f"uid {os.getuid()}"
