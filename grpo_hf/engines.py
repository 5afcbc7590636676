"""What GRPO needs of the engine a Trainer runs on: DDP, FSDP2 (`fully_shard`) or DeepSpeed ZeRO.

- **Settings**: which engine the arguments and the launcher ask for, and the refusals before any work, are
  [`~grpo_hf.engine_settings`]'s (no torch needed there).
- **FSDP2**: `fully_shard` replaces every parameter by a new `DTensor` parameter (same name), so GRPO's groups follow
  the sharded model by name ([`follow_parameters`]), and a group's gradient norm is the square root of the sum, over
  the shards of the FSDP mesh, of each rank's local sum of squares ([`sum_over_shards`]: gathered and added in rank
  order, so every rank gets the same bits).
- **DeepSpeed**: ZeRO steps the optimizer GRPO built (its param groups survive; ZeRO swaps their parameters for flat
  fp32 partitions) inside `accelerator.backward`, before any Trainer callback runs. [`OptimizerStepProbe`] therefore
  hooks that optimizer's `step`: it reads each group's partition of the gradient as ZeRO steps it (sums of squares,
  and the dot products with Adam's `exp_avg` for the coherence score) and applies each group's LR factor for that
  step only. The sums are gathered over the ranks after the step, so importance multipliers computed from step `t`
  apply from step `t + 1` on (one step later than under DDP and FSDP2; the scores are smoothed over ~10 steps anyway).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from .engine_settings import check_deepspeed_config, engine_from_environment, refuse_fsdp1
from .errors import ConfigError
from .optim.moments import first_moment


logger = logging.getLogger(__name__)


def detect_engine(trainer) -> str:
    """
    The engine a Trainer trains on: `"deepspeed"`, `"fsdp2"` (Accelerate's FSDP plugin at version 2, or a model sharded
    with `fully_shard` before it reached the Trainer, e.g. loaded with transformers' `DistributedConfig`), `"ddp"`
    (several processes otherwise) or `"single"`.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: the Trainer runs FSDP1, or DeepSpeed with a config GRPO refuses.
    """
    if trainer.is_deepspeed_enabled:
        plugin = trainer.accelerator.state.deepspeed_plugin
        check_deepspeed_config(plugin.deepspeed_config, "the DeepSpeed config")
        return "deepspeed"
    if trainer.is_fsdp_enabled:
        version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            origin = engine_from_environment("fsdp", trainer.args)
            if origin:
                raise ConfigError(
                    f"Accelerate's FSDP plugin is at version {version} (FSDP1), and GRPOTrainer runs on FSDP2 only."
                    + origin
                    + " To train with FSDP, use FSDP2: `fsdp` and `fsdp_config={'version': 2}` in the arguments."
                )
            refuse_fsdp1(f"Accelerate's FSDP plugin is at version {version}")
        return "fsdp2"
    if trainer.model is not None and has_fsdp2_units(trainer.model):
        return "fsdp2"
    accelerator = trainer.accelerator
    if accelerator.num_processes > 1 and accelerator.distributed_type.value.startswith("MULTI_"):
        return "ddp"
    return "single"


def deepspeed_zero_stage(trainer) -> int:
    """The ZeRO stage of a Trainer running DeepSpeed."""
    return check_deepspeed_config(trainer.accelerator.state.deepspeed_plugin.deepspeed_config, "the DeepSpeed config")


# ----------------------------------------------------------------------------------------------------------------
# FSDP2
# ----------------------------------------------------------------------------------------------------------------


def has_fsdp2_units(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model` or one of its submodules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def canonical_name(name: str) -> str:
    """A parameter name without the prefixes that wrappers add (`torch.compile`, activation checkpointing)."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
    return name.replace("._orig_mod", "").removeprefix("_orig_mod.")


def follow_parameters(groups, model: nn.Module) -> bool:
    """
    Point every [`~grpo_hf.grouping.ParameterGroup`] at `model`'s parameters of the same (canonical) names, in place;
    returns whether any parameter object changed (as `fully_shard` replaces them by `DTensor` parameters).

    Raises:
        `ValueError`: a grouped parameter is not in `model` (the model was changed after GRPO grouped it).
    """
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    changed = False
    for group in groups:
        missing = [n for n in group.param_names if canonical_name(n) not in named]
        if missing:
            raise ValueError(
                f"GRPO group {group.name!r}: the prepared model has no parameter {missing[0]!r} (of {len(missing)} "
                "missing): the model was changed after GRPOTrainer grouped its parameters. Build the trainer with the "
                "final model."
            )
        params = [named[canonical_name(n)] for n in group.param_names]
        changed |= any(a is not b for a, b in zip(params, group.params))
        group.params = params
    return changed


def load_into_shards(model: nn.Module, folder: str) -> bool:
    """
    Load a checkpoint's `model.safetensors` (whole tensors, as `save_model` writes them) into a model FSDP2 sharded
    before the Trainer (loaded with transformers' `DistributedConfig`, or [`~grpo_hf.replica_groups.shard_replica_groups`]):
    each rank keeps its shards (torch's `set_model_state_dict` with `full_state_dict=True`). The Trainer's own resume
    copies whole tensors into `DTensor` parameters, which fails. Returns `False` (nothing loaded) for a model without
    FSDP2 units or a checkpoint without that file (the Trainer's resume then runs as usual).
    """
    path = os.path.join(folder, "model.safetensors")
    if not has_fsdp2_units(model) or not os.path.isfile(path):
        return False
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, load_file(path), options=StateDictOptions(full_state_dict=True, strict=False))
    return True


from .optim.moments import local_tensor  # noqa: E402  (this rank's part of a DTensor; defined where moments are read)


def shard_groups(param: torch.Tensor) -> tuple:
    """
    The process groups over which `param` is sharded (one per `Shard` dimension of its mesh; `()` for a plain or a
    replicated tensor): summing a local partial sum over them gives the sum over the whole tensor.
    """
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    groups = []
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            groups.append(param.device_mesh.get_group(dim))
        elif placement.is_partial():
            raise ValueError("a Partial DTensor parameter: GRPO expects FSDP2's Shard / Replicate placements.")
    return tuple(groups)


def sum_over_shards(partials: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """
    Add up local partial sums (float64) keyed by the communicators over the [`shard_groups`] of the parameters they come
    from: each is summed over its communicators (added in rank order,
    [`~grpo_hf.compression.communicator.Communicator.ordered_sum`]), then the keys are added in their insertion order.
    Every rank must pass the same keys in the same order (build them from the parameters, not from which gradients
    exist).
    """
    total = None
    for communicators, value in partials.items():
        for communicator in communicators:
            value = communicator.ordered_sum(value)
        total = value if total is None else total + value
    return total


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed
# ----------------------------------------------------------------------------------------------------------------


class OptimizerStepProbe:
    r"""
    Step hooks on the optimizer DeepSpeed ZeRO steps (the one GRPO built; ZeRO calls its `step` once per param group or
    sub-group, with that group's flat fp32 partition and its gradient, already averaged, unscaled and clipped).

    Before each such `step`: adds each group's local sums (squared gradient; with `coherence`, gradient . `exp_avg` and
    squared `exp_avg`) and multiplies each group's learning rate by `factors[group name]`; after it, puts the learning
    rates back (the scheduler's values: the factors never compound). [`OptimizerStepProbe.pop`] gathers the sums of
    the steps since the last call over the ranks.

    Args:
        optimizer (`torch.optim.Optimizer`): the optimizer whose param groups carry `grpo_group`.
        names (`list[str]`): the GRPO group names, in the order of the importance state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: list[str]):
        self.index = {name: i for i, name in enumerate(names)}
        self.factors: dict[str, float] = {}
        self.coherence = False
        self._sums = torch.zeros(len(names), 4, dtype=torch.float64)  # |g|^2, g . m, |m|^2, groups with a moment
        self._steps = 0
        self._saved: list[tuple[dict, float]] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        for group in optimizer.param_groups:
            name = group.get("grpo_group")
            if name not in self.index or not group["params"]:
                continue
            row = self._sums[self.index[name]]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.detach().float()
                row[0] += float(torch.linalg.vector_norm(grad)) ** 2
                moment = first_moment(optimizer, param) if self.coherence else None
                if moment is not None:
                    row[1] += float((grad * moment.float()).sum())
                    row[2] += float(torch.linalg.vector_norm(moment.float())) ** 2
                    row[3] += 1
            factor = self.factors.get(name, 1.0)
            if factor != 1.0:
                self._saved.append((group, group["lr"]))
                group["lr"] = group["lr"] * factor

    def _post(self, optimizer, args, kwargs) -> None:
        for group, lr in self._saved:
            group["lr"] = lr
        self._saved.clear()

    def pop(self, communicator) -> torch.Tensor | None:
        """
        The sums of the optimizer steps since the last call, added over the ranks of `communicator` (a
        [`~grpo_hf.compression.communicator.Communicator`]) in rank order (`[G, 4]` float64, the same on every rank),
        or `None` when no rank stepped (e.g. an fp16 overflow step DeepSpeed skipped). A collective: every rank calls
        it once per optimizer step.
        """
        local = torch.cat([self._sums.reshape(-1), torch.tensor([float(self._steps)], dtype=torch.float64)])
        self._sums.zero_()
        self._steps = 0
        total = communicator.ordered_sum(local)
        if total[-1] == 0:
            return None
        return total[:-1].reshape(-1, 4)


__all__ = [
    "OptimizerStepProbe",
    "canonical_name",
    "deepspeed_zero_stage",
    "detect_engine",
    "follow_parameters",
    "has_fsdp2_units",
    "load_into_shards",
    "local_tensor",
    "shard_groups",
    "sum_over_shards",
]
