"""Trainer callbacks of grpo_hf: importance-scaled learning rates, health monitoring and GRPO checkpoint state."""

import logging
import os
import pickle
import time
from collections import defaultdict, deque

import torch
from transformers import TrainerCallback

from .grouping import ParameterGroup
from .importance import ImportanceState


logger = logging.getLogger(__name__)

STATE_FILE = "grpo_state_rank{rank}.pt"
STATE_VERSION = 1
# The article's health targets (DESIGN.md §1, #9).
LOAD_BALANCE_STD_TARGET = 0.15
UPDATE_LATENCY_P99_MS_TARGET = 50.0


class GRPOCallback(TrainerCallback):
    r"""
    Applies importance-based learning-rate multipliers, measures the article's health metrics, and saves/restores all
    GRPO state with every checkpoint.

    Each optimizer step (after communication and clipping, so every rank sees the same gradients):

    1. `on_pre_optimizer_step`: per-group gradient norms -> [`~grpo_hf.importance.ImportanceState.update`] ->
       multipliers; each optimizer param group tagged `grpo_group` gets `lr = scheduler_lr * m_g`.
    2. `on_optimizer_step`: the scheduler's learning rates are put back, so multipliers never compound, whatever the
       scheduler (including `ReduceLROnPlateau`, which reads the current LR).

    The metrics land in `metrics` (lists per key); [`GRPOMixin.log`] averages them into the Trainer's logs.

    Args:
        groups (`list[ParameterGroup]`): the semantic groups, in the order of `importance.names`.
        importance (`ImportanceState`): per-group scores and multipliers.
        apply_multipliers (`bool`, *optional*, defaults to `True`): `False` tracks scores without scaling the LR.
    """

    def __init__(self, groups: list[ParameterGroup], importance: ImportanceState, apply_multipliers: bool = True):
        self.groups = groups
        self.importance = importance
        self.apply_multipliers = apply_multipliers
        self.comm_state = None  # set by GRPOMixin once the compression state exists
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self._scheduler_lrs: list[float] | None = None
        self._backward_end: float | None = None
        self._latencies_ms: deque[float] = deque(maxlen=100)
        self._warned: set[str] = set()

    # --- per step ---
    def mark_backward_end(self) -> None:
        """Called by the trainer after the backward of the last micro-batch (communication included)."""
        self._backward_end = time.perf_counter()

    def group_grad_norms(self) -> torch.Tensor:
        """L2 norm of each group's gradient (float64; 0 for a group without gradients this step)."""
        norms = []
        for group in self.groups:
            grads = [p.grad.detach() for p in group.params if p.grad is not None]
            if not grads:
                norms.append(0.0)
                continue
            per_tensor = torch.stack(torch._foreach_norm(grads)).double()  # one fused kernel per group
            norms.append(float(torch.linalg.vector_norm(per_tensor)))
        return torch.tensor(norms, dtype=torch.float64)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        multipliers = self.importance.update(self.group_grad_norms())
        if optimizer is None:
            return
        index = {name: i for i, name in enumerate(self.importance.names)}
        self._scheduler_lrs = [group["lr"] for group in optimizer.param_groups]
        if self.apply_multipliers:
            for group in optimizer.param_groups:
                if "grpo_group" in group:
                    group["lr"] = group["lr"] * float(multipliers[index[group["grpo_group"]]])
        self._record(optimizer, multipliers, index)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self._scheduler_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._scheduler_lrs):
                group["lr"] = lr
            self._scheduler_lrs = None
        if self._backward_end is not None:
            self._latencies_ms.append((time.perf_counter() - self._backward_end) * 1000)
            self._backward_end = None

    def _record(self, optimizer, multipliers: torch.Tensor, index: dict[str, int]) -> None:
        imp = self.importance
        effective_lr = {g["grpo_group"]: g["lr"] for g in optimizer.param_groups if "grpo_group" in g}
        for name, i in index.items():
            self.metrics[f"grpo/lr_scale/{name}"].append(float(multipliers[i]))
            self.metrics[f"grpo/grad_norm/{name}"].append(float(imp.last_grad_norms[i]))
            self.metrics[f"grpo/importance/{name}"].append(float(imp.last_scores[i]))
            self.metrics[f"grpo/update_count/{name}"].append(float(imp.update_counts[i]))
            if name in effective_lr:
                self.metrics[f"grpo/lr/{name}"].append(effective_lr[name])
        balance = imp.load_balance_std()
        self.metrics["grpo/load_balance_std"].append(balance)
        if imp.steps > imp.warmup_steps and balance > LOAD_BALANCE_STD_TARGET:
            self._warn_once(
                "balance",
                f"GRPO load balance: the parameter-weighted std of the LR multipliers is {balance:.3f}, above the "
                f"article's target of {LOAD_BALANCE_STD_TARGET}. Some groups get far more learning rate than others; "
                "narrow grpo_lr_scale_min/max if that hurts quality.",
            )

    def pop_metrics(self) -> dict[str, float]:
        """Average of every metric since the last call, plus the update latency p99; clears the window."""
        logs = {key: sum(values) / len(values) for key, values in self.metrics.items() if values}
        self.metrics.clear()
        if self._latencies_ms:
            p99 = float(torch.quantile(torch.tensor(list(self._latencies_ms), dtype=torch.float64), 0.99))
            logs["grpo/update_latency_p99_ms"] = p99
            if p99 > UPDATE_LATENCY_P99_MS_TARGET:
                self._warn_once(
                    "latency",
                    f"GRPO update latency p99 is {p99:.1f} ms (end of backward to end of optimizer.step), above the "
                    f"article's target of {UPDATE_LATENCY_P99_MS_TARGET:.0f} ms.",
                )
        return logs

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # --- checkpoint state ---
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "importance": self.importance.state_dict(),
            "comm": self.comm_state.state_dict() if self.comm_state is not None else None,
        }

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
        tmp = path + ".tmp"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)  # never leave a half-written state file behind

    def load_checkpoint(self, folder: str, rank: int) -> bool:
        """
        Restore the GRPO state saved in `folder` for `rank`. Returns `False` (with a warning) when the checkpoint has
        no GRPO state (e.g. written by a plain `Trainer`); raises `ValueError` when it is unreadable or belongs to
        another configuration.
        """
        path = os.path.join(folder, STATE_FILE.format(rank=rank))
        if not os.path.isfile(path):
            logger.warning(f"{folder} holds no GRPO state ({os.path.basename(path)}); GRPO state starts fresh.")
            return False
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
            raise ValueError(
                f"cannot read the GRPO state {path} ({err}). The checkpoint is corrupt: resume from an earlier "
                "checkpoint, or delete the file to resume with fresh GRPO state."
            ) from None
        if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
            raise ValueError(
                f"{path} is not a GRPO state file of version {STATE_VERSION}; resume from another checkpoint."
            )
        self.importance.load_state_dict(saved["importance"])
        if saved["comm"] is not None:
            if self.comm_state is None:
                raise ValueError(
                    f"{path} holds compression residuals but this run has no gradient compression; resume with the "
                    "same grpo_compression setting as the run that wrote the checkpoint."
                )
            self.comm_state.load_state_dict(saved["comm"])
        return True
