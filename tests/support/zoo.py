"""The tiny model zoo (corral.zoo), written once per test session where a test needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.zoo import ARCHS, make_zoo


def zoo_folder(factory: pytest.TempPathFactory) -> Path:
    """A folder holding one tiny file of every zoo architecture (a few MB each)."""
    folder = factory.mktemp("zoo")
    made = make_zoo(folder)
    assert [z.arch for z in made] == list(ARCHS)
    return folder
