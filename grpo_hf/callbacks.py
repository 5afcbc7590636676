"""[`GRPOCallback`]: GRPO's learning rates, health metrics and checkpoint state, applied at every optimizer step.

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
from .compression.transport import CommState
from .cost.callback import CostCallback
from .engines import (
    OptimizerStepProbe,
    follow_parameters,
    local_tensor,
    process_rank,
    shard_groups,
    sum_over_shards,
)
from .errors import GRPOError
from .grouping import ParameterGroup
from .importance import ImportanceState
from .optim.moments import first_moment


logger = logging.getLogger(__name__)

# The article's health targets: load balance between groups (std of the multipliers) and update latency p99.
LOAD_BALANCE_STD_TARGET = 0.15
UPDATE_LATENCY_P99_MS_TARGET = 50.0
# Timings of the compression state's per-window stats: measured, so reported at the end of training, not per step.
MEASURED_COMM_KEYS = ("grpo/comm/hook_ms",)


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
       scheduler (including `ReduceLROnPlateau`, which reads the current LR).

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
    ):
        self.drop_nonfinite_gradients = drop_nonfinite_gradients
        self.max_consecutive_skips = max_consecutive_skips
        self.cost_callback = None  # set by GRPOMixin: its counted figures are checkpointed with the GRPO state
        self.resume_from: str | None = None
        self.metrics: dict[str, list[float]] = {}  # key -> [sum, count] over the logging window
        self._scheduler_lrs: list[float] | None = None
        self._backward_end: float | None = None
        self._nonfinite_params: list[tuple[str, str]] | None = None  # see mark_backward_end
        self._clips = True  # the Trainer clips gradients (max_grad_norm > 0): set at on_train_begin
        self._step_finite = True  # this step's gradients were finite on every rank (see on_pre_optimizer_step)
        self._latencies_ms: deque[float] = deque(maxlen=100)
        self._warned: set[str] = set()
        self.probe: OptimizerStepProbe | None = None
        self.bind(groups or [], importance, apply_multipliers, lr_ratios)

    def bind(
        self,
        groups: list[ParameterGroup],
        importance: ImportanceState | None,
        apply_multipliers: bool = True,
        lr_ratios: dict[str, float] | None = None,
        comm_state=None,
    ) -> None:
        """
        Follow `groups` (the parameters of the model being trained) with a fresh `importance` state, LR ratios and
        compression state ([`~grpo_hf.compression.GRPOCommState`] or `None`); the count of skipped steps restarts.
        """
        self.groups = groups
        self.importance = importance
        self.apply_multipliers = apply_multipliers
        self.lr_ratios = dict(lr_ratios or {})
        self.comm_state = comm_state
        self.nonfinite_steps = 0
        self.consecutive_skips = 0
        self.nonfinite_streak = 0  # non-finite steps in a row taken as the Trainer takes them (see skips_nonfinite)
        self._streak_first_step = 0
        self.metrics.clear()
        self._latencies_ms.clear()
        self._shard_keys: list[list[tuple]] | None = None  # per group and parameter: its shard process groups

    def follow(self, model) -> None:
        """Point the groups at `model`'s parameters of the same names (FSDP2 replaced them; see [`~grpo_hf.engines`])."""
        follow_parameters(self.groups, model)
        self._shard_keys = None

    def use_step_probe(self, probe: OptimizerStepProbe) -> None:
        """
        Take the norms from `probe` and apply the LR factors through it (DeepSpeed: the optimizer steps inside the
        backward, before `on_pre_optimizer_step`). The LR ratios apply from the first step, the multipliers one step
        after the gradients they come from.
        """
        self.probe = probe
        probe.coherence = self.importance is not None and self.importance.kind == "coherence"
        self._set_probe_factors()

    def _set_probe_factors(self) -> None:
        """Each group's LR factor for the next step ZeRO takes: its ratio times its current multiplier."""
        index = {name: i for i, name in enumerate(self.importance.names)} if self.importance is not None else {}
        factors = {}
        for name in self.probe.index:
            multiplier = (
                float(self.importance.multipliers[index[name]]) if self.apply_multipliers and name in index else 1.0
            )
            factors[name] = self.lr_ratios.get(name, 1.0) * multiplier
        self.probe.factors = factors

    def _keys(self) -> list[list[tuple]]:
        if self._shard_keys is None:
            self._shard_keys = [[shard_groups(p) for p in group.params] for group in self.groups]
        return self._shard_keys

    def _sharded(self) -> bool:
        return any(key for keys in self._keys() for key in keys)

    def _group_sums(self, values) -> torch.Tensor:
        """
        `[G, K]` float64 sums over the whole (sharded) parameters of `values(group_index, param) -> [K] local sums`,
        identical on every rank ([`~grpo_hf.engines.sum_over_shards`]).
        """
        partials: dict[tuple, torch.Tensor] = {}
        for i, (group, keys) in enumerate(zip(self.groups, self._keys())):
            for param, key in zip(group.params, keys):
                local = values(param)
                if key not in partials:
                    partials[key] = torch.zeros(len(self.groups), local.numel(), dtype=torch.float64)
                partials[key][i] += local
        return sum_over_shards(partials)

    # --- per step ---
    @property
    def skips_nonfinite(self) -> bool:
        """
        Whether a non-finite optimizer step is skipped (GRPO's codec or sync is in the gradients' path, or an fp16
        `GradScaler` skips it) rather than taken as the Trainer takes it (nothing of GRPO touched the gradients).
        """
        return self.comm_state is not None or not self.drop_nonfinite_gradients

    def mark_backward_end(self, loss_finite: bool = True) -> None:
        """
        Called by the trainer after the backward of the last micro-batch (communication included), before clipping.
        When this step's gradients may hold NaN/Inf (`loss_finite=False` for a NaN/Inf training loss, the codec saw
        them, or the step before was non-finite), notes which parameters hold them now: clipping by a NaN norm spreads
        it to every gradient, so a later report could not name them. One fused pass over the gradients, only then.
        """
        self._backward_end = time.perf_counter()
        suspect = (
            not loss_finite
            or self.consecutive_skips > 0
            or self.nonfinite_streak > 0
            or (self.comm_state is not None and self.comm_state.last_step == "nonfinite")
        )
        self._nonfinite_params = self._find_nonfinite_params() if suspect else None

    def _find_nonfinite_params(self) -> list[tuple[str, str]]:
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

    def group_grad_norms(self) -> torch.Tensor:
        """L2 norm of each group's gradient (float64; 0 for a group without gradients this step)."""
        if self._sharded():

            def squares(param):
                grad = param.grad
                value = 0.0 if grad is None else float(torch.linalg.vector_norm(local_tensor(grad).float())) ** 2
                return torch.tensor([value], dtype=torch.float64)

            return self._group_sums(squares)[:, 0].sqrt()
        norms = []
        for group in self.groups:
            grads = [p.grad.detach() for p in group.params if p.grad is not None]
            if not grads:
                norms.append(0.0)
                continue
            per_tensor = torch.stack(torch._foreach_norm(grads)).double()  # one fused kernel per group
            norms.append(float(torch.linalg.vector_norm(per_tensor)))
        return torch.tensor(norms, dtype=torch.float64)

    def group_coherence(self, optimizer) -> torch.Tensor:
        """
        Cosine between each group's gradient and its optimizer momentum (the first moment, as
        [`~grpo_hf.optim.moments.first_moment`] reads it, from the steps before this one); 1 for a group without
        momentum yet (the first step).
        """
        if self._sharded():

            def products(param):
                moment = first_moment(optimizer, param)
                if param.grad is None or moment is None:
                    return torch.zeros(4, dtype=torch.float64)
                g, m = local_tensor(param.grad).double(), moment.double()
                return torch.stack([(g * m).sum(), (g * g).sum(), (m * m).sum(), torch.ones((), dtype=torch.float64)])

            return self._cosines(self._group_sums(products))
        values = []
        for group in self.groups:
            moments = [(p.grad, first_moment(optimizer, p)) for p in group.params if p.grad is not None]
            pairs = [(grad, moment) for grad, moment in moments if moment is not None]
            if not pairs:
                values.append(1.0)
                continue
            grads, moments = [g.detach().float() for g, _ in pairs], [m.float() for _, m in pairs]
            dot = sum(float((g * m).sum()) for g, m in zip(grads, moments))
            norm_g = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(grads)))
            norm_m = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(moments)))
            values.append(dot / (norm_g * norm_m) if norm_g > 0 and norm_m > 0 else 1.0)
        return torch.tensor(values, dtype=torch.float64)

    @staticmethod
    def _cosines(sums: torch.Tensor) -> torch.Tensor:
        """Cosines from `[G, 4]` sums (g . m, |g|^2, |m|^2, tensors with a moment); 1 where there is no moment."""
        dot, gg, mm, count = sums.unbind(dim=1)
        ok = (count > 0) & (gg > 0) & (mm > 0)
        return torch.where(ok, dot / (gg.sqrt() * mm.sqrt()).clamp(min=1e-300), torch.ones_like(dot))

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
                self._skip_nonfinite_step(state, norms)
            else:
                self._take_nonfinite_step(state, norms, optimizer)
            return
        self.consecutive_skips = 0
        self._end_nonfinite_streak(state)
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
        index = self._apply_lr_factors(optimizer, multipliers)
        self._record(optimizer, multipliers, index)

    def _apply_lr_factors(self, optimizer, multipliers: torch.Tensor) -> dict[str, int]:
        """
        Each param group tagged `grpo_group` gets its scheduled LR times its ratio and (when applied) its multiplier,
        for this step only (`on_optimizer_step` puts the scheduler's values back). Returns the group index by name.
        """
        index = {name: i for i, name in enumerate(self.importance.names)}
        self._scheduler_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            name = group.get("grpo_group")
            if name is None:
                continue
            factor = self.lr_ratios.get(name, 1.0)
            if self.apply_multipliers:
                factor *= float(multipliers[index[name]])
            if factor != 1.0:
                group["lr"] = group["lr"] * factor
        return index

    def _after_probed_step(self, optimizer) -> None:
        """DeepSpeed: importance from the step ZeRO just took; its multipliers go into the probe's factors."""
        sums = self.probe.pop()
        if sums is None:  # DeepSpeed skipped the step (fp16 overflow)
            return
        norms = sums[:, 0].sqrt()
        coherence = None
        if self.importance.kind == "coherence":
            coherence = self._cosines(torch.stack([sums[:, 1], sums[:, 0], sums[:, 2], sums[:, 3]], dim=1))
        multipliers = self.importance.update(norms, coherence)
        if optimizer is not None:
            index = {name: i for i, name in enumerate(self.importance.names)}
            self._record(optimizer, multipliers, index, factors=self.probe.factors)  # the factors this step used
        self._set_probe_factors()

    def _skip_nonfinite_step(self, state, norms: torch.Tensor) -> None:
        self.nonfinite_steps += 1
        self.consecutive_skips += 1
        bad = [name for name, norm in zip(self.importance.names, norms.tolist()) if not math.isfinite(norm)]
        sent = self.comm_state.last_step if self.comm_state is not None else None  # where the transport knows
        codec_made_it = sent == "compressed"
        if codec_made_it or 0 < self.max_consecutive_skips <= self.consecutive_skips:
            raise GRPOError(self._nonfinite_report(state, bad, sent))
        warn = state is None or state.is_world_process_zero
        where, spread = self._nonfinite_where(norms) if warn else ("", "")  # before the gradients are dropped
        if self.drop_nonfinite_gradients:
            for group in self.groups:
                for param in group.params:
                    param.grad = None
        if warn:
            logger.warning(
                f"GRPO: NaN/Inf gradients at optimizer step {state.global_step + 1 if state else '?'} ({where}){spread}: "
                "the step is skipped (no parameter, optimizer state, importance score or compression residual "
                f"changes); {self.nonfinite_steps} step(s) skipped so far."
            )

    def _take_nonfinite_step(self, state, norms: torch.Tensor, optimizer) -> None:
        """
        A non-finite step that nothing of GRPO touched: the Trainer's `optimizer.step` runs on the gradients as they
        are, with the learning rates of a finite step (ratios, current multipliers); the importance state is not
        updated. Warned once per streak (see [`~GRPOCallback.skips_nonfinite`]).
        """
        self.nonfinite_steps += 1
        self.nonfinite_streak += 1
        step = state.global_step + 1 if state else 0
        if self.nonfinite_streak == 1:
            self._streak_first_step = step
        if optimizer is not None:
            self._apply_lr_factors(optimizer, self.importance.multipliers)
        if self.nonfinite_streak > 1 or not (state is None or state.is_world_process_zero):
            return
        where, spread = self._nonfinite_where(norms)
        logger.warning(
            f"GRPO: NaN/Inf gradients at optimizer step {step or '?'} ({where}){spread}. No GRPO codec or sync touches "
            "the gradients in this run, so the step is taken as the Trainer takes it: optimizer.step runs on them "
            "(the parameters it updates may hold NaN from now on); only GRPO's importance state is left as it was. "
            "Further steps of this streak are not warned about one by one: grpo/nonfinite_steps counts them (the "
            "Trainer's logging_nan_inf_filter hides NaN losses in the logs). Lower the learning rate, check the data "
            "and the loss, or use bf16 instead of fp16."
        )

    def _nonfinite_where(self, norms: torch.Tensor) -> tuple[str, str]:
        """
        `("groups ...; parameters ...", note)` for the gradients holding NaN/Inf: those noted before clipping when
        they were (see [`~GRPOCallback.mark_backward_end`]), else those found now; when clipping has multiplied every
        gradient by a NaN norm, all groups and a note saying why no parameter can be named.
        """
        found = self._nonfinite_params
        with_grad = sum(p.grad is not None for group in self.groups for p in group.params)
        if found is None:
            found = self._find_nonfinite_params()
            if self._clips and len(found) > 1 and len(found) == with_grad:
                return f"every gradient, all {len(self.groups)} groups", (
                    ": gradient clipping multiplied every gradient by the NaN norm, so the parameters where it began "
                    "cannot be told apart at this step (max_grad_norm=0 would leave them as they were)"
                )
        bad = [name for name, norm in zip(self.importance.names, norms.tolist()) if not math.isfinite(norm)]
        if found:
            bad = list(dict.fromkeys(group for group, _ in found))
        params = [name for _, name in found]
        shown = ", ".join(params[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
        if len(params) > 1 and len(params) == with_grad:
            shown = f"all {len(params)} of them"
        return f"groups {', '.join(bad)}" + (f"; parameters {shown}" if params else ""), ""

    def _end_nonfinite_streak(self, state) -> None:
        """After a streak of several non-finite steps taken as the Trainer takes them: say how long it was."""
        streak, self.nonfinite_streak = self.nonfinite_streak, 0
        if streak > 1 and (state is None or state.is_world_process_zero):
            last = self._streak_first_step + streak - 1
            logger.warning(
                f"GRPO: {streak} optimizer steps in a row had NaN/Inf gradients (steps {self._streak_first_step} to "
                f"{last}) and were taken as the Trainer takes them; {self.nonfinite_steps} such step(s) in this run."
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.nonfinite_streak > 1 and state.is_world_process_zero:
            logger.warning(
                f"GRPO: training ended inside a streak of {self.nonfinite_streak} optimizer steps with NaN/Inf "
                f"gradients (from step {self._streak_first_step} on), each taken as the Trainer takes it: the "
                "model's parameters may hold NaN or Inf. Check them before using the model."
            )

    def _nonfinite_report(self, state, bad_groups: list[str], sent: str | None) -> str:
        """Why the run stops: the step, the groups and parameters holding NaN/Inf, before or after the codec."""
        step = state.global_step + 1 if state else "?"
        found = self._nonfinite_params  # before clipping, when noted (see mark_backward_end)
        if not found:
            found = self._find_nonfinite_params()
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
            origin = (self.comm_state if self.comm_state is not None else CommState).nonfinite_origin
        return (
            f"GRPO: {self.consecutive_skips} optimizer steps in a row had NaN/Inf gradients and were skipped, up to "
            f"step {step} ({where}): the run cannot progress. {origin}. Lower the learning rate, check the data and "
            "the loss, or use bf16 instead of fp16; grpo_max_consecutive_skips=0 skips such steps without stopping."
        )

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self._scheduler_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._scheduler_lrs):
                group["lr"] = lr
            self._scheduler_lrs = None
        if self._backward_end is not None:
            self._latencies_ms.append((time.perf_counter() - self._backward_end) * 1000)
            self._backward_end = None
        if self.comm_state is not None:  # the step closed (the sync every H steps syncs here, after the inner step)
            last = state is not None and 0 < state.max_steps <= state.global_step + 1
            sent = self.comm_state.end_step(finite=self._step_finite, last=last)
            self._step_finite = True
            if self.cost_callback is not None:
                self.cost_callback.add_comm_bytes(sent)

    def _add(self, key: str, value: float) -> None:
        entry = self.metrics.setdefault(key, [0.0, 0])
        entry[0] += value
        entry[1] += 1

    def _record(self, optimizer, multipliers: torch.Tensor, index: dict[str, int], factors=None) -> None:
        """
        The metrics of one optimizer step, as it was taken: `grpo/lr/<group>` is read from the optimizer's param groups
        (times the probe's factors under DeepSpeed, which applies them inside its step); `grpo/lr_scale/<group>` and the
        load balance only for multipliers that were applied (importance on, and on for that group). The score inputs
        (`grpo/grad_norm`, `grpo/importance`, `grpo/update_count`) are logged either way.
        """
        imp = self.importance
        factors = factors or {}
        used_lr: dict[str, float] = {}
        for group in optimizer.param_groups:
            name = group.get("grpo_group")
            if name is not None and name not in used_lr:  # a group's decayed and undecayed params share one rate
                used_lr[name] = float(group["lr"]) * factors.get(name, 1.0)
        for name, i in index.items():
            if self.apply_multipliers and bool(imp.scaled[i]):
                self._add(f"grpo/lr_scale/{name}", float(multipliers[i]))
            self._add(f"grpo/grad_norm/{name}", float(imp.last_grad_norms[i]))
            self._add(f"grpo/importance/{name}", float(imp.last_scores[i]))
            self._add(f"grpo/update_count/{name}", float(imp.update_counts[i]))
            if name in used_lr:
                self._add(f"grpo/lr/{name}", used_lr[name])
        if not self.apply_multipliers:
            return
        balance = imp.load_balance_std()
        self._add("grpo/load_balance_std", balance)
        if imp.steps > imp.warmup_steps and balance > LOAD_BALANCE_STD_TARGET:
            self._warn_once(
                "balance",
                f"GRPO load balance: the parameter-weighted std of the applied LR multipliers is {balance:.3f}, above "
                f"the article's target of {LOAD_BALANCE_STD_TARGET}. Some groups get far more learning rate than "
                "others; narrow grpo_lr_scale_min/max if that hurts quality.",
            )

    def pop_metrics(self) -> dict[str, float]:
        """
        Average of every metric since the last call and the count of skipped non-finite steps of the whole run
        (`grpo/nonfinite_steps`); clears the window. Adds the compression state's window (`grpo/comm/*` bytes and
        ratios, `grpo/density`) when there is one. Counted figures only: a resumed run logs the same.
        """
        logs = {key: total / count for key, (total, count) in self.metrics.items() if count}
        self.metrics.clear()
        logs["grpo/nonfinite_steps"] = float(self.nonfinite_steps)
        if self.comm_state is not None:
            stats = self.comm_state.pop_stats()
            logs.update({k: v for k, v in stats.items() if k not in MEASURED_COMM_KEYS})
        return logs

    def measured_metrics(self) -> dict[str, float]:
        """
        What was measured rather than counted, for the end-of-training metrics: the update latency p99 (end of
        backward to end of `optimizer.step`, over the last 100 steps) and the time spent in the compression hook per
        step (`grpo/comm/hook_ms`, whole run).
        """
        out = {}
        if self._latencies_ms:
            p99 = float(torch.quantile(torch.tensor(list(self._latencies_ms), dtype=torch.float64), 0.99))
            out["grpo/update_latency_p99_ms"] = p99
            if p99 > UPDATE_LATENCY_P99_MS_TARGET:
                self._warn_once(
                    "latency",
                    f"GRPO update latency p99 is {p99:.1f} ms (end of backward to end of optimizer.step), above the "
                    f"article's target of {UPDATE_LATENCY_P99_MS_TARGET:.0f} ms.",
                )
        if self.comm_state is not None:
            totals = self.comm_state.totals()
            if totals.get("steps"):
                out["grpo/comm/hook_ms"] = totals["hook_ms"] / totals["steps"]
        return out

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # --- checkpoint state (files: grpo_hf.checkpoints) ---
    def state_dict(self, world_size: int = 1, rank: int = 0) -> dict:
        return {
            "version": STATE_VERSION,
            "world_size": world_size,
            "rank": rank,
            "nonfinite_steps": self.nonfinite_steps,
            "consecutive_skips": self.consecutive_skips,
            "importance": self.importance.state_dict(),
            "comm": self.comm_state.state_dict() if self.comm_state is not None else None,
            "cost": self.cost_callback.counted_state() if self.cost_callback is not None else None,
        }

    def on_train_begin(self, args, state, control, **kwargs):
        self._clips = args.max_grad_norm is not None and args.max_grad_norm > 0
        self.nonfinite_streak = 0
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
        return True


__all__ = ["STATE_FILE", "CostCallback", "GRPOCallback"]
