"""Trainer callbacks of grpo_hf: GRPO's learning rates, health and checkpoint state; what training costs."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback

from .checkpoints import STATE_FILE, STATE_VERSION, restore_grpo_state, write_grpo_state
from .cost import (
    CostSettings,
    EnergyMeter,
    ModelShape,
    billed_devices,
    comm_time_seconds,
    cost_breakdown,
    device_name,
    make_energy_meter,
    mfu,
    peak_memory_bytes,
    peak_tflops,
)
from .cost.flops import _device
from .grouping import ParameterGroup
from .importance import ImportanceState


logger = logging.getLogger(__name__)

# The article's health targets: load balance between groups (std of the multipliers) and update latency p99.
LOAD_BALANCE_STD_TARGET = 0.15
UPDATE_LATENCY_P99_MS_TARGET = 50.0


class GRPOCallback(TrainerCallback):
    r"""
    Applies importance-based learning-rate multipliers, measures the article's health metrics, skips optimizer steps
    whose gradients are not finite, and saves/restores all GRPO state with every checkpoint.

    Each optimizer step (after communication and clipping, so every rank sees the same gradients):

    1. `on_pre_optimizer_step`: per-group gradient norms. If one is NaN or infinite (a NaN/Inf gradient on any rank
       reaches every rank through the all-reduce), the step is skipped: the importance state and multipliers are left
       as they are, the gradients are dropped so that `optimizer.step` changes no parameter and no optimizer state
       (with an fp16 `GradScaler`, the scaler skips the step itself), the skip is logged (a warning and
       `grpo/nonfinite_steps`), and training goes on; the compression hook has already left its residuals and scales
       unchanged. Otherwise: [`~grpo_hf.importance.ImportanceState.update`] -> multipliers; each optimizer param group
       tagged `grpo_group` gets `lr = scheduler_lr * ratio_g * m_g` (`ratio_g` the group's fixed LR ratio, `m_g` its
       importance multiplier, 1 when importance scaling is off).
    2. `on_optimizer_step`: the scheduler's learning rates are put back, so multipliers never compound, whatever the
       scheduler (including `ReduceLROnPlateau`, which reads the current LR).

    The metrics are summed per key over the logging window (memory stays constant however long the window);
    [`GRPOMixin.log`] takes their averages into the Trainer's logs.

    Args:
        groups (`list[ParameterGroup]`): the semantic groups, in the order of `importance.names`.
        importance (`ImportanceState`): per-group scores and multipliers.
        apply_multipliers (`bool`, *optional*, defaults to `True`): `False` tracks scores without scaling the LR.
        lr_ratios (`dict[str, float]`, *optional*): a fixed factor on each group's scheduled LR (see
            [`~grpo_hf.grouping.lr_ratios`]), applied whether or not the multipliers are.
        drop_nonfinite_gradients (`bool`, *optional*, defaults to `True`): drop the gradients of a non-finite step
            so that the optimizer skips it; `GRPOMixin` turns it off when an fp16 `GradScaler` skips such steps.
    """

    def __init__(
        self,
        groups: list[ParameterGroup],
        importance: ImportanceState,
        apply_multipliers: bool = True,
        lr_ratios: dict[str, float] | None = None,
        drop_nonfinite_gradients: bool = True,
    ):
        self.groups = groups
        self.importance = importance
        self.apply_multipliers = apply_multipliers
        self.lr_ratios = dict(lr_ratios or {})
        self.drop_nonfinite_gradients = drop_nonfinite_gradients
        self.comm_state = None  # set by GRPOMixin once the compression state exists
        self.metrics: dict[str, list[float]] = {}  # key -> [sum, count] over the logging window
        self.nonfinite_steps = 0
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

    def group_coherence(self, optimizer) -> torch.Tensor:
        """
        Cosine between each group's gradient and its optimizer momentum (`exp_avg` of Adam-like optimizers, from the
        steps before this one); 1 for a group without momentum yet (the first step).
        """
        state = optimizer.state
        values = []
        for group in self.groups:
            pairs = [
                (p.grad, state[p]["exp_avg"])
                for p in group.params
                if p.grad is not None and "exp_avg" in state.get(p, {})
            ]
            if not pairs:
                values.append(1.0)
                continue
            grads, moments = [g.detach().float() for g, _ in pairs], [m.float() for _, m in pairs]
            dot = sum(float((g * m).sum()) for g, m in zip(grads, moments))
            norm_g = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(grads)))
            norm_m = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(moments)))
            values.append(dot / (norm_g * norm_m) if norm_g > 0 and norm_m > 0 else 1.0)
        return torch.tensor(values, dtype=torch.float64)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        norms = self.group_grad_norms()
        if not torch.isfinite(norms).all():
            self._skip_nonfinite_step(state, norms)
            return
        coherence = None
        if self.importance.kind == "coherence":
            if optimizer is None:
                raise ValueError("grpo_importance_score='coherence' needs the optimizer's momentum; none was passed.")
            coherence = self.group_coherence(optimizer)
        multipliers = self.importance.update(norms, coherence)
        if optimizer is None:
            return
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
        self._record(optimizer, multipliers, index)

    def _skip_nonfinite_step(self, state, norms: torch.Tensor) -> None:
        self.nonfinite_steps += 1
        bad = [name for name, norm in zip(self.importance.names, norms.tolist()) if not math.isfinite(norm)]
        if self.drop_nonfinite_gradients:
            for group in self.groups:
                for param in group.params:
                    param.grad = None
        if state is None or state.is_world_process_zero:
            logger.warning(
                f"GRPO: NaN/Inf gradients at optimizer step {state.global_step + 1 if state else '?'} (groups "
                f"{', '.join(bad)}): the step is skipped (no parameter, optimizer state, importance score or "
                f"compression residual changes); {self.nonfinite_steps} step(s) skipped so far."
            )

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self._scheduler_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._scheduler_lrs):
                group["lr"] = lr
            self._scheduler_lrs = None
        if self._backward_end is not None:
            self._latencies_ms.append((time.perf_counter() - self._backward_end) * 1000)
            self._backward_end = None

    def _add(self, key: str, value: float) -> None:
        entry = self.metrics.setdefault(key, [0.0, 0])
        entry[0] += value
        entry[1] += 1

    def _record(self, optimizer, multipliers: torch.Tensor, index: dict[str, int]) -> None:
        imp = self.importance
        effective_lr = {g["grpo_group"]: g["lr"] for g in optimizer.param_groups if "grpo_group" in g}
        for name, i in index.items():
            self._add(f"grpo/lr_scale/{name}", float(multipliers[i]))
            self._add(f"grpo/grad_norm/{name}", float(imp.last_grad_norms[i]))
            self._add(f"grpo/importance/{name}", float(imp.last_scores[i]))
            self._add(f"grpo/update_count/{name}", float(imp.update_counts[i]))
            if name in effective_lr:
                self._add(f"grpo/lr/{name}", effective_lr[name])
        balance = imp.load_balance_std()
        self._add("grpo/load_balance_std", balance)
        if imp.steps > imp.warmup_steps and balance > LOAD_BALANCE_STD_TARGET:
            self._warn_once(
                "balance",
                f"GRPO load balance: the parameter-weighted std of the LR multipliers is {balance:.3f}, above the "
                f"article's target of {LOAD_BALANCE_STD_TARGET}. Some groups get far more learning rate than others; "
                "narrow grpo_lr_scale_min/max if that hurts quality.",
            )

    def pop_metrics(self) -> dict[str, float]:
        """
        Average of every metric since the last call, the update latency p99 and the count of skipped non-finite
        steps of the whole run (`grpo/nonfinite_steps`); clears the window.
        """
        logs = {key: total / count for key, (total, count) in self.metrics.items() if count}
        self.metrics.clear()
        logs["grpo/nonfinite_steps"] = float(self.nonfinite_steps)
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

    # --- checkpoint state (files: grpo_hf.checkpoints) ---
    def state_dict(self, world_size: int = 1, rank: int = 0) -> dict:
        return {
            "version": STATE_VERSION,
            "world_size": world_size,
            "rank": rank,
            "nonfinite_steps": self.nonfinite_steps,
            "importance": self.importance.state_dict(),
            "comm": self.comm_state.state_dict() if self.comm_state is not None else None,
        }

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        write_grpo_state(folder, args.process_index, self.state_dict(args.world_size, args.process_index))

    def load_checkpoint(self, folder: str, rank: int = 0, world_size: int = 1) -> bool:
        """
        Restore the GRPO state saved in `folder` for rank `rank` of `world_size` (see [`~grpo_hf.checkpoints`]: a
        checkpoint of another world size is re-split, with a warning). Returns `False` (with a warning) when the
        checkpoint has no GRPO state (e.g. written by a plain `Trainer`).

        Raises:
            [`~grpo_hf.errors.CheckpointError`]: the checkpoint is missing, incomplete, unreadable or belongs to
                another configuration; the message names the file.
        """
        numels = {name: p.numel() for g in self.groups for name, p in zip(g.param_names, g.params)}
        saved = restore_grpo_state(folder, rank, world_size, self.importance, self.comm_state, numels)
        if saved is None:
            return False
        self.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
        return True


class _Mark(NamedTuple):
    time: float
    local_tokens: int
    local_flops: int
    state_tokens: int


class CostCallback(TrainerCallback):
    r"""
    Measures what training costs and reports it under `cost/*` keys: wall time, tokens, tokens/s, FLOPs, MFU, energy
    and its source, peak memory, money and, when the trainer reports bytes sent, projected communication time.

    Every rank measures; figures are whole-job figures seen from one rank:

    - tokens: `add_tokens()` counts this rank's tokens and they are multiplied by the world size (ranks get equal
      batches); without `add_tokens()` calls, `state.num_input_tokens_seen` (already summed over ranks) is used when
      `include_num_input_tokens_seen` is on. Without either, token figures are left out.
    - rates (tokens/s, MFU) leave out the first `skip_steps` optimizer steps (compilation, allocator and cache
      warm-up); they run from the end of step `skip_steps` to the end of the latest step. With no step after the
      warm-up, rates cover all steps and the summary says `rates_include_warmup: True`.
    - time, energy and money cover the whole of training, warm-up included: it is paid for.
    - energy is this rank's meter times the billed devices ([`~grpo_hf.cost.billed_devices`]); on CPUs a rank's
      meter sees the whole machine and the billed unit is the machine.

    Wiring: pass it in `callbacks=[...]`; call [`~CostCallback.add_tokens`] from `training_step` and
    [`~CostCallback.add_comm_bytes`] once per optimizer step with the bytes this rank sent. Callbacks passed to the
    Trainer run *after* the `report_to` integrations in `on_log`, so the keys this callback adds to `logs` reach the
    progress bar / printer and the final `TrainOutput.metrics`, but neither `state.log_history` nor TensorBoard /
    W&B. To report them there, merge [`~CostCallback.metrics`] into `logs` in an override of `Trainer.log` before
    calling `super().log(logs, start_time)`; the keys already present are left alone by `on_log`.

    Example:

    ```python
    >>> from grpo_hf import CostCallback
    >>> from grpo_hf.cost import CostSettings
    >>> cost = CostCallback(CostSettings(cost_gpu_hour_usd=2.5), skip_steps=10)
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cost])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> cost.summary()["metrics"]["cost/total_usd"]  # doctest: +SKIP
    ```

    Args:
        settings ([`~grpo_hf.cost.CostSettings`], *optional*):
            Prices and assumptions. Defaults to [`~grpo_hf.cost.CostSettings.from_args`] of the training arguments.
        skip_steps (`int`, *optional*, defaults to `2`):
            Optimizer steps left out of the rates.
        seq_len (`int`, *optional*):
            Sequence length for the attention FLOPs when tokens are counted through `num_input_tokens_seen` (or
            `add_tokens` gets no `seq_len`). Without any, the attention term is left out and the summary says so.
        add_to_logs (`bool`, *optional*, defaults to `True`):
            Add the `cost/*` keys to the `logs` of training log events (`on_log`).
        energy_meter ([`~grpo_hf.cost.EnergyMeter`], *optional*):
            Meter to use instead of [`~grpo_hf.cost.make_energy_meter`]'s choice.
        clock (`Callable[[], float]`, *optional*, defaults to `time.perf_counter`):
            Time source in seconds.
    """

    def __init__(
        self,
        settings: CostSettings | None = None,
        skip_steps: int = 2,
        seq_len: int | None = None,
        add_to_logs: bool = True,
        energy_meter: EnergyMeter | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if skip_steps < 0:
            raise ValueError(f"skip_steps must be >= 0, got {skip_steps}.")
        self.settings = settings
        self.skip_steps = skip_steps
        self.seq_len = seq_len
        self.add_to_logs = add_to_logs
        self._given_meter = energy_meter
        self._clock = clock
        self._reset()

    def _reset(self) -> None:
        self._meter: EnergyMeter | None = None
        self._device = torch.device("cpu")
        self._device_name = "cpu"
        self._world_size = 1
        self._billed = 1
        self._state = None
        self._state_tokens_enabled = False
        self._state_tokens_begin = 0
        self._shape: ModelShape | None = None
        self._peak: float | None = None
        self._local_tokens = 0
        self._local_flops = 0
        self._attention_term_missing = False
        self._last_seq_len: int | None = None
        self._comm_bytes = 0
        self._comm_calls = 0
        self._steps = 0
        self._t_begin: float | None = None
        self._t_end: float | None = None
        self._joules_end: float | None = None
        self._peak_memory_end: int | None = None
        self._begin_mark: _Mark | None = None
        self._window_start: _Mark | None = None
        self._last_step: _Mark | None = None

    # ---- what the trainer calls ------------------------------------------------------------------------------

    def add_tokens(self, num_tokens: int, seq_len: int | None = None) -> None:
        """
        Count `num_tokens` tokens fed to the model by this process (one micro-batch), at sequence length `seq_len`
        (for the attention FLOPs; defaults to the `seq_len` given to the callback).
        """
        num_tokens = int(num_tokens)
        self._local_tokens += num_tokens
        seq_len = seq_len if seq_len is not None else self.seq_len
        if seq_len is None:
            self._attention_term_missing = True
        else:
            self._last_seq_len = int(seq_len)
        if self._shape is not None:
            self._local_flops += num_tokens * self._shape.flops_per_token(int(seq_len or 0))

    def add_comm_bytes(self, num_bytes: float) -> None:
        """Count `num_bytes` bytes sent by this rank (call as often as convenient, e.g. once per optimizer step)."""
        self._comm_bytes += num_bytes
        self._comm_calls += 1

    # ---- events ----------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._reset()
        self.settings = self.settings if self.settings is not None else CostSettings.from_args(args)
        self._device = _device(getattr(args, "device", None))
        self._device_name = device_name(self._device)
        self._world_size = int(getattr(args, "world_size", 1) or 1)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._billed = billed_devices(self.settings, self._device.type, self._world_size, local_world_size)
        self._state = state
        self._state_tokens_enabled = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        self._state_tokens_begin = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if model is not None:
            try:
                self._shape = ModelShape.from_model(model)
            except ValueError as err:
                logger.debug("FLOPs not reported: %s", err)
        self._peak = peak_tflops(self._device, self.settings)
        self._meter = self._given_meter or make_energy_meter(self.settings, self._device, clock=self._clock)
        self._meter.start()
        self._t_begin = self._clock()
        self._begin_mark = self._mark(self._t_begin)
        if self.skip_steps == 0:
            self._window_start = self._begin_mark

    def on_step_end(self, args, state, control, **kwargs):
        if self._t_begin is None:
            return
        self._steps += 1
        self._last_step = self._mark(self._clock())
        if self._steps == self.skip_steps:
            self._window_start = self._last_step
        self._meter.read_joules()  # keeps RAPL wrap-around detection and power sampling current

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.add_to_logs or logs is None or self._t_begin is None:
            return
        if any(k.startswith(("eval_", "test_", "predict_")) for k in logs):
            return
        for key, value in self.metrics().items():
            logs.setdefault(key, value)

    def on_train_end(self, args, state, control, **kwargs):
        if self._t_begin is None or self._t_end is not None:
            return
        self._t_end = self._clock()
        self._joules_end = self._meter.read_joules()
        self._meter.stop()
        self._peak_memory_end = peak_memory_bytes(self._device)
        if state.is_world_process_zero:
            m = self.metrics()
            logger.info(
                "Training cost: %.1f s, %.4f kWh (%s), $%.4f total.",
                m["cost/train_seconds"],
                m["cost/energy_kwh"],
                m["cost/energy_source"],
                m["cost/total_usd"],
            )

    # ---- figures ---------------------------------------------------------------------------------------------

    def _mark(self, now: float) -> _Mark:
        state_tokens = int(getattr(self._state, "num_input_tokens_seen", 0) or 0)
        return _Mark(now, self._local_tokens, self._local_flops, state_tokens)

    def _token_source(self) -> str | None:
        if self._local_tokens > 0:
            return "add_tokens"
        if self._state_tokens_enabled:
            return "num_input_tokens_seen"
        return None

    def _global_tokens(self, mark: _Mark, source: str) -> int:
        if source == "add_tokens":
            return mark.local_tokens * self._world_size
        return mark.state_tokens - self._state_tokens_begin

    def _global_flops(self, mark: _Mark, source: str) -> int | None:
        if self._shape is None:
            return None
        if source == "add_tokens":
            return mark.local_flops * self._world_size
        seq_len = self.seq_len if self.seq_len is not None else self._last_seq_len
        return self._global_tokens(mark, source) * self._shape.flops_per_token(seq_len or 0)

    def _rate_window(self) -> tuple[_Mark, _Mark, bool] | None:
        end = self._last_step
        if end is None:
            return None
        start = self._window_start
        if start is not None and end.time > start.time:
            return start, end, False
        if end.time > self._begin_mark.time:
            return self._begin_mark, end, True
        return None

    def _flops_seq_len_known(self, source: str | None) -> bool:
        if source == "add_tokens":
            return not self._attention_term_missing
        return (self.seq_len if self.seq_len is not None else self._last_seq_len) is not None

    def metrics(self, numeric_only: bool = False) -> dict[str, float | str]:
        """
        The `cost/*` figures so far (frozen at `on_train_end`); empty before training starts. `cost/mfu` appears only
        for devices with a known peak, token figures only when tokens are counted, `cost/comm_*` only after
        `add_comm_bytes()`. `numeric_only=True` drops the string `cost/energy_source` (TensorBoard warns on strings);
        `cost/energy_estimated` (1.0 or 0.0) carries the same information.
        """
        if self._t_begin is None:
            return {}
        now = self._t_end if self._t_end is not None else self._clock()
        train_seconds = now - self._t_begin
        out: dict[str, float | str] = {"cost/train_seconds": train_seconds}

        source = self._token_source()
        if source is not None:
            final = self._mark(now)
            out["cost/tokens"] = self._global_tokens(final, source)
            window = self._rate_window()
            if window is not None:
                start, end, _ = window
                seconds = end.time - start.time
                out["cost/tokens_per_second"] = (
                    self._global_tokens(end, source) - self._global_tokens(start, source)
                ) / seconds
            flops = self._global_flops(final, source)
            if flops is not None:
                out["cost/flops"] = flops
                if window is not None:
                    flops_per_second = (self._global_flops(end, source) - self._global_flops(start, source)) / seconds
                    value = mfu(flops_per_second, self._peak, self._world_size)
                    if value is not None:
                        out["cost/mfu"] = value

        joules = self._joules_end if self._joules_end is not None else self._meter.read_joules()
        energy_kwh = joules * self._billed / 3.6e6
        out["cost/energy_kwh"] = energy_kwh
        if not numeric_only:
            out["cost/energy_source"] = self._meter.source
        out["cost/energy_estimated"] = 1.0 if self._meter.estimated else 0.0
        peak_memory = self._peak_memory_end if self._t_end is not None else peak_memory_bytes(self._device)
        if peak_memory is not None:
            out["cost/peak_memory_gb"] = peak_memory / 1e9
        money = cost_breakdown(train_seconds / 3600, energy_kwh, self.settings, num_devices=self._billed)
        for key in ("gpu_usd", "energy_usd", "cooling_usd", "total_usd"):
            out[f"cost/{key}"] = money[key]
        if self._comm_calls:
            out["cost/comm_bytes"] = self._comm_bytes
            out["cost/comm_seconds_projected"] = comm_time_seconds(self._comm_bytes, self.settings.cost_link_gbps)
        return out

    def summary(self) -> dict[str, Any]:
        """
        All figures (`"metrics"`, as [`~CostCallback.metrics`]) and the assumptions behind them (`"assumptions"`):
        prices, PUE, energy source and whether it is estimated, devices billed, token source, FLOPs formula inputs,
        peak TFLOP/s, steps left out of the rates.
        """
        if self._t_begin is None:
            return {"metrics": {}, "assumptions": {}}
        source = self._token_source()
        window = self._rate_window()
        seq_len = self.seq_len if self.seq_len is not None else self._last_seq_len
        assumptions: dict[str, Any] = {
            **self.settings.to_dict(),
            "device": str(self._device),
            "device_name": self._device_name,
            "world_size": self._world_size,
            "billed_devices": self._billed,
            "energy_source": self._meter.source,
            "energy_estimated": self._meter.estimated,
            "energy_scope": "one rank's meter x billed_devices",
            "power_watts": getattr(self._meter, "power_watts", None),
            "token_source": source,
            "tokens_scaled_by_world_size": source == "add_tokens",
            "seq_len": seq_len,
            "flops_attention_term": self._flops_seq_len_known(source),
            "flops_per_token": self._shape.flops_per_token(seq_len or 0) if self._shape is not None else None,
            "flops_formula": "4*N_total + 2*N_trainable + 12*L*H*Q*T (= 6N + 12LHQT when all trainable)",
            "num_params": self._shape.num_params if self._shape is not None else None,
            "trainable_params": self._shape.trainable_params if self._shape is not None else None,
            "peak_tflops": self._peak,
            "steps": self._steps,
            "skip_steps": self.skip_steps,
            "timed_steps": 0 if window is None else self._steps - (0 if window[2] else self.skip_steps),
            "rates_include_warmup": bool(window is not None and window[2]),
            "peak_memory_source": "torch.cuda.max_memory_allocated"
            if self._device.type == "cuda"
            else "ru_maxrss (process peak RSS)",
        }
        return {"metrics": self.metrics(), "assumptions": assumptions}


__all__ = ["STATE_FILE", "CostCallback", "GRPOCallback"]
