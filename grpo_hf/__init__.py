"""grpo_hf: grouped parameter resource optimisation (GRPO) for the Hugging Face Trainer.

Not TRL's Group Relative Policy Optimization: import `GRPOTrainer` from `grpo_hf`.
"""

__version__ = "0.1.0.dev0"

from .callbacks import CostCallback, GRPOCallback
from .config import GRPOConfig
from .grouping import GroupConfigError, GroupRule, GroupSpec, assign_groups, load_group_spec
from .importance import ImportanceState, normalised_multipliers
from .trainer import GRPOMixin, GRPOTrainer


__all__ = [
    "CostCallback",
    "GRPOCallback",
    "GRPOConfig",
    "GRPOMixin",
    "GRPOTrainer",
    "GroupConfigError",
    "GroupRule",
    "GroupSpec",
    "ImportanceState",
    "assign_groups",
    "load_group_spec",
    "normalised_multipliers",
]
