"""Corral: schedule LLM work across local model backends so the device generates, not swaps.

The public names load on first use (PEP 562), so a process that needs only one part, such as
`corral sim-backend` or `corral version`, does not pay for pydantic, the stores and the worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.config import Config, load_config, parse_config
    from corral.errors import ConfigError, CorralError, TraceError
    from corral.queue import Queue, TaskCancelled, TaskFailed, UnknownKind
    from corral.store import BadTask, QueueFull
    from corral.worker.registry import Fail, current_task

__version__ = "0.1.0"

_HOMES = {
    "Config": "corral.config",
    "load_config": "corral.config",
    "parse_config": "corral.config",
    "ConfigError": "corral.errors",
    "CorralError": "corral.errors",
    "TraceError": "corral.errors",
    "Queue": "corral.queue",
    "TaskCancelled": "corral.queue",
    "TaskFailed": "corral.queue",
    "UnknownKind": "corral.queue",
    "BadTask": "corral.store",
    "QueueFull": "corral.store",
    "Fail": "corral.worker.registry",
    "current_task": "corral.worker.registry",
}
__all__ = [
    "BadTask",
    "Config",
    "ConfigError",
    "CorralError",
    "Fail",
    "Queue",
    "QueueFull",
    "TaskCancelled",
    "TaskFailed",
    "TraceError",
    "UnknownKind",
    "__version__",
    "current_task",
    "load_config",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'corral' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
