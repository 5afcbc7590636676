"""grpo_hf: grouped parameter resource optimization (GRPO) for the Hugging Face Trainer.

Not TRL's Group Relative Policy Optimization: import `GRPOTrainer` from `grpo_hf`.

The top-level module is lazy, as `import trl` and `import transformers` are: `import grpo_hf` imports nothing heavy,
and each name of `__all__` imports its module (torch, transformers) when first used, so that `grpo-hf --help`
answers at once. `from grpo_hf import GRPOTrainer`, `dir(grpo_hf)` and type checkers see every name as usual.

The library is this package's top level ([`GRPOConfig`], [`GRPOTrainer`], `callbacks`, `grouping`, `importance`,
`replica_groups`, `checkpoints`, `errors`, `files`, `model_card`, `hub_guards`, `provenance`, `choices`,
`compression/`, `cost/`); it never imports, nor names, the application around it: the `grpo-hf` command, its recipes,
comparisons and reports, and `grpo-hf publish`, which live in sub-packages of their own (see `docs/architecture.md`).
"""

import importlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from .callbacks import GRPOCallback
    from .compression import GRPOCommState, grpo_comm_hook
    from .config import GRPOConfig
    from .cost.callback import CostCallback
    from .errors import CheckpointError, ConfigError, GroupConfigError, GRPOError, GRPOInputError, OutputDirError
    from .files import atomic_write
    from .grouping import GroupRule, GroupSpec, assign_groups, load_group_spec
    from .importance import ImportanceState, normalised_multipliers
    from .replica_groups import shard_replica_groups
    from .trainer import GRPOMixin, GRPOTrainer

# Each public name and the module (relative to this package) that defines it.
_EXPORTS = {
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "CostCallback": "cost.callback",
    "GRPOCallback": "callbacks",
    "GRPOCommState": "compression",
    "GRPOConfig": "config",
    "GRPOError": "errors",
    "GRPOInputError": "errors",
    "GRPOMixin": "trainer",
    "GRPOTrainer": "trainer",
    "GroupConfigError": "errors",
    "GroupRule": "grouping",
    "GroupSpec": "grouping",
    "ImportanceState": "importance",
    "OutputDirError": "errors",
    "assign_groups": "grouping",
    "atomic_write": "files",
    "grpo_comm_hook": "compression",
    "load_group_spec": "grouping",
    "normalised_multipliers": "importance",
    "shard_replica_groups": "replica_groups",
}
__all__ = [
    "CheckpointError",
    "ConfigError",
    "CostCallback",
    "GRPOCallback",
    "GRPOCommState",
    "GRPOConfig",
    "GRPOError",
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
    "shard_replica_groups",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (and `__version__` from the package metadata)."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("grpo_hf")
        except PackageNotFoundError:  # imported from a source tree that was never `pip install`ed
            value = "0+unknown"
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
