"""[`GroupedAdamW`]: AdamW whose state each parameter keeps as its [`~grpo_hf.optim.StateLayout`] says.

Per parameter `p` with gradient `g` at step `t` (learning rate `lr`, weight decay `λ`, `β1`, `β2`, `ε` of its param
group), where `reduce` averages over the layout's blocks (nothing for `full`; the head, the row, the tensor; the row and
the column for `factored`, whose estimate is `v̂ = r cᵀ / mean(r)`):

1. `p ← p (1 − lr λ)` (decoupled weight decay, as AdamW).
2. `v ← β2 v + (1 − β2) reduce(g²)`, with Adam's bias correction `1 − β2^t`.
3. `m ← β1 m + (1 − β1) g`, `p ← p − lr (m / (1 − β1^t)) / (sqrt(v̂) + ε)` (without a first moment, `g` in place of
   the corrected `m`).

With every layout `full/32` it is torch's AdamW (the tests compare them). (Adafactor's own update, its β2 schedule and
RMS clip, was measured with these layouts and set aside: it fell apart at the higher learning rates, benchmarks/LOG.md
2026-12-05; the Trainer's `optim="adafactor"` runs it.)

An 8-bit first moment is held as int8 codes in blocks of 128 entries with one fp32 scale (the block's largest
magnitude) each; a code `c` stands for `sign(c) (c / 127)² scale`, so that small entries of a block keep a resolution of
`scale / 127²` rather than `scale / 127`.

Every rank computes the same update from the same gradients (no collective, no randomness), so DDP replicas never
drift. Under FSDP2 each rank updates its local shards: `row` and `head` state is local to the rows a rank holds;
`factored` keeps the row and column means of the local shard.
"""

from __future__ import annotations

import logging
import math

import torch

from .kernels import FIRST_MOMENT_BLOCK, decode, moment_kernel, padded_numel
from .layout import FIRST_MOMENT_BITS, SECOND_MOMENT_KINDS, StateLayout, whole_heads_per_shard
from .moments import local_tensor
from .resume import check_layouts


logger = logging.getLogger(__name__)

ADAFACTOR_EPS = 1e-30  # the floor of a factored estimate's mean row (Adafactor's ε₁)


def dequantize_moment(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values (flat, `numel` entries) of 8-bit codes and their block scales."""
    return decode(codes.view(-1, FIRST_MOMENT_BLOCK), scales.view(-1, 1)).view(-1)[:numel]


class GroupedAdamW(torch.optim.Optimizer):
    r"""
    AdamW with a state layout per parameter ([`~grpo_hf.optim.StateLayout`]): one second moment per head, row,
    tensor, or factored into rows and columns; the first moment in 32, 16 or 8 bits, or none.

    Example:

    ```python
    >>> from grpo_hf.optim import GroupedAdamW

    >>> layouts = ["row/32" if p.dim() == 2 and p.numel() >= 4096 else "full/32" for p in model.parameters()]
    >>> optimizer = GroupedAdamW([{"params": list(model.parameters()), "state_layouts": layouts}], lr=1e-3)
    ```

    `GRPOTrainer` builds it from `grpo_optimizer_state` with one param group per GRPO group, and the layouts the group
    and the preset choose ([`~grpo_hf.optim.resolve_layouts`]).

    Args:
        params (iterable): parameters, or param groups (dicts); each group may hold `state_layouts`, one layout (a
            [`StateLayout`] or its string form, e.g. `"head:64/8"`) per parameter. Without it: `full/32`.
        lr (`float`, *optional*, defaults to `1e-3`): learning rate.
        betas (`tuple[float, float]`, *optional*, defaults to `(0.9, 0.999)`): `β1` (of the first moment) and `β2`.
        eps (`float`, *optional*, defaults to `1e-8`): added to `sqrt(v̂)` in Adam's form.
        weight_decay (`float`, *optional*, defaults to `0.0`): decoupled weight decay.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr}: use a learning rate of 0 or more.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas}: use values in [0, 1).")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        layouts = param_group.get("state_layouts")
        if layouts is None:
            layouts = ["full/32"] * len(params)
        layouts = [str(layout) for layout in layouts]
        if len(layouts) != len(params):
            raise ValueError(f"a param group has {len(params)} parameters and {len(layouts)} state_layouts.")
        for layout in layouts:
            parsed = StateLayout.parse(layout)
            if parsed.second not in SECOND_MOMENT_KINDS or parsed.first_bits not in FIRST_MOMENT_BITS:
                raise ValueError(f"state layout {layout!r}: unknown second-moment kind or first-moment bits.")
        param_group["state_layouts"] = layouts
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """
        [`torch.optim.Optimizer.load_state_dict`], after checking that the saved state keeps every parameter as this
        optimizer does ([`~grpo_hf.optim.resume.check_layouts`]): another optimizer's state, or other layouts, are
        refused with a [`~grpo_hf.errors.CheckpointError`] before anything is copied.
        """
        check_layouts(state_dict["param_groups"], self.param_groups)
        super().load_state_dict(state_dict)
        # torch casts every loaded state tensor to its parameter's dtype: the codes go back to int8, a 16-bit first
        # moment back to bf16 (exactly: the values are those of the saved dtype).
        for group in self.param_groups:
            for param, layout in zip(group["params"], group["state_layouts"]):
                state = self.state.get(param, {})
                if "exp_avg_codes" in state:
                    state["exp_avg_codes"] = state["exp_avg_codes"].to(torch.int8)
                if StateLayout.parse(layout).first_bits == 16 and "exp_avg" in state:
                    state["exp_avg"] = state["exp_avg"].to(torch.bfloat16)

    def layout_of(self, param: torch.Tensor) -> StateLayout:
        """The [`StateLayout`] `param` is kept with."""
        for group in self.param_groups:
            for p, layout in zip(group["params"], group["state_layouts"]):
                if p is param:
                    return StateLayout.parse(layout)
        raise KeyError("the parameter is not optimized by this optimizer.")

    # --- state ---
    @staticmethod
    def _fit_to_shard(group: dict, index: int, param: torch.Tensor, layout: StateLayout) -> StateLayout:
        """
        A `head` layout chosen on the whole parameter, for the shard this rank holds (FSDP2 swaps the parameters after
        the optimizer is built): one second moment per row where the shards do not start on head boundaries (the same
        choice on every rank), written back into the param group, which its state dict carries.
        """
        if layout.second != "head" or not hasattr(param, "to_local"):
            return layout
        if whole_heads_per_shard(param, layout.block):
            return layout
        fitted = StateLayout("row", layout.first_bits, 0, layout.axis)
        group["state_layouts"][index] = str(fitted)
        names = group.get("param_names")
        logger.info(
            "GroupedAdamW: %s is sharded across heads of %d rows (FSDP2); one second moment per row instead.",
            names[index] if names else f"a parameter of {group.get('grpo_group', 'a param group')}",
            layout.block,
        )
        return fitted

    def _init_state(self, state: dict, param: torch.Tensor, layout: StateLayout) -> None:
        local = local_tensor(param)
        state["step"] = torch.tensor(0.0)
        if layout.first_bits == 32:
            state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        elif layout.first_bits == 16:
            state["exp_avg"] = torch.zeros_like(local, dtype=torch.bfloat16)
        elif layout.first_bits == 8:
            padded = padded_numel(local.numel())
            state["exp_avg_codes"] = torch.zeros(padded, dtype=torch.int8, device=local.device)
            state["exp_avg_scales"] = torch.zeros(padded // FIRST_MOMENT_BLOCK, device=local.device)
        shapes = layout.second_shape(local.shape)
        if layout.second == "factored":
            state["exp_avg_sq_row"] = torch.zeros(shapes[0], device=local.device)
            state["exp_avg_sq_col"] = torch.zeros(shapes[1], device=local.device)
        elif layout.second == "full":
            state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        else:
            state["exp_avg_sq"] = torch.zeros(shapes[0], device=local.device)

    def first_moment(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s first moment as an fp32 tensor of its (local) shape (a copy when stored in 8 or 16 bits)."""
        state = self.state.get(param)
        if not state:
            return None
        local = local_tensor(param)
        if "exp_avg" in state:
            return state["exp_avg"].float() if state["exp_avg"].dtype != torch.float32 else state["exp_avg"]
        if "exp_avg_codes" in state:
            return dequantize_moment(state["exp_avg_codes"], state["exp_avg_scales"], local.numel()).view_as(local)
        return None

    # --- the step ---
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._make_kernel()
        for group in self.param_groups:
            for index, (param, layout) in enumerate(zip(group["params"], group["state_layouts"])):
                if param.grad is None:
                    continue
                state = self.state[param]
                parsed = StateLayout.parse(layout)
                if not state:
                    parsed = self._fit_to_shard(group, index, param, parsed)
                    self._init_state(state, param, parsed)
                self._update(param, state, parsed, group)
        return loss

    def _make_kernel(self) -> None:
        """
        At the first step, on every rank whatever its gradients: the 8-bit moments' kernel (its choice is agreed over
        `torch.distributed`'s ranks, a collective that every rank must reach).
        """
        if getattr(self, "_kernel", None) is not None:
            return
        eight = [
            p for g in self.param_groups for p, kept in zip(g["params"], g["state_layouts"]) if kept.endswith("/8")
        ]
        self._kernel = moment_kernel(eight[0].device) if eight else False

    def _update(self, param: torch.Tensor, state: dict, layout: StateLayout, group: dict) -> None:
        p, grad = local_tensor(param), local_tensor(param.grad)
        if grad.is_sparse:
            raise RuntimeError("GroupedAdamW does not support sparse gradients.")
        beta1, beta2_t = group["betas"]
        lr = group["lr"]
        state["step"] += 1
        step = float(state["step"])
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        correction2 = 1 - beta2_t**step
        if grad.dtype != p.dtype:
            grad = grad.to(p.dtype)
        # the first moment averages gradients; the step divides it by sqrt(v̂) + ε
        step_size = lr / (1 - beta1**step) if layout.first_bits else lr
        if layout.second == "full":  # torch's AdamW, operation for operation
            numerator = self._average(state, grad, beta1) if layout.first_bits else grad
            v = state["exp_avg_sq"]
            v.mul_(beta2_t).addcmul_(grad, grad, value=1 - beta2_t)
            denominator = (v.sqrt() / math.sqrt(correction2)).add_(group["eps"])
            p.addcdiv_(numerator, denominator, value=-step_size)
            return
        if not p.is_contiguous():  # (a parameter is contiguous but for exotic storage: update a contiguous copy)
            contiguous = p.contiguous()
            self._blocked_update(contiguous, grad.contiguous(), state, layout, group, beta2_t, correction2, step_size)
            p.copy_(contiguous)
            return
        self._blocked_update(p, grad.contiguous(), state, layout, group, beta2_t, correction2, step_size)

    def _blocked_update(self, p, grad, state: dict, layout: StateLayout, group: dict, beta2_t, correction2, step_size):
        """
        The update with a `head` / `row` / `tensor` / `factored` second moment, in chunks of whole stored rows: two
        passes over the gradient (its squares' means, then the update), whose temporaries are one chunk each, so that
        a large matrix (an embedding) allocates no tensor of its size at every step.
        """
        if not p.numel():  # an FSDP2 shard that holds no rows of this parameter
            return
        stored = p.view(p.shape[0], -1) if p.dim() else p.view(1, 1)  # [stored rows, entries per stored row]
        gradient = grad.view(stored.shape)
        rows, cols = stored.shape
        units, per_unit = (rows, cols) if layout.axis == 0 else (cols, rows)  # output units, entries per unit
        factored = layout.second == "factored"
        chunks = _row_chunks(rows, cols)
        # 1. The means of the squared gradient per output unit (and per input unit when factored).
        unit_sums = torch.zeros(units, device=p.device)
        other_sums = torch.zeros(per_unit, device=p.device) if factored else None
        for start, stop in chunks:
            squares = torch.mul(gradient[start:stop], gradient[start:stop])
            if layout.axis == 0:
                unit_sums[start:stop] = squares.sum(dim=1)
                if factored:
                    other_sums.add_(squares.sum(dim=0))
            else:
                unit_sums.add_(squares.sum(dim=0))
                if factored:
                    other_sums[start:stop] = squares.sum(dim=1)
            del squares
        beta2 = 1.0 - beta2_t
        scale = 1.0 / math.sqrt(correction2)
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2_t).add_(unit_sums.div_(per_unit), alpha=beta2)
            col.mul_(beta2_t).add_(other_sums.div_(units), alpha=beta2)
            unit_factor = (row / row.mean().clamp(min=ADAFACTOR_EPS)).sqrt_().mul_(scale)
            other_factor = col.sqrt()
        else:
            v = state["exp_avg_sq"]
            unit_means = unit_sums.div_(per_unit)
            if layout.second == "head":
                block_means = unit_means.view(-1, layout.block).mean(dim=1)
            elif layout.second == "tensor":
                block_means = unit_means.mean().view(1)
            else:
                block_means = unit_means
            v.mul_(beta2_t).add_(block_means.view_as(v), alpha=beta2)
            unit_denominator = v.view(-1).sqrt().mul_(scale).add_(group["eps"])
            if layout.second == "head":
                unit_denominator = unit_denominator.repeat_interleave(layout.block)
            elif layout.second == "tensor":
                unit_denominator = unit_denominator.expand(units)
        # 2. The update, chunk by chunk: the first moment's, the denominator's and the parameter's.
        beta1 = group["betas"][0]
        for start, stop in chunks:
            chunk_grad = gradient[start:stop]
            if layout.first_bits:
                numerator = self._average(state, chunk_grad, beta1, start=start * cols)
            else:
                numerator = chunk_grad
            if factored:
                if layout.axis == 0:
                    denominator = torch.outer(unit_factor[start:stop], other_factor)
                else:
                    denominator = torch.outer(other_factor[start:stop], unit_factor)
                denominator.add_(group["eps"])
            elif layout.axis == 0:
                denominator = unit_denominator[start:stop].view(-1, 1)
            else:
                denominator = unit_denominator.view(1, -1)
            stored[start:stop].addcdiv_(numerator, denominator, value=-step_size)

    def _average(self, state: dict, target: torch.Tensor, beta1: float, start: int = 0) -> torch.Tensor:
        """
        The first moment `m ← β1 m + (1 − β1) target` in its storage (a `lerp`, as torch's AdamW computes it), on the
        entries `start : start + target.numel()` of the flattened moment (`start` on an 8-bit block's boundary; all of
        it by default); returns them shaped as `target`, in its dtype.
        """
        flat = target.reshape(-1)
        stop = start + flat.numel()
        if "exp_avg_codes" in state:  # 8 bits: one kernel decodes, averages and encodes again
            codes, scales = state["exp_avg_codes"], state["exp_avg_scales"]
            end = min(padded_numel(stop), codes.numel())
            values = flat.float()
            if end != stop:  # the tensor's last block, padded
                values = torch.nn.functional.pad(values, (0, end - stop))
            first, last = start // FIRST_MOMENT_BLOCK, end // FIRST_MOMENT_BLOCK
            moment, new_codes, new_scales = self._kernel(
                codes[start:end].view(-1, FIRST_MOMENT_BLOCK), scales[first:last].view(-1, 1),
                values.view(-1, FIRST_MOMENT_BLOCK), beta1,
            )  # fmt: skip
            codes[start:end].copy_(new_codes.view(-1))
            scales[first:last].copy_(new_scales.view(-1))
            return moment.view(-1)[: stop - start].view_as(target).to(target.dtype)
        moment = state["exp_avg"]
        if moment.numel() != flat.numel():  # a chunk of rows (the moment is contiguous, as its parameter)
            moment = moment.view(-1)[start:stop].view_as(target)
        if moment.dtype == target.dtype:
            return moment.lerp_(target, 1 - beta1)
        values = moment.to(target.dtype).lerp_(target, 1 - beta1)  # 16 bits
        moment.copy_(values)
        return values


CHUNK_ENTRIES = 1 << 20  # entries per chunk of a blocked update: its temporaries are 4 MB, reused from the heap


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    """Whole stored rows in chunks of about `CHUNK_ENTRIES` entries, each starting on an 8-bit block's boundary."""
    align = FIRST_MOMENT_BLOCK // math.gcd(cols, FIRST_MOMENT_BLOCK)
    per_chunk = max(align, CHUNK_ENTRIES // max(cols, 1) // align * align)
    return [(start, min(start + per_chunk, rows)) for start in range(0, rows, per_chunk)]


__all__ = ["GroupedAdamW", "dequantize_moment"]
