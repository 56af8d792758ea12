"""Principals and keys: the ring, the key file `corral keys` keeps, the config's principals and
which routes are admin routes."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from corral.access.keyfile import KeyFile, KeyFileError
from corral.access.live import Access
from corral.access.principals import (
    API_KEYS,
    KeyRing,
    Principal,
    configured_keys,
    digest,
    digest_of_configured,
    new_key,
)
from corral.config import parse_config
from corral.errors import ConfigError
from corral.gateway.doors.app import admin_route

ALICE = Principal("alice", "user")
MODELS = "models:\n  m: {load_s: 1}\n"


def test_the_ring_finds_a_principal_by_its_key_and_nothing_else() -> None:
    key = new_key()
    ring = KeyRing([(digest(key), ALICE), (digest("other"), API_KEYS)])
    assert ring.find(key.encode()) == ALICE
    assert ring.find(b"other") == API_KEYS
    assert ring.find(key.encode()[:-1]) is None
    assert ring.find(b"") is None
    assert len(ring) == 2
    assert not KeyRing()  # no key at all: open


def test_a_configured_key_is_the_key_or_its_digest() -> None:
    assert digest_of_configured("plain") == digest("plain")
    assert digest_of_configured("sha256:" + digest("plain").upper()) == digest("plain")
    with pytest.raises(ValueError, match="64 hex digits"):
        digest_of_configured("sha256:abc")


def test_the_config_names_principals_and_refuses_bad_names_and_digests() -> None:
    cfg = parse_config(
        MODELS + "server:\n  api_keys: [k0]\n  principals:\n"
        "    team-a: {role: user, keys: [k1, k2]}\n    ops: {role: admin, keys: [k3]}\n"
    )
    srv = cfg.server
    access = Access(
        configured_keys(
            srv.api_keys,
            [(Principal(n, p.role, tuple(p.models)), p.keys) for n, p in srv.principals.items()],
        ),
        None,
    )
    assert access.ring.find(b"k0") == API_KEYS
    assert access.ring.find(b"k2") == Principal("team-a", "user")
    assert access.ring.find(b"k3") == Principal("ops", "admin")
    with pytest.raises(ConfigError, match="cannot name a principal"):
        parse_config(MODELS + "server:\n  principals:\n    'no spaces': {keys: [k]}\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        parse_config(MODELS + "server:\n  principals:\n    a: {keys: ['sha256:00']}\n")
    with pytest.raises(ConfigError, match="role"):
        parse_config(MODELS + "server:\n  principals:\n    a: {role: root, keys: [k]}\n")


def test_the_key_file_keeps_digests_one_role_a_principal_and_revokes(tmp_path: Path) -> None:
    file = KeyFile(tmp_path)
    key, entry, who = file.create("alice", None)
    assert who == ALICE
    assert key not in file.path.read_text()
    assert digest(key) in file.path.read_text()
    assert file.path.stat().st_mode & 0o777 == 0o600
    second, _, _ = file.create("alice", "user")
    with pytest.raises(KeyFileError, match="already a user"):
        file.create("alice", "admin")
    with pytest.raises(ValueError, match="cannot name"):
        file.create("../etc", None)
    ring = Access([], file).ring
    assert ring.find(key.encode()) == ring.find(second.encode()) == ALICE
    (done,) = file.revoke(entry.id)
    assert done.id == entry.id
    assert done.revoked_at is not None
    ring = Access([], file).ring
    assert ring.find(key.encode()) is None
    assert ring.find(second.encode()) == ALICE
    assert len(file.revoke("alice")) == 1  # every key of the principal left
    with pytest.raises(KeyFileError, match="no key to revoke"):
        file.revoke("alice")


def test_a_malformed_entry_is_skipped_and_named_and_a_damaged_file_is_an_error(
    tmp_path: Path,
) -> None:
    file = KeyFile(tmp_path)
    good, _, _ = file.create("alice", None)
    data = json.loads(file.path.read_text())
    data["keys"] += [{"principal": "bob", "sha256": "zz"}, "nonsense"]
    data["principals"]["eve"] = {"role": "root"}
    file.path.write_text(json.dumps(data))
    book = file.read()
    assert [k.principal for k in book.keys] == ["alice"]
    assert len(book.problems) == 3
    assert any("keys[1] skipped" in p and "sha256" in p for p in book.problems)
    assert any("'eve'" in p for p in book.problems)
    assert Access([], file).ring.find(good.encode()) == ALICE
    file.path.write_text("[1, 2]")
    with pytest.raises(KeyFileError, match="not a Corral key file"):
        file.read()
    with pytest.raises(KeyFileError, match="not a Corral key file"):
        Access([], file)  # never serves without the keys it was given
    with pytest.raises(KeyFileError):
        file.create("bob", None)  # a file it cannot read is never overwritten
    assert file.path.read_text() == "[1, 2]"


def _create_many(folder: str, name: str) -> None:
    for _ in range(10):
        KeyFile(Path(folder)).create(name, "user")


def test_keys_created_at_once_by_several_processes_are_all_kept(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_create_many, args=(str(tmp_path), f"p{i}")) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    book = KeyFile(tmp_path).read()
    assert len(book.keys) == 40
    assert len({k.sha256 for k in book.keys}) == 40


@pytest.mark.parametrize(
    ("path", "admin"),
    [
        ("/api/models/alpha/load", True),
        ("/api/models/alpha/unload", True),
        ("/api/models/alpha/logs", True),
        ("/api/models/unload", True),
        ("/api/models/unload/alpha", True),
        ("/unload", True),
        ("/logs", True),
        ("/logs/stream", True),
        ("/api/status", False),
        ("/v1/models", False),
        ("/v1/chat/completions", False),
        ("/running", False),
        ("/api/events", False),
    ],
)
def test_admin_routes(path: str, admin: bool) -> None:
    assert admin_route(path) is admin


def test_a_principal_may_use_the_models_its_globs_match() -> None:
    narrow = Principal("ci", "user", ("qwen*", "embed"))
    assert narrow.may_use("qwen3-8b")
    assert narrow.may_use("embed")
    assert not narrow.may_use("embed-large")
    assert not narrow.may_use("Qwen3")  # case-sensitive, as model names are
    assert ALICE.may_use("anything")  # no globs: every model


def test_the_key_file_keeps_a_principals_models(tmp_path: Path) -> None:
    file = KeyFile(tmp_path)
    key, _, who = file.create("ci", None, ["qwen*"])
    assert who.models == ("qwen*",)
    _, _, again = file.create("ci", None)  # another key keeps them
    assert again.models == ("qwen*",)
    found = Access([], file).ring.find(key.encode())
    assert found is not None
    assert found.models == ("qwen*",)
    assert not found.may_use("gemma")
    _, _, wider = file.create("ci", None, [])  # an empty list: every model
    assert wider.models == ()
    data = json.loads(file.path.read_text())
    data["principals"]["ci"]["models"] = "qwen*"
    file.path.write_text(json.dumps(data))
    book = file.read()
    assert any("models is not a list" in p for p in book.problems)
    assert book.live() == []  # its keys are not accepted with a principal not understood
