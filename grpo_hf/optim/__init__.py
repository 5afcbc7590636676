"""Optimizer state per group: [`GroupedAdamW`], the layouts GRPO's groups choose for it, the one reader of an
optimizer's moments, and the bytes an optimizer's state takes."""

from .grouped_adamw import GroupedAdamW
from .layout import (
    DEFAULT_MIN_STATE_NUMEL,
    DEFAULT_OPTIMIZER_STATE,
    OPTIMIZER_STATE_CHOICES,
    PRESETS,
    StateLayout,
    resolve_layouts,
)


__all__ = [
    "DEFAULT_MIN_STATE_NUMEL",
    "DEFAULT_OPTIMIZER_STATE",
    "OPTIMIZER_STATE_CHOICES",
    "PRESETS",
    "GroupedAdamW",
    "StateLayout",
    "resolve_layouts",
]
