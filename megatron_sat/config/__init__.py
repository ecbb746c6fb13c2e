"""Typed run configuration, the bottom of the package's layers above the pure maths: one
dataclass per section (``run``: data, rollout, train and the whole run; ``parallel``;
``launch``), loaded from YAML plus dotted overrides, and the layout checks across sections
(``layout``). Nothing here imports the training, rollout or launch code."""

from megatron_sat.config.launch import LaunchConfig
from megatron_sat.config.parallel import ParallelConfig
from megatron_sat.config.run import (
    DataConfig,
    LoggingConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    load_config,
)

__all__ = [
    "DataConfig",
    "LaunchConfig",
    "LoggingConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "load_config",
]
