"""[`GRPOCallback`]: GRPO's learning rates, health metrics and checkpoint state, applied at every optimizer step.

The callback wires the events of an optimizer step to its jobs, each a class of its own: [`LearningRates`] (each
group's ratio and importance multiplier on the scheduler's learning rate, for one step), [`NonfiniteSteps`] (a step
whose gradients hold NaN/Inf: skipped or taken, counted, reported), [`StepMetrics`] (the logged window, the measured
latency) and the checkpoint state; the group norms come from [`~grpo_hf.group_stats.GroupStatistics`], and the
transport (the compression state) from the protocol of [`~grpo_hf.compression.transport.CommState`].

[`CostCallback`], which measures what training costs, lives in `grpo_hf.cost.callback` and is re-exported here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque

import torch
from transformers import TrainerCallback

from .checkpoints import STATE_FILE, STATE_VERSION, restore_grpo_state, write_grpo_state
from .compression.communicator import ProcessGroupCommunicator, process_rank
from .compression.transport import CommState
from .cost.callback import CostCallback
from .engines import OptimizerStepProbe, local_tensor
from .errors import GRPOError, warn_once
from .group_stats import GroupStatistics
from .grouping import ParameterGroup
from .importance import ImportanceState


logger = logging.getLogger(__name__)

# The article's health targets: load balance between groups (std of the multipliers) and update latency p99.
LOAD_BALANCE_STD_TARGET = 0.15
UPDATE_LATENCY_P99_MS_TARGET = 50.0
# Timings of the compression state's per-window stats: measured, so reported at the end of training, not per step.
MEASURED_COMM_KEYS = ("grpo/comm/hook_ms",)


# ----------------------------------------------------------------------------------------------------------------
# The learning rates of one optimizer step
# ----------------------------------------------------------------------------------------------------------------


class LearningRates:
    """
    Each optimizer param group tagged `grpo_group` gets, for one step, its scheduled learning rate times its group's
    fixed ratio and (when applied) its importance multiplier; [`restore`] puts the scheduler's values back, so that
    nothing compounds. Under DeepSpeed the same factors go through a step probe ([`probe_factors`]).

    Args:
        names (`list[str]`): the groups' names, in the order of the importance state.
        apply_multipliers (`bool`): scale by the importance multipliers (else the ratios only).
        lr_ratios (`dict[str, float]`): each group's fixed ratio (1 when missing).
    """

    def __init__(self, names: list[str], apply_multipliers: bool, lr_ratios: dict[str, float]):
        self.index = {name: i for i, name in enumerate(names)}
        self.apply_multipliers, self.lr_ratios = apply_multipliers, dict(lr_ratios)
        self._scheduler_lrs: list[float] | None = None

    def apply(self, optimizer, multipliers: torch.Tensor) -> dict[str, int]:
        """
        Each param group tagged `grpo_group` gets its scheduled LR times its ratio and (when applied) its multiplier,
        for this step only ([`restore`] puts the scheduler's values back). Returns the group index by name.
        """
        self._scheduler_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            name = group.get("grpo_group")
            if name is None:
                continue
            factor = self.lr_ratios.get(name, 1.0)
            if self.apply_multipliers:
                factor *= float(multipliers[self.index[name]])
            if factor != 1.0:
                group["lr"] = group["lr"] * factor
        return dict(self.index)

    def restore(self, optimizer) -> None:
        """After the optimizer step: the scheduler's learning rates back."""
        if optimizer is not None and self._scheduler_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._scheduler_lrs):
                group["lr"] = lr
            self._scheduler_lrs = None

    def probe_factors(self, probe: OptimizerStepProbe, multipliers: torch.Tensor | None) -> None:
        """Each group's LR factor for the next step ZeRO takes: its ratio times its current multiplier."""
        factors = {}
        for name in probe.index:
            applied = self.apply_multipliers and name in self.index and multipliers is not None
            factors[name] = self.lr_ratios.get(name, 1.0) * (float(multipliers[self.index[name]]) if applied else 1.0)
        probe.factors = factors


# ----------------------------------------------------------------------------------------------------------------
# Steps whose gradients hold NaN/Inf
# ----------------------------------------------------------------------------------------------------------------


class NonfiniteSteps:
    """
    What an optimizer step whose gradients hold NaN/Inf does (see [`GRPOCallback`], step 1): skipped where GRPO's
    codec or sync is in the gradients' path (or an fp16 `GradScaler` skips it), else taken as the Trainer takes it;
    counted, warned about, and the run stopped when it cannot progress, naming the groups and parameters.

    Args:
        drop_nonfinite_gradients (`bool`): drop the gradients of a skipped step (so that the optimizer skips it).
        max_consecutive_skips (`int`): stop the run at this many skipped steps in a row (`0`: never).
    """

    def __init__(self, drop_nonfinite_gradients: bool = True, max_consecutive_skips: int = 8):
        self.drop_nonfinite_gradients = drop_nonfinite_gradients
        self.max_consecutive_skips = max_consecutive_skips
        self.clips = True  # the Trainer clips gradients (max_grad_norm > 0): set at on_train_begin
        self.reset([], [])

    def reset(self, groups: list[ParameterGroup], names: list[str]) -> None:
        """Follow `groups` (`names`: the importance state's order); the counts restart."""
        self.groups, self.names = groups, list(names)
        self.steps = 0  # non-finite steps of the run, skipped or taken
        self.consecutive_skips = 0
        self.streak = 0  # non-finite steps in a row taken as the Trainer takes them (see skips)
        self._streak_first_step = 0
        self.noted: list[tuple[str, str]] | None = None  # see note_backward_end

    def skips(self, comm_state: CommState | None) -> bool:
        """
        Whether a non-finite optimizer step is skipped (GRPO's codec or sync is in the gradients' path, or an fp16
        `GradScaler` skips it) rather than taken as the Trainer takes it (nothing of GRPO touched the gradients).
        """
        return comm_state is not None or not self.drop_nonfinite_gradients

    def note_backward_end(self, loss_finite: bool, comm_state: CommState | None) -> None:
        """
        After the backward of the last micro-batch, before clipping: when this step's gradients may hold NaN/Inf
        (`loss_finite=False` for a NaN/Inf training loss, the codec saw them, or the step before was non-finite),
        note which parameters hold them now: clipping by a NaN norm spreads it to every gradient, so a later report
        could not name them. One fused pass over the gradients, only then.
        """
        suspect = (
            not loss_finite
            or self.consecutive_skips > 0
            or self.streak > 0
            or (comm_state is not None and comm_state.last_step == "nonfinite")
        )
        self.noted = self._find() if suspect else None

    def _find(self) -> list[tuple[str, str]]:
        """
        `(group, parameter)` names of the gradients holding a NaN or an Inf (this rank's shards under FSDP2), from one
        fused max-abs pass (it overflows for no finite value, and NaN propagates through it).
        """
        entries = [
            (group.name, name, local_tensor(param.grad).detach())
            for group in self.groups
            for name, param in zip(group.param_names, group.params)
            if param.grad is not None
        ]
        entries = [entry for entry in entries if entry[2].numel()]
        if not entries:
            return []
        peaks = torch._foreach_norm([grad for _, _, grad in entries], math.inf)
        try:
            finite = torch.isfinite(torch.stack([peak.float() for peak in peaks])).tolist()
        except RuntimeError:  # gradients on several devices
            finite = [bool(torch.isfinite(peak)) for peak in peaks]
        return [(group, name) for (group, name, _), ok in zip(entries, finite) if not ok]

    def finite(self, state) -> None:
        """A finite step: the skips in a row restart; a streak of steps taken as the Trainer takes them ends."""
        self.consecutive_skips = 0
        streak, self.streak = self.streak, 0
        if streak > 1 and (state is None or state.is_world_process_zero):
            last = self._streak_first_step + streak - 1
            logger.warning(
                f"GRPO: {streak} optimizer steps in a row had NaN/Inf gradients (steps {self._streak_first_step} to "
                f"{last}) and were taken as the Trainer takes them; {self.steps} such step(s) in this run."
            )

    def skip(self, state, norms: torch.Tensor, comm_state: CommState | None) -> None:
        """
        Skip the step: its gradients dropped (so that `optimizer.step` changes nothing), a warning; the run stops with
        a [`~grpo_hf.errors.GRPOError`] at `max_consecutive_skips` in a row, or when the codec made NaN/Inf of finite
        gradients (a bug).
        """
        self.steps += 1
        self.consecutive_skips += 1
        bad = [name for name, norm in zip(self.names, norms.tolist()) if not math.isfinite(norm)]
        sent = comm_state.last_step if comm_state is not None else None  # where the transport knows
        codec_made_it = sent == "compressed"
        if codec_made_it or 0 < self.max_consecutive_skips <= self.consecutive_skips:
            raise GRPOError(self._report(state, bad, sent, comm_state))
        warn = state is None or state.is_world_process_zero
        where, spread = self._where(norms) if warn else ("", "")  # before the gradients are dropped
        if self.drop_nonfinite_gradients:
            for group in self.groups:
                for param in group.params:
                    param.grad = None
        if warn:
            logger.warning(
                f"GRPO: NaN/Inf gradients at optimizer step {state.global_step + 1 if state else '?'} ({where}){spread}: "
                "the step is skipped (no parameter, optimizer state, importance score or compression residual "
                f"changes); {self.steps} step(s) skipped so far."
            )

    def take(self, state, norms: torch.Tensor) -> None:
        """
        A non-finite step that nothing of GRPO touched: the Trainer's `optimizer.step` runs on the gradients as they
        are (with the learning rates of a finite step, which the callback applies); the importance state is not
        updated. Warned once per streak (see [`skips`]).
        """
        self.steps += 1
        self.streak += 1
        step = state.global_step + 1 if state else 0
        if self.streak == 1:
            self._streak_first_step = step
        if self.streak > 1 or not (state is None or state.is_world_process_zero):
            return
        where, spread = self._where(norms)
        logger.warning(
            f"GRPO: NaN/Inf gradients at optimizer step {step or '?'} ({where}){spread}. No GRPO codec or sync touches "
            "the gradients in this run, so the step is taken as the Trainer takes it: optimizer.step runs on them "
            "(the parameters it updates may hold NaN from now on); only GRPO's importance state is left as it was. "
            "Further steps of this streak are not warned about one by one: grpo/nonfinite_steps counts them (the "
            "Trainer's logging_nan_inf_filter hides NaN losses in the logs). Lower the learning rate, check the data "
            "and the loss, or use bf16 instead of fp16."
        )

    def train_end(self, state) -> None:
        """Training ended inside a streak of non-finite steps taken as the Trainer takes them: say so."""
        if self.streak > 1 and state.is_world_process_zero:
            logger.warning(
                f"GRPO: training ended inside a streak of {self.streak} optimizer steps with NaN/Inf "
                f"gradients (from step {self._streak_first_step} on), each taken as the Trainer takes it: the "
                "model's parameters may hold NaN or Inf. Check them before using the model."
            )

    def _where(self, norms: torch.Tensor) -> tuple[str, str]:
        """
        `("groups ...; parameters ...", note)` for the gradients holding NaN/Inf: those noted before clipping when
        they were (see [`note_backward_end`]), else those found now; when clipping has multiplied every gradient by a
        NaN norm, all groups and a note saying why no parameter can be named.
        """
        found = self.noted
        with_grad = sum(p.grad is not None for group in self.groups for p in group.params)
        if found is None:
            found = self._find()
            if self.clips and len(found) > 1 and len(found) == with_grad:
                return f"every gradient, all {len(self.groups)} groups", (
                    ": gradient clipping multiplied every gradient by the NaN norm, so the parameters where it began "
                    "cannot be told apart at this step (max_grad_norm=0 would leave them as they were)"
                )
        bad = [name for name, norm in zip(self.names, norms.tolist()) if not math.isfinite(norm)]
        if found:
            bad = list(dict.fromkeys(group for group, _ in found))
        params = [name for _, name in found]
        shown = ", ".join(params[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
        if len(params) > 1 and len(params) == with_grad:
            shown = f"all {len(params)} of them"
        return f"groups {', '.join(bad)}" + (f"; parameters {shown}" if params else ""), ""

    def _report(self, state, bad_groups: list[str], sent: str | None, comm_state: CommState | None) -> str:
        """Why the run stops: the step, the groups and parameters holding NaN/Inf, before or after the codec."""
        step = state.global_step + 1 if state else "?"
        found = self.noted  # before clipping, when noted (see note_backward_end)
        if not found:
            found = self._find()
        if found:
            bad_groups = list(dict.fromkeys(group for group, _ in found))
        params = [name for _, name in found]
        shown = ", ".join(params[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
        where = f"groups {', '.join(bad_groups)}" + (f"; parameters {shown}" if params else "")
        if sent == "compressed":
            return (
                f"GRPO: the compression codec made NaN/Inf gradients from finite ones at optimizer step {step} "
                f"({where}). This is a bug of grpo_hf, not of your run: please report it with your GRPOConfig's "
                "grpo_* fields. grpo_compression='none' trains without the codec meanwhile."
            )
        if sent == "nonfinite":
            origin = (
                "They were NaN/Inf (or of magnitude 2**60 or more) before the codec, as the backward pass made them on "
                "at least one rank, and were sent uncompressed"
            )
        elif sent == "dense":
            origin = "They were NaN/Inf before the codec (a dense warm-up step: no compression)"
        else:  # what the transport did to them (or the engine's plain exchange)
            origin = (comm_state if comm_state is not None else CommState).nonfinite_origin
        return (
            f"GRPO: {self.consecutive_skips} optimizer steps in a row had NaN/Inf gradients and were skipped, up to "
            f"step {step} ({where}): the run cannot progress. {origin}. Lower the learning rate, check the data and "
            "the loss, or use bf16 instead of fp16; grpo_max_consecutive_skips=0 skips such steps without stopping."
        )


# ----------------------------------------------------------------------------------------------------------------
# The metrics of each step
# ----------------------------------------------------------------------------------------------------------------


class StepMetrics:
    """
    GRPO's figures of each optimizer step, summed per key over the logging window (memory stays constant however long
    the window), and what is measured rather than counted: the update latency (end of backward to end of
    `optimizer.step`, the last 100 steps).

    Args:
        log_groups (`bool`, *optional*, defaults to `False`): log each group's figures (`grpo/<figure>/<group>`), not
            only GRPO's totals (`grpo_log_groups`).
    """

    def __init__(self, log_groups: bool = False):
        self.log_groups = log_groups
        self.window: dict[str, list[float]] = {}  # key -> [sum, count] over the logging window
        self.counts: dict[str, float] = {}  # key -> the value at the window's end (a count is a count, not a mean)
        self.latencies_ms: deque[float] = deque(maxlen=100)
        self._backward_end: float | None = None
        self._warned: set[str] = set()

    def clear(self) -> None:
        self.window.clear()
        self.counts.clear()
        self.latencies_ms.clear()

    def backward_ended(self) -> None:
        self._backward_end = time.perf_counter()

    def step_ended(self) -> None:
        if self._backward_end is not None:
            self.latencies_ms.append((time.perf_counter() - self._backward_end) * 1000)
            self._backward_end = None

    def add(self, key: str, value: float) -> None:
        entry = self.window.setdefault(key, [0.0, 0])
        entry[0] += value
        entry[1] += 1

    def record(self, optimizer, importance: ImportanceState, multipliers: torch.Tensor, index: dict[str, int],
               apply_multipliers: bool, factors=None) -> None:  # fmt: skip
        """
        The metrics of one optimizer step, as it was taken. With `log_groups`: `grpo/lr/<group>` is read from the
        optimizer's param groups (times the probe's factors under DeepSpeed, which applies them inside its step);
        `grpo/lr_scale/<group>` only for multipliers that were applied (importance on, and on for that group); the
        score inputs (`grpo/grad_norm`, `grpo/importance`) either way, averaged over the window, and
        `grpo/update_count/<group>`, a count, as it stands at the window's end. The load balance whenever multipliers
        are applied.
        """
        imp = importance
        if self.log_groups:
            factors = factors or {}
            used_lr: dict[str, float] = {}
            for group in optimizer.param_groups:
                name = group.get("grpo_group")
                if name is not None and name not in used_lr:  # a group's decayed and undecayed params share one rate
                    used_lr[name] = float(group["lr"]) * factors.get(name, 1.0)
            for name, i in index.items():
                if apply_multipliers and bool(imp.scaled[i]):
                    self.add(f"grpo/lr_scale/{name}", float(multipliers[i]))
                self.add(f"grpo/grad_norm/{name}", float(imp.last_grad_norms[i]))
                self.add(f"grpo/importance/{name}", float(imp.last_scores[i]))
                self.counts[f"grpo/update_count/{name}"] = float(imp.update_counts[i])
                if name in used_lr:
                    self.add(f"grpo/lr/{name}", used_lr[name])
        if not apply_multipliers:
            return
        balance = imp.load_balance_std()
        self.add("grpo/load_balance_std", balance)
        if imp.steps > imp.warmup_steps and balance > LOAD_BALANCE_STD_TARGET:
            warn_once(
                logger,
                self._warned,
                "balance",
                f"GRPO load balance: the parameter-weighted std of the applied LR multipliers is {balance:.3f}, above "
                f"the article's target of {LOAD_BALANCE_STD_TARGET}. Some groups get far more learning rate than "
                "others; narrow grpo_lr_scale_min/max if that hurts quality.",
            )

    def pop(self, nonfinite_steps: int, comm_state: CommState | None) -> dict[str, float]:
        """The window's averages (then cleared), the run's non-finite steps, and the compression state's window."""
        logs = {key: total / count for key, (total, count) in self.window.items() if count}
        logs.update(self.counts)
        self.window.clear()
        self.counts.clear()
        logs["grpo/nonfinite_steps"] = float(nonfinite_steps)
        if comm_state is not None:
            stats = comm_state.pop_stats()
            logs.update({k: v for k, v in stats.items() if k not in MEASURED_COMM_KEYS})
        return logs

    def measured(self, comm_state: CommState | None, accelerator: bool = False) -> dict[str, float]:
        """
        The update latency p99 and the time in the compression hook per step (whole run). A p99 above the article's
        target is a warning on an accelerator (`accelerator=True`), where the target applies and the optimizer can be
        changed; an info line on CPU, where optimizer steps of a few hundred milliseconds are the norm.
        """
        out = {}
        if self.latencies_ms:
            p99 = float(torch.quantile(torch.tensor(list(self.latencies_ms), dtype=torch.float64), 0.99))
            out["grpo/update_latency_p99_ms"] = p99
            if p99 > UPDATE_LATENCY_P99_MS_TARGET:
                said = (
                    f"GRPO update latency p99 is {p99:.1f} ms (end of backward to end of optimizer.step), above the "
                    f"article's target of {UPDATE_LATENCY_P99_MS_TARGET:.0f} ms"
                )
                if accelerator:
                    said += (
                        ": gradient clipping, GRPO's group norms and the optimizer step take that long. A fused "
                        "optimizer (optim='adamw_torch_fused') shortens the step."
                    )
                else:
                    said += " (measured on CPU; the target is an accelerator's)."
                warn_once(logger, self._warned, "latency", said, logging.WARNING if accelerator else logging.INFO)
        if comm_state is not None:
            totals = comm_state.totals()
            if totals.get("steps"):
                out["grpo/comm/hook_ms"] = totals["hook_ms"] / totals["steps"]
        return out


# ----------------------------------------------------------------------------------------------------------------
# The callback
# ----------------------------------------------------------------------------------------------------------------


class GRPOCallback(TrainerCallback):
    r"""
    Applies importance-based learning-rate multipliers, measures the article's health metrics, skips optimizer steps
    whose gradients are not finite, and saves/restores all GRPO state with every checkpoint.

    Each optimizer step (after communication and clipping, so every rank sees the same gradients):

    1. `on_pre_optimizer_step`: per-group gradient norms. If one is NaN or infinite (a NaN/Inf gradient on any rank
       reaches every rank through the all-reduce), what happens depends on whether GRPO touched the gradients:

       - **GRPO's codec or sync is in their path** (a compression state is bound: DDP's or FSDP2's compressed
         exchange, the one-process sparse updates, the sync every H steps): the step is skipped. The importance state
         and multipliers are left as they are, the gradients are dropped so that `optimizer.step` changes no parameter
         and no optimizer state, the skip is logged (a warning and `grpo/nonfinite_steps`), and training goes on; the
         compression state has already left its residuals and scales unchanged. Two cases stop the run instead, with a
         [`~grpo_hf.errors.GRPOError`] that names the step, the groups and parameters holding NaN/Inf, and whether
         they were so before or after the codec: the `max_consecutive_skips`-th skipped step in a row (a run that
         cannot progress), and a NaN/Inf after a step whose finite input went through the codec (a bug: the codec
         never makes NaN from finite input).
       - **Nothing of GRPO touched them** (no compression state: one process or DDP without compression, no sync):
         the step is the Trainer's. `optimizer.step` runs on the gradients as they are, with the learning rates of a
         finite step (each group's ratio and its current multiplier); only the importance state is not updated (its
         scores would become NaN). One warning per streak of such steps names the step, the groups and the parameters
         holding NaN/Inf (noted before clipping, which spreads a NaN norm to every gradient), a second one when a
         streak of several steps ends (or training ends inside it); every such step counts in
         `grpo/nonfinite_steps`. The run never stops for it, as the Trainer's does not.
       - **An fp16 `GradScaler`** (`drop_nonfinite_gradients=False`, set by `GRPOMixin`): the scaler skips the step
         and rescales; the importance state is left as it is and the step is counted, as in the first case.

       Otherwise: [`~grpo_hf.importance.ImportanceState.update`] -> multipliers; each optimizer param group
       tagged `grpo_group` gets `lr = scheduler_lr * ratio_g * m_g` (`ratio_g` the group's fixed LR ratio, `m_g` its
       importance multiplier, 1 when importance scaling is off).
    2. `on_optimizer_step`: the scheduler's learning rates are put back, so multipliers never compound, whatever the
       scheduler (including `ReduceLROnPlateau`, which reads the current LR); the compression state closes the step
       ([`~grpo_hf.compression.transport.CommState.end_step`]: the sync every H steps syncs here) and its bytes go to
       the cost callback.

    Its jobs are parts of their own, called in this order: [`GroupStatistics`] (the norms and cosines),
    [`LearningRates`] (ratios and multipliers, put back after the step), [`NonfiniteSteps`] (what a NaN/Inf step does),
    [`StepMetrics`] (the logged window and the measured figures), and the checkpoint state ([`state_dict`],
    [`load_checkpoint`], written and read by [`~grpo_hf.checkpoints`]).

    The metrics are summed per key over the logging window (memory stays constant however long the window);
    [`GRPOMixin.log`] takes their averages into the Trainer's logs.

    Args:
        groups (`list[ParameterGroup]`, *optional*): the semantic groups, in the order of `importance.names`.
        importance (`ImportanceState`, *optional*): per-group scores and multipliers.
        apply_multipliers (`bool`, *optional*, defaults to `True`): `False` tracks scores without scaling the LR.
        lr_ratios (`dict[str, float]`, *optional*): a fixed factor on each group's scheduled LR (see
            [`~grpo_hf.grouping.lr_ratios`]), applied whether or not the multipliers are.
        drop_nonfinite_gradients (`bool`, *optional*, defaults to `True`): drop the gradients of a non-finite step
            that is skipped so that the optimizer skips it; `GRPOMixin` turns it off when an fp16 `GradScaler` skips
            such steps (then every non-finite step is handled as skipped, whatever the compression state).
        max_consecutive_skips (`int`, *optional*, defaults to `8`): stop the run when this many optimizer steps in a
            row were skipped as non-finite (`0`: never stop). Steps taken as the Trainer takes them never stop it.
        log_groups (`bool`, *optional*, defaults to `False`): log each group's figures at every logging step, not only
            GRPO's totals (`grpo_log_groups`; see [`StepMetrics`]).

    Groups and importance state given here or later with [`~GRPOCallback.bind`] (`GRPOMixin` binds them to the model
    it trains). Set `resume_from` to a checkpoint folder before training to restore the GRPO state saved there at
    `on_train_begin` (after the Trainer restored its own).

    Engines (see [`~grpo_hf.engines`]): under FSDP2 the groups follow the sharded parameters ([`~GRPOCallback.follow`])
    and a group's norm is computed from every rank's local sum of squares, gathered and added in rank order, so that
    every rank gets the same norms, multipliers and skip decision; the FSDP2 compression state commits its residuals
    only for a finite step. Under DeepSpeed the optimizer step runs inside the backward, before this callback: with a
    step probe ([`~GRPOCallback.use_step_probe`]) the norms come from the gradients ZeRO stepped, the multipliers they
    give apply from the next step on, and NaN/Inf steps are left to DeepSpeed.
    """

    def __init__(
        self,
        groups: list[ParameterGroup] | None = None,
        importance: ImportanceState | None = None,
        apply_multipliers: bool = True,
        lr_ratios: dict[str, float] | None = None,
        drop_nonfinite_gradients: bool = True,
        max_consecutive_skips: int = 8,
        log_groups: bool = False,
    ):
        self.cost_callback = None  # set by GRPOMixin: its counted figures are checkpointed with the GRPO state
        self.resume_from: str | None = None
        self.heal_from: dict | None = None  # what a fault-tolerant replica group healed from (applied at train begin)
        self.replica_shares = None  # ... and the batches it shares with the others (grpo_hf.replica_shares)
        self.nonfinite = NonfiniteSteps(drop_nonfinite_gradients, max_consecutive_skips)
        self.step_metrics = StepMetrics(log_groups)
        self.probe: OptimizerStepProbe | None = None
        self._probe_communicator = None  # the ranks the probe's sums are added over
        self._step_finite = True  # this step's gradients were finite on every rank (see on_pre_optimizer_step)
        self.bind(groups or [], importance, apply_multipliers, lr_ratios)

    def bind(
        self,
        groups: list[ParameterGroup],
        importance: ImportanceState | None,
        apply_multipliers: bool = True,
        lr_ratios: dict[str, float] | None = None,
        comm_state=None,
        log_groups: bool | None = None,
    ) -> None:
        """
        Follow `groups` (the parameters of the model being trained) with a fresh `importance` state, LR ratios and
        compression state (a [`~grpo_hf.compression.transport.CommState`] or `None`); the count of skipped steps
        restarts. `log_groups`, when given, replaces the setting of the constructor.
        """
        if log_groups is not None:
            self.step_metrics.log_groups = bool(log_groups)
        names = importance.names if importance is not None else []
        self.groups = groups
        self.importance = importance
        self.apply_multipliers = apply_multipliers
        self.lr_ratios = dict(lr_ratios or {})
        self.comm_state = comm_state
        if comm_state is not None and importance is not None:  # replica groups average it at each sync
            comm_state.share_at_sync(importance.shared_scores, importance.set_shared_scores)
        self.stats = GroupStatistics(groups)
        self.learning_rates = LearningRates(names, apply_multipliers, self.lr_ratios)
        self.nonfinite.reset(groups, names)
        self.step_metrics.clear()

    # --- what the other parts read and a checkpoint restores ---
    @property
    def metrics(self) -> dict[str, list[float]]:
        """The logging window: key -> `[sum, count]`."""
        return self.step_metrics.window

    @property
    def nonfinite_steps(self) -> int:
        """Optimizer steps of the run whose gradients held NaN/Inf (skipped or taken)."""
        return self.nonfinite.steps

    @nonfinite_steps.setter
    def nonfinite_steps(self, value: int) -> None:
        self.nonfinite.steps = int(value)

    @property
    def consecutive_skips(self) -> int:
        return self.nonfinite.consecutive_skips

    @consecutive_skips.setter
    def consecutive_skips(self, value: int) -> None:
        self.nonfinite.consecutive_skips = int(value)

    @property
    def skips_nonfinite(self) -> bool:
        """Whether a non-finite optimizer step is skipped rather than taken (see [`NonfiniteSteps.skips`])."""
        return self.nonfinite.skips(self.comm_state)

    def follow(self, model) -> None:
        """Point the groups at `model`'s parameters of the same names (FSDP2 replaced them; see [`~grpo_hf.engines`])."""
        self.stats.follow(model)

    def use_step_probe(self, probe: OptimizerStepProbe, communicator=None) -> None:
        """
        Take the norms from `probe` and apply the LR factors through it (DeepSpeed: the optimizer steps inside the
        backward, before `on_pre_optimizer_step`). The LR ratios apply from the first step, the multipliers one step
        after the gradients they come from. The probe's sums are added over the ranks of `communicator` (a
        [`~grpo_hf.compression.communicator.Communicator`]; the default process group's when `None`).
        """
        self.probe = probe
        self._probe_communicator = (
            communicator if communicator is not None else ProcessGroupCommunicator(emulated=False)
        )
        probe.coherence = self.importance is not None and self.importance.kind == "coherence"
        self._set_probe_factors()

    def _set_probe_factors(self) -> None:
        multipliers = self.importance.multipliers if self.importance is not None else None
        self.learning_rates.probe_factors(self.probe, multipliers)

    def group_grad_norms(self) -> torch.Tensor:
        """L2 norm of each group's gradient (float64; 0 for a group without gradients this step)."""
        return self.stats.grad_norms()

    def group_coherence(self, optimizer) -> torch.Tensor:
        """Cosine between each group's gradient and its optimizer momentum (see [`GroupStatistics.coherence`])."""
        return self.stats.coherence(optimizer)

    # --- per step ---
    def mark_backward_end(self, loss_finite: bool = True) -> None:
        """
        Called by the trainer after the backward of the last micro-batch (communication included), before clipping:
        the update latency starts, and parameters holding NaN/Inf are noted when there may be some
        ([`NonfiniteSteps.note_backward_end`]).
        """
        self.step_metrics.backward_ended()
        self.nonfinite.note_backward_end(loss_finite, self.comm_state)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.probe is not None:
            self._after_probed_step(optimizer)
            return
        norms = self.group_grad_norms()
        comm = self.comm_state
        if comm is not None:  # the sync every H steps: every rank has its own gradients, the ranks agree on the norms
            norms = comm.agree_norms(norms)
        finite = self._step_finite = bool(torch.isfinite(norms).all())  # the compression state's end_step needs it
        if not finite:
            if self.skips_nonfinite:
                self.nonfinite.skip(state, norms, comm)
            else:
                self.nonfinite.take(state, norms)
                if optimizer is not None:  # the learning rates of a finite step (ratios, current multipliers)
                    self.learning_rates.apply(optimizer, self.importance.multipliers)
            return
        self.nonfinite.finite(state)
        coherence = None
        if self.importance.kind == "coherence":
            if optimizer is None:
                raise ValueError("grpo_importance_score='coherence' needs the optimizer's momentum; none was passed.")
            coherence = self.group_coherence(optimizer)
            if comm is not None:
                coherence = comm.agree_mean(coherence)
        multipliers = self.importance.update(norms, coherence)
        if optimizer is None:
            return
        index = self.learning_rates.apply(optimizer, multipliers)
        self.step_metrics.record(optimizer, self.importance, multipliers, index, self.apply_multipliers)

    def _after_probed_step(self, optimizer) -> None:
        """DeepSpeed: importance from the step ZeRO just took; its multipliers go into the probe's factors."""
        sums = self.probe.pop(self._probe_communicator)
        if sums is None:  # DeepSpeed skipped the step (fp16 overflow)
            return
        norms = sums[:, 0].sqrt()
        coherence = None
        if self.importance.kind == "coherence":
            coherence = GroupStatistics.cosines(torch.stack([sums[:, 1], sums[:, 0], sums[:, 2], sums[:, 3]], dim=1))
        multipliers = self.importance.update(norms, coherence)
        if optimizer is not None:
            index = {name: i for i, name in enumerate(self.importance.names)}
            self.step_metrics.record(optimizer, self.importance, multipliers, index, self.apply_multipliers,
                                     factors=self.probe.factors)  # the factors this step used  # fmt: skip
        self._set_probe_factors()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.learning_rates.restore(optimizer)
        self.step_metrics.step_ended()
        if self.comm_state is not None:  # the step closed (the sync every H steps syncs here, after the inner step)
            last = state is not None and 0 < state.max_steps <= state.global_step + 1
            sent = self.comm_state.end_step(finite=self._step_finite, last=last)
            self._step_finite = True
            if self.cost_callback is not None:
                self.cost_callback.add_comm_bytes(sent)

    def on_step_end(self, args, state, control, **kwargs):
        if self.comm_state is not None:  # between fault-tolerant replica groups: the next interval's quorum
            self.comm_state.step_ended(state.global_step)
            shares = self.replica_shares
            if shares is not None and shares.window is not None and state.global_step >= shares.window.end:
                # the window's sync: the next one opens with the quorum's members and what the sync lost
                shares.synced(state.global_step, self.comm_state.kept_members, self.comm_state.communicator.members)

    def on_train_end(self, args, state, control, **kwargs):
        self.nonfinite.train_end(state)

    # --- metrics ---
    def pop_metrics(self) -> dict[str, float]:
        """
        Average of every metric since the last call and the count of skipped non-finite steps of the whole run
        (`grpo/nonfinite_steps`); clears the window. Adds the compression state's window (`grpo/comm/*` bytes and
        ratios, `grpo/density`) when there is one. Counted figures only: a resumed run logs the same.
        """
        return self.step_metrics.pop(self.nonfinite_steps, self.comm_state)

    def measured_metrics(self, accelerator: bool = False) -> dict[str, float]:
        """
        What was measured rather than counted, for the end-of-training metrics: the update latency p99 (end of
        backward to end of `optimizer.step`, over the last 100 steps) and the time spent in the compression hook per
        step (`grpo/comm/hook_ms`, whole run). A p99 above the article's target warns only on an accelerator
        (`accelerator=True`; see [`StepMetrics.measured`]).
        """
        return self.step_metrics.measured(self.comm_state, accelerator)

    # --- checkpoint state (files: grpo_hf.checkpoints) ---
    def state_dict(self, world_size: int = 1, rank: int = 0, heal: bool = False) -> dict:
        """GRPO's state for a checkpoint of rank `rank` of `world_size`; with `heal`, what a healing replica group
        receives (fault-tolerant replica groups): the transport's
        [`~grpo_hf.compression.transport.CommState.heal_state_dict`] in place of its checkpoint state."""
        comm = None
        if self.comm_state is not None:
            comm = self.comm_state.heal_state_dict() if heal else self.comm_state.state_dict()
        return {
            "version": STATE_VERSION,
            "world_size": world_size,
            "rank": rank,
            "nonfinite_steps": self.nonfinite_steps,
            "consecutive_skips": self.consecutive_skips,
            "importance": self.importance.state_dict(),
            "lr_ratios": {name: float(self.lr_ratios.get(name, 1.0)) for name in self.importance.names},
            "comm": comm,
            "cost": self.cost_callback.counted_state() if self.cost_callback is not None else None,
            "replica_shares": self.replica_shares.state_dict() if self.replica_shares is not None else None,
        }

    def load_heal_state(self, saved: dict) -> None:
        """A live replica group's `state_dict(heal=True)`, into this healing one (before its first step)."""
        self.importance.load_state_dict(saved["importance"])
        self.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
        self.consecutive_skips = int(saved.get("consecutive_skips", 0))
        if self.cost_callback is not None and saved.get("cost") is not None:
            self.cost_callback.resume_counts(saved["cost"])
        if self.comm_state is not None and saved.get("comm") is not None:
            self.comm_state.load_heal_state_dict(saved["comm"])

    def on_train_begin(self, args, state, control, **kwargs):
        self.nonfinite.clips = args.max_grad_norm is not None and args.max_grad_norm > 0
        self.nonfinite.streak = 0
        if self.heal_from is not None:  # a fault-tolerant replica group that healed at its first quorum
            payload, self.heal_from = self.heal_from, None
            scheduler = kwargs.get("lr_scheduler")
            if scheduler is not None and payload.get("scheduler") is not None:
                scheduler.load_state_dict(payload["scheduler"])
            self.load_heal_state(payload["grpo"])
        if self.resume_from is not None:
            rank, world_size = process_rank(args)
            self.load_checkpoint(
                self.resume_from, rank, world_size, compression=getattr(args, "grpo_compression", None)
            )
            self.resume_from = None
            if self.probe is not None:  # DeepSpeed: the restored multipliers apply from the next step, as in the run
                self._set_probe_factors()

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        rank, world_size = process_rank(args)
        write_grpo_state(folder, rank, self.state_dict(world_size, rank))

    def load_checkpoint(self, folder: str, rank: int = 0, world_size: int = 1, compression: str | None = None) -> bool:
        """
        Restore the GRPO state saved in `folder` for rank `rank` of `world_size` (see [`~grpo_hf.checkpoints`]: a
        checkpoint of another world size is re-split, with a warning), and the counted cost figures. Returns `False`
        (with a warning) when the checkpoint has no GRPO state (e.g. written by a plain `Trainer`). `compression` is
        the run's `grpo_compression`, for the warning that says why saved residuals are dropped.

        Raises:
            [`~grpo_hf.errors.CheckpointError`]: the checkpoint is missing, incomplete, unreadable or belongs to
                another configuration; the message names the file.
        """
        numels = {name: p.numel() for g in self.groups for name, p in zip(g.param_names, g.params)}
        saved = restore_grpo_state(folder, rank, world_size, self.importance, self.comm_state, numels, compression)
        if saved is None:
            return False
        self.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
        self.consecutive_skips = int(saved.get("consecutive_skips", 0))
        if self.cost_callback is not None and saved.get("cost") is not None:
            self.cost_callback.resume_counts(saved["cost"])
        if self.replica_shares is not None and saved.get("replica_shares"):
            self.replica_shares.resume(saved["replica_shares"], self.replica_shares.window.start)
        return True


__all__ = ["STATE_FILE", "CostCallback", "GRPOCallback", "LearningRates", "NonfiniteSteps", "StepMetrics"]
