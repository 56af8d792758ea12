"""The store's named SQL (store/queries.sql and the dialects' files beside their adapters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from corral.store import queries
from corral.store.queries import SQL, load, parse

# What callers fill in at run time; anything else in braces is a misspelt include.
RUNTIME = {"notify", "new_token", "lock_skip", "sets", "shown", "where", "direction", "expect"}
RUNTIME |= {"keep", "channel"}


@pytest.mark.parametrize("filename", ["queries.sql", "sqlite.sql", "postgres.sql"])
def test_every_entry_loads_with_its_includes_resolved(filename: str) -> None:
    entries = SQL if filename == "queries.sql" else load(filename, SQL)
    assert entries
    for name, sql in entries.items():
        assert sql, name
        assert not sql.endswith(";"), name
        assert "-- " not in sql, name  # the entry's comment lines are not sent
        assert set(re.findall(r"\{(\w+)\}", sql)) <= RUNTIME, name


def test_includes_expand_and_a_repeated_name_is_refused() -> None:
    assert SQL["claimable"] in SQL["ready_counts"]
    assert SQL["claimable"] in load("postgres.sql", SQL)["claim"]
    assert "p.rn <= :start" not in load("postgres.sql", SQL)["claim"]  # its own starts
    assert parse("-- name: a\n-- the doc\nSELECT {b};\n-- name: b\n1\n", "x.sql") == {
        "a": "SELECT 1",
        "b": "1",
    }
    with pytest.raises(ValueError, match=r"x\.sql: an entry name appears twice"):
        parse("-- name: a\nSELECT 1;\n\n-- name: a\nSELECT 2;\n", "x.sql")


def test_every_named_statement_is_used() -> None:
    """An entry nothing names is dead SQL: each is named by the store's code or included."""
    store = Path(queries.__file__).parent
    code = "\n".join(p.read_text() for p in store.glob("*.py"))
    texts = "\n".join(p.read_text() for p in store.glob("*.sql"))
    for filename in ("queries.sql", "sqlite.sql", "postgres.sql"):
        for name in load(filename, SQL):
            assert f'"{name}"' in code or "{" + name + "}" in texts, (filename, name)
