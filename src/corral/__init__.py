"""Corral: schedule LLM work across local model backends so the device generates, not swaps."""

from corral.config import Config, load_config, parse_config
from corral.errors import ConfigError, CorralError, TraceError
from corral.queue import Queue, TaskCancelled, TaskFailed, UnknownKind
from corral.worker.registry import Fail, current_task

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "CorralError",
    "Fail",
    "Queue",
    "TaskCancelled",
    "TaskFailed",
    "TraceError",
    "UnknownKind",
    "__version__",
    "current_task",
    "load_config",
    "parse_config",
]
