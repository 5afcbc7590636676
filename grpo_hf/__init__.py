"""grpo_hf: grouped parameter resource optimization (GRPO) for the Hugging Face Trainer.

Not TRL's Group Relative Policy Optimization: import `GRPOTrainer` from `grpo_hf`.
"""

from importlib.metadata import PackageNotFoundError, version


try:
    __version__ = version("grpo_hf")
except PackageNotFoundError:  # imported from a source tree that was never `pip install`ed
    __version__ = "0+unknown"

from .callbacks import CostCallback, GRPOCallback
from .compression import GRPOCommState, grpo_comm_hook
from .config import GRPOConfig
from .errors import CheckpointError, ConfigError, GroupConfigError, GRPOInputError, OutputDirError
from .files import atomic_write
from .grouping import GroupRule, GroupSpec, assign_groups, load_group_spec
from .importance import ImportanceState, normalised_multipliers
from .trainer import GRPOMixin, GRPOTrainer


__all__ = [
    "CheckpointError",
    "ConfigError",
    "CostCallback",
    "GRPOCallback",
    "GRPOCommState",
    "GRPOConfig",
    "GRPOInputError",
    "GRPOMixin",
    "GRPOTrainer",
    "GroupConfigError",
    "GroupRule",
    "GroupSpec",
    "ImportanceState",
    "OutputDirError",
    "assign_groups",
    "atomic_write",
    "grpo_comm_hook",
    "load_group_spec",
    "normalised_multipliers",
]
