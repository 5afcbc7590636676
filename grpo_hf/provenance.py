"""Provenance of a run's results: the library versions and machine it ran on, and the settings it depended on.

A comparison ([`~grpo_hf.compare.compare`]), `grpo-hf train` and
[`~grpo_hf.model_card.results_from_trainer`] record these in `results.json`, converted to plain JSON values by
`_jsonable`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import sys
from typing import Any

import torch

from .arguments import DataArguments, ModelArguments


# The training fields a comparison's results record (with every model, data and grpo_*/cost_* field).
SUMMARY_TRAINING_KEYS = (
    "output_dir seed max_steps num_train_epochs per_device_train_batch_size per_device_eval_batch_size "
    "gradient_accumulation_steps learning_rate lr_scheduler_type warmup_steps weight_decay max_grad_norm optim "
    "logging_steps bf16 fp16"
).split()


def capture_environment() -> dict[str, Any]:
    """Versions, platform, CPUs, torch threads and GPU of this run, for `results.json`."""
    import importlib.metadata as metadata
    import platform

    env = {"python": sys.version, "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        env["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for package in ("torch", "transformers", "accelerate", "peft", "evaluate", "grpo_hf"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    env["torch_threads"] = torch.get_num_threads()
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before str: transformers' enums are str subclasses
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def recipe_summary(model_args: ModelArguments, data_args: DataArguments, args) -> dict[str, Any]:
    """The settings a comparison depends on: every model and data field, and the training fields that matter."""
    from .config import grpo_field_names

    return _jsonable(
        {
            "model": dataclasses.asdict(model_args),
            "data": dataclasses.asdict(data_args),
            "training": {k: getattr(args, k) for k in SUMMARY_TRAINING_KEYS},
            "grpo": {k: getattr(args, k) for k in grpo_field_names()},
        }
    )


__all__ = ["SUMMARY_TRAINING_KEYS", "capture_environment", "recipe_summary"]
