"""The one YAML file that describes devices, models and the scheduler.

`load_config(path)` parses and validates it; every problem is reported at once with its key
path and line (`ConfigError`). Unknown keys are errors so that typos never pass silently.

The map: `models.py` (a model's, a device's and the scheduler's settings), `server.py`
(`server:` and `batch:`), `schema.py` (`Config`, the rules across sections), `load.py` (YAML
with line numbers, errors).
"""

from corral.config.load import load_config, node_lines, parse_config, read_config_text
from corral.config.models import (
    CapabilitiesConfig,
    CoalesceConfig,
    CostConfig,
    DeviceConfig,
    FiltersConfig,
    HookConfig,
    HostConfig,
    ModelConfig,
    SchedulerConfig,
    SleepConfig,
)
from corral.config.schema import Config, ModelsDir
from corral.config.server import BatchConfig, PromptCacheConfig, ServerConfig, data_dir
from corral.policy_names import POLICY_NAMES, PolicyName

__all__ = [
    "POLICY_NAMES",
    "BatchConfig",
    "CapabilitiesConfig",
    "CoalesceConfig",
    "Config",
    "CostConfig",
    "DeviceConfig",
    "FiltersConfig",
    "HookConfig",
    "HostConfig",
    "ModelConfig",
    "ModelsDir",
    "PolicyName",
    "PromptCacheConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SleepConfig",
    "data_dir",
    "load_config",
    "node_lines",
    "parse_config",
    "read_config_text",
]
