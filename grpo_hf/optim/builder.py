"""The optimizer `GRPOTrainer` builds: one param group per GRPO group and weight-decay flag, from the optimizer the
arguments choose, or [`~grpo_hf.optim.GroupedAdamW`] with the layouts of `grpo_optimizer_state`."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .grouped_adamw import GroupedAdamW
from .layout import resolve_layouts


# The Trainer's `optim` values whose state `grpo_optimizer_state` replaces (AdamW, torch's, with the Trainer's betas,
# epsilon and weight decay).
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def check_optimizer_state_settings(args) -> None:
    """
    Refuse a `grpo_optimizer_state` other than `"full"` with what it cannot replace, before any work.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: another `optim` than AdamW, or DeepSpeed.
    """
    state = args.grpo_optimizer_state
    if state == "full":
        return
    optim = getattr(args, "optim", "adamw_torch")  # an `OptimizerNames` member in `TrainingArguments`
    optim = str(getattr(optim, "value", optim))
    if optim not in ADAMW_OPTIMS:
        raise ConfigError(
            f"grpo_optimizer_state={state!r} replaces AdamW's state, and optim={optim!r} is another optimizer. Use "
            f"optim='adamw_torch' (the default) with it, or grpo_optimizer_state='full' to keep {optim!r} as it is."
        )
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            f"grpo_optimizer_state={state!r} under DeepSpeed: ZeRO flattens the parameters of each param group into "
            "partitions, so a state per head or row cannot follow them. Use grpo_optimizer_state='full' with DeepSpeed "
            "(ZeRO already partitions the optimizer state), or train with DDP or FSDP2."
        )


def grpo_param_groups(groups, decay_names, weight_decay: float, layouts: dict | None = None) -> list[dict]:
    """
    One param group per GRPO group and weight-decay flag (keys `grpo_group` and `param_names`), with each parameter's
    state layout (`state_layouts`) when `layouts` are given.
    """
    decay_names = set(decay_names)
    param_groups = []
    for group in groups:
        for decayed in (True, False):
            pairs = [(n, p) for n, p in zip(group.param_names, group.params) if (n in decay_names) == decayed]
            if not pairs:
                continue
            param_group = {
                "params": [p for _, p in pairs],
                "param_names": [n for n, _ in pairs],
                "weight_decay": weight_decay if decayed else 0.0,
                "grpo_group": group.name,
            }
            if layouts is not None:
                param_group["state_layouts"] = [str(layouts[n]) for n, _ in pairs]
            param_groups.append(param_group)
    return param_groups


def grouped_adamw(args, model: nn.Module, groups, decay_names) -> GroupedAdamW:
    """[`GroupedAdamW`] with the Trainer's AdamW settings and the layouts `args.grpo_optimizer_state` chooses."""
    layouts = resolve_layouts(model, groups, args.grpo_optimizer_state, args.grpo_min_state_numel)
    param_groups = grpo_param_groups(groups, decay_names, args.weight_decay, layouts)
    return GroupedAdamW(
        param_groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )


def keep_embeddings_in_32_bits(optimizer_cls, optimizer_kwargs: dict, model: nn.Module) -> None:
    """
    The Trainer's rule for bitsandbytes' 8-bit optimizers (`Trainer.create_optimizer`): every `nn.Embedding` keeps a
    32-bit state. Applied to the optimizer GRPO builds, so that GRPOTrainer trains as the Trainer does.
    """
    if "bitsandbytes" not in str(optimizer_cls) or optimizer_kwargs.get("optim_bits", None) != 8:
        return
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def state_nbytes(optimizer) -> dict[str, int]:
    """
    Bytes of the optimizer's state per GRPO group (`grpo_group` of its param groups; `"all"` for untagged ones):
    `Σ entries × element size` over every tensor the state holds (a quantized tensor subclass counted by its inner
    tensors; a tensor shared by several parameters, such as a quantization map, counted once).
    """
    from .moments import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    seen: set[int] = set()
    totals: dict[str, int] = {}
    for group in inner.param_groups:
        name = group.get("grpo_group", "all")
        totals.setdefault(name, 0)
        for param in group["params"]:
            for value in inner.state.get(param, {}).values():
                totals[name] += _tensor_nbytes(value, seen)
    return totals


def memory_metrics(optimizer, per_group: bool = True) -> dict[str, float]:
    """
    The optimizer's state bytes as logged metrics: `grpo/memory/optimizer_state_bytes` in all and, with `per_group`,
    `grpo/memory/optimizer_state_bytes/<group>` per GRPO group ([`state_nbytes`]). Counted, not measured: a resumed
    run logs the same.
    """
    by_group = state_nbytes(optimizer)
    logs = {"grpo/memory/optimizer_state_bytes": float(sum(by_group.values()))}
    if per_group:
        logs.update({f"grpo/memory/optimizer_state_bytes/{name}": float(n) for name, n in by_group.items()})
    return logs


def _tensor_nbytes(value, seen: set[int]) -> int:
    if not torch.is_tensor(value):
        return 0
    if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
        if hasattr(value, "to_local"):  # a DTensor: this rank's shard
            return _tensor_nbytes(value.to_local(), seen)
        names, _ = value.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(value, name), seen) for name in names)
    key = value.untyped_storage().data_ptr() if value.numel() else id(value)
    if key in seen and value.numel():
        return 0
    seen.add(key)
    return value.numel() * value.element_size()


__all__ = [
    "ADAMW_OPTIMS",
    "check_optimizer_state_settings",
    "grouped_adamw",
    "grpo_param_groups",
    "keep_embeddings_in_32_bits",
    "memory_metrics",
    "state_nbytes",
]
