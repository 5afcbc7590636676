"""Provenance of a run's results: the library versions and machine it ran on, and the training fields it records.

[`~grpo_hf.model_card.results_from_trainer`] (the card of `GRPOTrainer.push_to_hub` and the run summary of
`GRPOTrainer.save_model`) records these, and so do the application's comparison and `grpo-hf train` in
`results.json`; [`jsonable`] turns any value into plain JSON.
"""

from __future__ import annotations

import enum
import math
import os
import sys
from typing import Any

import torch


# The training fields a comparison's results record (with every model, data and grpo_*/cost_* field).
SUMMARY_TRAINING_KEYS = (
    "output_dir seed max_steps num_train_epochs per_device_train_batch_size per_device_eval_batch_size "
    "gradient_accumulation_steps learning_rate lr_scheduler_type warmup_steps weight_decay max_grad_norm optim "
    "logging_steps bf16 fp16"
).split()


def package_version(name: str) -> str | None:
    """The installed version of the package `name`, `None` when it is not installed."""
    import importlib.metadata as metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def capture_environment() -> dict[str, Any]:
    """Versions, platform, CPUs, torch threads and GPU of this run, for `results.json`."""
    import platform

    env = {"python": sys.version, "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        env["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for package in ("torch", "transformers", "accelerate", "peft", "evaluate", "grpo_hf"):
        env[package] = package_version(package)
    env["torch_threads"] = torch.get_num_threads()
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: enums by value, dict keys as strings, non-finite floats and other objects as strings."""
    if isinstance(value, enum.Enum):  # before str: transformers' enums are str subclasses
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


__all__ = ["SUMMARY_TRAINING_KEYS", "capture_environment", "jsonable"]
