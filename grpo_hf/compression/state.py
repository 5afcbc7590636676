"""`GRPOCommState`: the settings, error-feedback residuals, gradient scales and traffic statistics of the compression."""

import logging

import torch
import torch.distributed as dist
from torch import nn

from .codec import chunk_slices
from .layout import Segment
from .spec import MODES, CodecSpec
from .store import RowScales, RowStore, segment_slots
from .traffic import allreduce_bytes


logger = logging.getLogger(__name__)

STATE_VERSION = 2
DEFAULT_SCALE_BETA = 0.99


class StepStats:
    """Traffic of one optimizer step (all buckets)."""

    KEYS = ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "kept", "numel", "hook_ms", "comm_ms")
    __slots__ = KEYS

    def __init__(self):
        for key in self.KEYS:
            setattr(self, key, 0.0)

    def dense(self, numel: int, world_size: int, element_size: int = 4) -> None:
        """Account `numel` entries all-reduced dense, `element_size` bytes each."""
        self.bytes_sent += allreduce_bytes(numel * element_size, world_size)
        self.kept += numel

    def baseline(self, numel: int, world_size: int) -> None:
        """Account `numel` gradient entries in the dense fp32 / fp16 baselines."""
        self.bytes_dense_fp32 += allreduce_bytes(4 * numel, world_size)
        self.bytes_dense_fp16 += allreduce_bytes(2 * numel, world_size)
        self.numel += numel

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.KEYS}


def _empty_window() -> dict:
    return {key: 0.0 for key in StepStats.KEYS} | {"steps": 0, "dense_steps": 0}


def _metrics(summed: dict, steps: int, dense_steps: int, prefix: bool) -> dict[str, float]:
    comm, top = ("grpo/comm/", "grpo/") if prefix else ("", "")
    density = summed["kept"] / summed["numel"] if summed["numel"] else 1.0
    out = {
        f"{comm}bytes_sent": summed["bytes_sent"] / steps,
        f"{comm}bytes_dense_fp32": summed["bytes_dense_fp32"] / steps,
        f"{comm}bytes_dense_fp16": summed["bytes_dense_fp16"] / steps,
        f"{top}density": density,
        f"{top}sparsity": 1.0 - density,
        f"{comm}hook_ms": summed["hook_ms"] / steps,
        f"{comm}dense_steps": float(dense_steps),
    }
    if summed["bytes_sent"] > 0:
        out[f"{comm}ratio_fp32"] = summed["bytes_dense_fp32"] / summed["bytes_sent"]
        out[f"{comm}ratio_fp16"] = summed["bytes_dense_fp16"] / summed["bytes_sent"]
    return out


class GRPOCommState:
    r"""
    Settings, error-feedback residuals, gradient scales and traffic statistics of
    [`~grpo_hf.compression.grpo_comm_hook`] and [`~grpo_hf.compression.compress_locally`].

    Example:

    ```python
    >>> from grpo_hf.compression import GRPOCommState, compression_plan, grpo_comm_hook

    >>> state = GRPOCommState(compression_plan(model)).bind(model)  # GRPOConfig's defaults
    >>> ddp_model.register_comm_hook(state, grpo_comm_hook)
    ```

    Args:
        plan (`dict[str, CodecSpec | None]`):
            Parameter name -> how it is sent (`None`: dense), as [`~grpo_hf.compression.compression_plan`] decides it.
            Parameters missing from it are sent dense (with a warning).
        mode (`str`, *optional*, defaults to `"allgather"`):
            `"allgather"` (every rank's message to every rank: per-rank bytes grow as `W - 1`) or `"allreduce"`
            (compressed reduce-scatter with error feedback on the owners, then an all-gather: flat in `W`).
        dense_warmup_steps (`int`, *optional*, defaults to `2`):
            Optimizer steps sent dense before compression starts. DDP rebuilds its buckets after the first step; the
            dense steps also give the gradient scales a first estimate.
        scale_gradients (`bool`, *optional*, defaults to `True`):
            Compress each entry relative to its own gradient scale (`sqrt` of an EMA of the squared averaged gradient,
            the same on every rank) rather than to its block's largest magnitude alone, so that small coordinates
            keep their precision, as Adam sees them.
        scale_beta (`float`, *optional*, defaults to `0.99`):
            EMA factor of the squared gradients behind the scales.
        scale_clip (`float`, *optional*):
            With gradient scales: an entry sends at most this many of its scales per step (the rest waits in the
            residual), so that an entry whose scale is small (a rare token's embedding row) cannot dominate the scale
            of its block. `None`: no cap.
        simulated_world_size (`int`, *optional*, defaults to `2`):
            World size used by [`~grpo_hf.compression.compress_locally`] to count the bytes one worker would send.
        process_group (`torch.distributed.ProcessGroup`, *optional*):
            Group to communicate in; the default group when `None`.
    """

    __slots__ = (
        # --- tuned ---
        "plan",
        "mode",
        "dense_warmup_steps",
        "scale_gradients",
        "scale_beta",
        "scale_clip",
        # --- seldom tuned ---
        "simulated_world_size",
        "process_group",
        # --- bound by bind() ---
        "names",
        "world_size",
        "rank",
        # --- internal state (checkpointed) ---
        "residuals",
        "owner_residuals",
        "squares",
        "step",
        "scale_updates",
        # --- per step ---
        "_nonfinite",
        "_step",
        "_segments",
        "_buffers",
        # --- statistics ---
        "hook_calls",
        "_window",
        "_totals",
        "_warned",
    )

    def __init__(
        self,
        plan: dict[str, CodecSpec | None],
        mode: str = "allgather",
        dense_warmup_steps: int = 2,
        scale_gradients: bool = True,
        scale_beta: float = DEFAULT_SCALE_BETA,
        scale_clip: float | None = None,
        simulated_world_size: int = 2,
        process_group: dist.ProcessGroup | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES} (`compression_plan` resolves 'auto').")
        if dense_warmup_steps < 0:
            raise ValueError(f"dense_warmup_steps={dense_warmup_steps}: use 0 or more.")
        if not 0 <= scale_beta < 1:
            raise ValueError(f"scale_beta={scale_beta}: use a value in [0, 1), e.g. 0.99.")
        if simulated_world_size < 1:
            raise ValueError(f"simulated_world_size={simulated_world_size}: use 1 or more (2 is the default).")
        bad = sorted(name for name, spec in plan.items() if spec is not None and not isinstance(spec, CodecSpec))
        if bad:
            raise ValueError(
                f"plan[{bad[0]!r}] is not a CodecSpec or None; build the plan with grpo_hf.compression.compression_plan."
            )
        self.plan = dict(plan)
        self.mode = mode
        self.dense_warmup_steps = int(dense_warmup_steps)
        self.scale_gradients = bool(scale_gradients)
        self.scale_beta = float(scale_beta)
        if scale_clip is not None and not scale_clip > 0:
            raise ValueError(f"scale_clip={scale_clip}: use a positive number of scales (e.g. 4) or None.")
        self.scale_clip = None if scale_clip is None else float(scale_clip)
        self.simulated_world_size = int(simulated_world_size)
        self.process_group = process_group
        self.names: dict[int, str] = {}
        self.world_size, self.rank = 1, 0
        self.residuals = RowStore()  # this rank's error feedback, per parameter
        self.owner_residuals = RowStore()  # all-reduce mode: the error feedback of the chunks this rank owns
        self.squares = RowStore()  # EMA of the squared averaged gradient, per parameter (same on every rank)
        self.step = 0
        self.scale_updates = 0
        self._nonfinite = False
        self._step = StepStats()
        self._segments: dict[tuple, list] = {}  # bucket layout (names) -> its segments
        self._buffers: dict[tuple, torch.Tensor] = {}  # work buffers of the exchange, kept from step to step
        self.hook_calls = 0
        self._window = _empty_window()  # sums over the steps since the last pop_stats (constant size)
        self._totals = {key: 0.0 for key in StepStats.KEYS} | {"steps": 0, "dense_steps": 0, "nonfinite_steps": 0}
        self._warned: set[str] = set()

    def spec_for(self, name: str | None) -> CodecSpec | None:
        """The codec spec a parameter is sent with, `None` when dense."""
        return self.plan.get(name) if name is not None else None

    # --- setup ---
    def bind(self, model: nn.Module) -> "GRPOCommState":
        """
        Map the model's trainable parameters (by `id`) to their names and read the world size and rank from
        `torch.distributed` (1 / 0 when it is not initialized). Pass the unwrapped model (a DDP wrapper is unwrapped).
        """
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(self.process_group)
            self.rank = dist.get_rank(self.process_group)
        else:
            self.world_size, self.rank = 1, 0
        missing = sorted(set(self.names.values()) - set(self.plan))
        if missing:
            self._warn_once(
                "missing",
                f"{len(missing)} trainable parameters have no compression setting and are sent dense (e.g. "
                f"{missing[0]}). Build the plan with grpo_hf.compression.compression_plan on the same model.",
            )
        numels = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
        compressed = [n for n in numels if self.spec_for(n) is not None]
        logger.info(
            "GRPO gradient compression: mode=%s, world size %d, %d of %d trainable tensors (%d of %d entries) "
            "compressed, dense warm-up %d steps, gradient scales %s.",
            self.mode,
            self.world_size,
            len(compressed),
            len(numels),
            sum(numels[n] for n in compressed),
            sum(numels.values()),
            self.dense_warmup_steps,
            "on" if self.scale_gradients else "off",
        )
        return self

    @property
    def warming_up(self) -> bool:
        return self.step < self.dense_warmup_steps

    # --- gradient scales ---
    def scales_of(self, segment: Segment, device) -> "RowScales | None":
        """
        The per-entry scales a segment is compressed relative to (see [`RowScales`]), or `None` when scaling is off or
        has no estimate yet.
        """
        if not self.scale_gradients or self.scale_updates == 0:
            return None
        key = ("squares", *segment.key)
        squares = self.squares.row(key, segment_slots(segment), segment.length, device)
        return RowScales.from_squares(
            squares, self.squares.row_sum(key), self.scale_beta, self.scale_updates, self.scale_clip
        )

    def track_scale(self, segment: Segment, averaged: torch.Tensor) -> None:
        """Stage the EMA of the squared averaged gradient of a segment (`[length]` fp32) for this step."""
        if not self.scale_gradients:
            return
        key, slots = ("squares", *segment.key), segment_slots(segment)
        old = self.squares.row(key, slots, segment.length, averaged.device)
        new = self.squares.scratch(key, segment.length, averaged.device)
        total = 0.0
        for piece in chunk_slices(segment.length, averaged.device):
            # Three plain fp32 operations (no fused multiply-add), so that every path rounds the same way.
            torch.mul(averaged[piece], averaged[piece], out=new[piece])
            new[piece].mul_(1.0 - self.scale_beta).add_(old[piece] * self.scale_beta)
            total += float(new[piece].sum())  # = row_sum(new), while the piece is in cache
        self.squares.stage(key, slots, new, total)

    def buffer(self, kind, key: tuple, length: int, device) -> torch.Tensor:
        """A `[length]` fp32 work buffer kept from step to step (a fresh multi-megabyte one costs page faults)."""
        name = (kind, key)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != length or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(length, dtype=torch.float32, device=device)
        return buffer

    # --- steps ---
    def mark_nonfinite(self) -> None:
        """Flag the current optimizer step as not finite: `commit_step` then discards what it staged."""
        self._nonfinite = True
        self._warn_once(
            "nonfinite",
            f"GRPO compression: NaN/Inf gradients at optimizer step {self.step}; the step was sent dense and the "
            "error-feedback residuals and gradient scales were left unchanged (GRPOTrainer skips the optimizer step; "
            "later ones are counted in the totals' nonfinite_steps).",
        )

    def commit_step(self, dense: bool) -> None:
        """Close an optimizer step: commit the staged residuals and scales (unless it was not finite) and its stats."""
        nonfinite = self._nonfinite
        if not nonfinite and self.squares.staged:
            self.scale_updates += 1
        for store in (self.residuals, self.owner_residuals, self.squares):
            store.discard() if nonfinite else store.commit()
        self._nonfinite = False
        record = self._step.as_dict()
        record["dense"] = dense or nonfinite
        self._step = StepStats()
        self.step += 1
        for key in StepStats.KEYS:
            self._window[key] += record[key]
            self._totals[key] += record[key]
        self._window["steps"] += 1
        self._window["dense_steps"] += int(record["dense"])
        self._totals["steps"] += 1
        self._totals["dense_steps"] += int(record["dense"])
        self._totals["nonfinite_steps"] += int(nonfinite)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # --- statistics ---
    def pop_stats(self) -> dict[str, float]:
        """
        Metrics of the optimizer steps since the last call (then cleared); `{}` when there were none.

        `grpo/comm/bytes_sent`, `grpo/comm/bytes_dense_fp32`, `grpo/comm/bytes_dense_fp16` (per rank and optimizer
        step, averaged), `grpo/comm/ratio_fp32`, `grpo/comm/ratio_fp16` (dense bytes / bytes sent; left out when
        nothing was sent, e.g. world size 1), `grpo/density` (kept fraction of all trainable entries), `grpo/sparsity`
        (`1 - density`), `grpo/comm/hook_ms` (time in the hook per step) and `grpo/comm/dense_steps` (warm-up and
        non-finite steps in the window).
        """
        window, self._window = self._window, _empty_window()
        if not window["steps"]:
            return {}
        return _metrics(window, window["steps"], window["dense_steps"], prefix=True)

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): `steps`, `dense_steps`, `nonfinite_steps`, `bytes_sent`, `bytes_dense_fp32`,
        `bytes_dense_fp16`, `ratio_fp32`, `ratio_fp16`, `density`, `hook_ms` (time in the hook), `comm_ms` (the part
        of it spent inside collectives, waiting for other ranks included), `kept`, `numel`.
        """
        totals = dict(self._totals)
        totals.update(_metrics(totals, max(1, totals["steps"]), totals["dense_steps"], prefix=False))
        for key in ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "hook_ms", "comm_ms"):
            totals[key] = self._totals[key]
        return totals

    # --- checkpointing ---
    def state_dict(self) -> dict:
        """This rank's residuals and the gradient scales (cpu fp32, keyed by parameter name), counters and totals."""
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "scale_updates": self.scale_updates,
            "hook_calls": self.hook_calls,
            "residuals": self.residuals.state_dict(),
            "owner_residuals": self.owner_residuals.state_dict(),
            "squares": self.squares.state_dict(),
            "totals": {key: float(v) for key, v in self._totals.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore [`state_dict`]; vectors move to their parameter's device on first use."""
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"compression state of version {state_dict.get('version')}, expected {STATE_VERSION}: it was written "
                "by another grpo_hf version; resume with that version or from a checkpoint written by this one."
            )
        if state_dict["mode"] != self.mode:
            raise ValueError(
                f"the checkpoint's compression ran in mode {state_dict['mode']!r}, this run in {self.mode!r}; resume "
                "with the same grpo_comm_mode (its residuals mean something else in the other mode)."
            )
        unknown = sorted(set(state_dict["residuals"]) - {n for n, s in self.plan.items() if s is not None})
        if unknown:
            raise ValueError(
                f"the checkpoint holds residuals for parameters this run does not compress (e.g. {unknown[0]}); "
                "resume with the same model, adapters and compression settings as the run that wrote it."
            )
        self.step = int(state_dict["step"])
        self.scale_updates = int(state_dict.get("scale_updates", 0))
        self.hook_calls = int(state_dict.get("hook_calls", 0))
        self.residuals.load_state_dict(state_dict["residuals"])
        self.owner_residuals.load_state_dict(state_dict.get("owner_residuals", {}))
        self.squares.load_state_dict(state_dict.get("squares", {}))
        self._nonfinite = False
        self._step = StepStats()
        self._window = _empty_window()
        totals = state_dict.get("totals", {})
        for key in self._totals:
            if key in totals:
                self._totals[key] = type(self._totals[key])(totals[key])

    def __getstate__(self):
        """Pickle without the process group (it cannot be pickled), as torch's `PowerSGDState` does."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in ("process_group", "_buffers")}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.process_group = None
        self._buffers = {}

    def __repr__(self) -> str:
        compressed = sum(1 for spec in self.plan.values() if spec is not None)
        return (
            f"GRPOCommState(mode={self.mode!r}, dense_warmup_steps={self.dense_warmup_steps}, "
            f"scale_gradients={self.scale_gradients}, compressed={compressed}/{len(self.plan)}, step={self.step}, "
            f"world_size={self.world_size})"
        )


__all__ = ["DEFAULT_SCALE_BETA", "GRPOCommState", "StepStats"]
