"""Tiers by folder: tests/unit (pure; `property` and `scenario` marked inside), tests/contract
(one suite over every store), tests/e2e."""

from __future__ import annotations

import pytest


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
