"""[`CostCallback`]: the Trainer callback that measures what a training run costs, with the `grpo_hf.cost` formulas."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback

from .energy import EnergyMeter, make_energy_meter
from .flops import ModelShape, _device, device_name, mfu, peak_tflops
from .prices import CostSettings, billed_devices, comm_time_seconds, cost_breakdown, peak_memory_bytes


logger = logging.getLogger(__name__)


_COUNTED = ("tokens", "flops", "comm_bytes")  # the totals a checkpoint carries over (`counted_state`)


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
    Trainer run *after* the `report_to` integrations in `on_log`, so the keys this callback adds to `logs` (the
    counted figures at each logging step, every figure at the end of training) reach the progress bar / printer and
    the final `TrainOutput.metrics`, but neither `state.log_history` nor TensorBoard / W&B. To report the counted
    figures there, merge [`~CostCallback.counted_metrics`] into `logs` in an override of `Trainer.log` before calling
    `super().log(logs, start_time)` (as `GRPOTrainer` does); the keys already present are left alone by `on_log`.
    Measured figures (time, energy, money, memory) differ between a straight run and a resumed one, so they stay out
    of `state.log_history`.

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
        self._resumed = dict.fromkeys(_COUNTED, 0)  # counted before a resume (resume_counts)
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
        # Training steps get the counted figures; the end of training (`train_runtime`) gets every figure, which the
        # Trainer returns in `TrainOutput.metrics` (callbacks see `logs` after it joined `state.log_history`).
        figures = self.metrics() if "train_runtime" in logs else self.counted_metrics()
        for key, value in figures.items():
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

    def counted_metrics(self) -> dict[str, float]:
        """
        The figures that are counted rather than measured, so that a run resumed from a checkpoint reports the same
        ones as a straight run (with [`~CostCallback.resume_counts`]): `cost/tokens`, `cost/flops`, `cost/comm_bytes`
        and `cost/comm_seconds_projected` (bytes over the configured link). Empty before training starts.
        """
        if self._t_begin is None:
            return {}
        out: dict[str, float] = {}
        source = self._token_source()
        if source is not None:
            final = self._mark(self._clock())
            out["cost/tokens"] = self._resumed["tokens"] + self._global_tokens(final, source)
            flops = self._global_flops(final, source)
            if flops is not None:
                out["cost/flops"] = self._resumed["flops"] + flops
        if self._comm_calls or self._resumed["comm_bytes"]:
            comm_bytes = self._resumed["comm_bytes"] + self._comm_bytes
            out["cost/comm_bytes"] = comm_bytes
            out["cost/comm_seconds_projected"] = comm_time_seconds(comm_bytes, self.settings.cost_link_gbps)
        return out

    def counted_state(self) -> dict[str, float]:
        """The counted totals so far (tokens and FLOPs of the whole job, bytes of this rank), for a checkpoint."""
        counted = self.counted_metrics()
        return {key: counted.get(f"cost/{key}", 0) for key in _COUNTED}

    def resume_counts(self, counted: dict[str, float]) -> None:
        """
        Continue the counted totals of a checkpoint ([`~CostCallback.counted_state`]); call it after `on_train_begin`.
        Time, energy and money cover this `train()` call only: they are measured, not restored.
        """
        self._resumed = {key: counted.get(key, 0) for key in _COUNTED}

    def metrics(self, numeric_only: bool = False) -> dict[str, float | str]:
        """
        The `cost/*` figures so far (frozen at `on_train_end`; the counted ones are those of
        [`~CostCallback.counted_metrics`]); empty before training starts. `cost/mfu` appears only
        for devices with a known peak, token figures only when tokens are counted, `cost/comm_*` only after
        `add_comm_bytes()`. `numeric_only=True` drops the string `cost/energy_source` (TensorBoard warns on strings);
        `cost/energy_estimated` (1.0 or 0.0) carries the same information.
        """
        if self._t_begin is None:
            return {}
        now = self._t_end if self._t_end is not None else self._clock()
        train_seconds = now - self._t_begin
        out: dict[str, float | str] = {"cost/train_seconds": train_seconds}

        out.update(self.counted_metrics())
        source, window = self._token_source(), self._rate_window()
        if source is not None and window is not None:
            start, end, _ = window
            seconds = end.time - start.time
            out["cost/tokens_per_second"] = (
                self._global_tokens(end, source) - self._global_tokens(start, source)
            ) / seconds
            if self._shape is not None:
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


__all__ = ["CostCallback"]
