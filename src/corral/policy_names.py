"""The scheduling policies' names, apart from the config so that light entry points (the CLI's
help text) need not import pydantic."""

from __future__ import annotations

from typing import Literal

PolicyName = Literal["fifo", "grouped", "fifo-plus", "priority", "cost"]
POLICY_NAMES: tuple[PolicyName, ...] = ("fifo", "grouped", "fifo-plus", "priority", "cost")
# The simulator also runs peers' rules as baselines (never the live system): `lru-route` is Ray
# Serve's model multiplexing (corral/sim/lru_route.py), `llama-swap` llama-swap's FIFO scheduler
# (corral/sim/baselines.py).
SimPolicyName = PolicyName | Literal["lru-route", "llama-swap"]
SIM_POLICY_NAMES: tuple[SimPolicyName, ...] = (*POLICY_NAMES, "lru-route", "llama-swap")
