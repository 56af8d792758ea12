"""Tiers by folder: tests/unit (pure; `property` and `scenario` marked inside), tests/contract
(one suite over every store), tests/e2e."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.pgserver import suite_url


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.path)
        if "/tests/unit/" in path:
            item.add_marker(pytest.mark.unit)
        elif "/tests/integration/" in path:
            item.add_marker(pytest.mark.integration)
        elif "/tests/contract/" in path:
            item.add_marker(pytest.mark.contract)
        elif "/tests/e2e/" in path:
            item.add_marker(pytest.mark.e2e)


# 127.0.0.1:5432/test, or a throwaway cluster when nothing answers there. Called on import:
# pytest-xdist's controller imports this first and its workers inherit the URL it settles on.
PG_URL = suite_url()


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store URL: a new SQLite file, or a PostgreSQL schema of its own (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/tasks.db"
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield f"{PG_URL}?schema={schema}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
