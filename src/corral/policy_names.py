"""The scheduling policies' names, apart from the config so that light entry points (the CLI's
help text) need not import pydantic."""

from __future__ import annotations

from typing import Literal

PolicyName = Literal["fifo", "grouped", "fifo-plus", "priority", "cost"]
POLICY_NAMES: tuple[PolicyName, ...] = ("fifo", "grouped", "fifo-plus", "priority", "cost")
