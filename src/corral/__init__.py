"""Corral: schedule LLM work across local model backends so the device generates, not swaps."""

from corral.config import Config, load_config, parse_config
from corral.errors import ConfigError, CorralError, TraceError

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "CorralError",
    "TraceError",
    "__version__",
    "load_config",
    "parse_config",
]
