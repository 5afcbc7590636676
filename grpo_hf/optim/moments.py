"""The one reader of an optimizer's moments: what `m` and `v` of a parameter are, whatever the optimizer keeps.

Adam's state keys (`exp_avg`, `exp_avg_sq`), Adafactor's (`exp_avg_sq_row`, `exp_avg_sq_col`) and
[`~grpo_hf.optim.GroupedAdamW`]'s layouts are read here and nowhere else. Its users: the sync's moment averaging
(`grpo_sync_moments`: the stored tensors, averaged in place), the coherence importance score and the DeepSpeed step
probe (the first moment).

| optimizer | first moment | second moment | stored, averageable in place |
|---|---|---|---|
| torch's Adam, AdamW, NAdam, RAdam | `exp_avg` | `exp_avg_sq` | both |
| transformers' `Adafactor` | `exp_avg` (with `beta1`) | `exp_avg_sq`, or `exp_avg_sq_row` / `_col` | both |
| [`~grpo_hf.optim.GroupedAdamW`] | fp32 (a copy from 8 or 16 bits) | per its layout (per entry, block, or row and column) | fp32 ones |
| bitsandbytes' and torchao's 8-bit / 4-bit optimizers | – | – | – (codes) |
"""

from __future__ import annotations

import torch


ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)
FIRST, SECOND = "first", "second"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a `DTensor` (its FSDP2 shard), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def unwrap_optimizer(optimizer):
    """The torch optimizer under Accelerate's `AcceleratedOptimizer` (itself an `Optimizer`); `None` stays `None`."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _quantized(tensor) -> bool:
    """A tensor subclass holding codes (torchao's 8- and 4-bit optimizer states), not a plain tensor or a `DTensor`."""
    return torch.is_tensor(tensor) and type(tensor) is not torch.Tensor and not hasattr(tensor, "to_local")


def _grouped(optimizer) -> bool:
    """[`~grpo_hf.optim.GroupedAdamW`] (by its layouts: it reads its own moments)."""
    return callable(getattr(optimizer, "layout_of", None))


def first_moment(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s first moment in fp32 (its local shape), or `None` (no state yet, or the optimizer keeps none)."""
    optimizer = unwrap_optimizer(optimizer)
    if _grouped(optimizer):
        return optimizer.first_moment(param)
    moment = optimizer.state.get(param, {}).get("exp_avg")
    if moment is None:
        return None
    if _quantized(moment):  # torchao's codes
        return moment.dequantize().float()
    return local_tensor(moment).float()


def moment_tensors(optimizer, param: torch.Tensor, which: str) -> list[torch.Tensor]:
    """
    The fp32 tensors that hold `param`'s `which` (`"first"` or `"second"`) moment, to be averaged over ranks in place
    (`[]` when the parameter has no state yet).

    Raises:
        `ValueError`: the optimizer keeps that moment in codes, or not at all; the message says which.
    """
    inner = unwrap_optimizer(optimizer)
    state = inner.state.get(param)
    if not state:
        return []
    if which == FIRST:
        keys = ["exp_avg"]
    elif "exp_avg_sq_row" in state:
        keys = ["exp_avg_sq_row", "exp_avg_sq_col"]
    else:
        keys = ["exp_avg_sq"]
    tensors = [state.get(key) for key in keys]
    if any(not torch.is_tensor(t) or t.dtype != torch.float32 or _quantized(t) for t in tensors):
        raise ValueError(
            f"{type(inner).__name__} keeps no fp32 {which} moment of this parameter (none, or 8/16-bit codes)."
        )
    return [local_tensor(t) for t in tensors]


def averaging_refusal(optimizer, which: str) -> str | None:
    """
    Why the `which` moment (`"first"` or `"second"`) of `optimizer` cannot be averaged in place over ranks, or `None`
    when it can (for every parameter, before any state exists): torch's Adam family, transformers' `Adafactor` (its
    first moment only with `beta1`), and [`~grpo_hf.optim.GroupedAdamW`] (its first moment only at 32 bits).
    """
    from transformers.optimization import Adafactor

    inner = unwrap_optimizer(optimizer)
    name = f"{type(inner).__module__.split('.')[0]}.{type(inner).__name__}"  # bitsandbytes' AdamW is an "AdamW" too
    if isinstance(inner, ADAM_FAMILY):
        return None
    if isinstance(inner, Adafactor):
        if which == FIRST and any(group.get("beta1") is None for group in inner.param_groups):
            return f"{name} keeps none (beta1=None)"
        return None
    if _grouped(inner):
        if which == FIRST:
            short = [
                layout
                for group in inner.param_groups
                for layout in group["state_layouts"]
                if not layout.endswith("/32")
            ]
            if short:
                return f"{name} keeps it in 8 or 16 bits, or not at all, for {len(short)} tensors (e.g. {short[0]})"
        return None
    return f"{name} does not keep it as fp32 tensors that can be averaged in place"


def moment_numel(optimizer, param: torch.Tensor, which: str) -> int:
    """
    The entries the tensors of `param`'s `which` moment hold, or will hold once it has state (so that every rank
    lays out the same row whether or not its parameter has been stepped yet).
    """
    held = moment_tensors(optimizer, param, which)
    if held:
        return sum(t.numel() for t in held)
    inner = unwrap_optimizer(optimizer)
    shape = local_tensor(param).shape
    if _grouped(inner) and which == SECOND:
        return sum(torch.Size(s).numel() for s in inner.layout_of(param).second_shape(shape))
    if which == SECOND and len(shape) >= 2 and type(inner).__name__ == "Adafactor":
        return shape[-1] + shape.numel() // shape[-1]
    return shape.numel()


__all__ = [
    "ADAM_FAMILY",
    "averaging_refusal",
    "moment_numel",
    "moment_tensors",
    "first_moment",
    "unwrap_optimizer",
]
