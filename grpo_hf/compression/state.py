"""`GRPOCommState`: the settings, error-feedback residuals and traffic statistics of DDP's compressed exchange at every step (the transport of [`~grpo_hf.compression.grpo_comm_hook`], and of
[`~grpo_hf.compression.compress_locally`] on one process)."""

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from ..choices import MODES, SCALES_REMOVED
from ..errors import CheckpointError, warn_once
from .codec import Kernels, compile_kernels
from .communicator import Communicator, ProcessGroupCommunicator
from .hook import compress_locally, grpo_comm_hook
from .layout import BucketLayout, bucket_layout
from .plan import resolve_mode
from .reshard import STATE_VERSION, reshard_comm_state
from .row_store import RESIDUAL_DTYPE, RowStore
from .settings import check_comm_settings
from .spec import CodecSpec
from .traffic import StepStats, TrafficStats
from .transport import CommSettings, CommState, SavedComms, world_size_message


logger = logging.getLogger(__name__)


class GRPOCommState(CommState):
    r"""
    Settings, error-feedback residuals and traffic statistics of [`~grpo_hf.compression.grpo_comm_hook`] and
    [`~grpo_hf.compression.compress_locally`].

    Example:

    ```python
    >>> from grpo_hf.compression import GRPOCommState, compression_plan, grpo_comm_hook

    >>> state = GRPOCommState(compression_plan(model))  # GRPOConfig's defaults
    >>> state.bind(model)  # names, world size, the codec's kernels compiled
    >>> ddp_model.register_comm_hook(state, grpo_comm_hook)
    ```

    ([`attach`] does both, as the transports' protocol, [`~grpo_hf.compression.transport.CommState`], asks.)

    Args:
        plan (`dict[str, CodecSpec | None]`):
            Parameter name -> how it is sent (`None`: dense), as [`~grpo_hf.compression.compression_plan`] decides it.
            Parameters missing from it are sent dense (with a warning).
        mode (`str`, *optional*, defaults to `"allgather"`):
            `"allgather"` (every rank's message to every rank: per-rank bytes grow as `W - 1`) or `"allreduce"`
            (compressed reduce-scatter with error feedback on the owners, then an all-gather: flat in `W`).
        dense_warmup_steps (`int`, *optional*, defaults to `2`):
            Optimizer steps sent dense before compression starts (DDP rebuilds its buckets after the first step).
        simulated_world_size (`int`, *optional*, defaults to `2`):
            World size used by [`~grpo_hf.compression.compress_locally`] to count the bytes one worker would send.
        process_group (`torch.distributed.ProcessGroup`, *optional*):
            Group to communicate in; the default group when `None`. A convenience for
            `communicator=ProcessGroupCommunicator(process_group)`.
        compile_codec (`bool`, *optional*):
            Run the codec's kernels compiled by `torch.compile` (`True`) or eagerly (`False`). `None` (default):
            compiled when `bind` finds more than one rank, unless the environment variable `GRPO_HF_COMPILE_CODEC=0`
            is set. Without a working compiler the eager functions run (logged once); under `torch.distributed` the
            ranks agree on one choice.
        communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*):
            The way to the wire: every collective of the hook goes through it. `None`: a
            [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`] over `process_group` (give one or the other).
    """

    __slots__ = (
        # --- tuned ---
        "plan",
        "mode",
        "dense_warmup_steps",
        # --- seldom tuned ---
        "simulated_world_size",
        "communicator",
        "compile_codec",
        # --- bound by bind() ---
        "names",
        "world_size",
        "rank",
        "kernels",
        "compile_seconds",
        "hooked",
        # --- internal state (checkpointed) ---
        "residuals",
        "owner_residuals",
        "step",
        # --- per step ---
        "pending",
        "stats",
        "nonfinite",
        "last_step",
        "step_bytes",
        "layouts",
        "bucket_starts",
        "workspace",
        # --- statistics ---
        "hook_calls",
        "traffic",
        "_warned",
    )

    def __init__(
        self,
        plan: dict[str, CodecSpec | None],
        mode: str = "allgather",
        dense_warmup_steps: int = 2,
        simulated_world_size: int = 2,
        process_group: dist.ProcessGroup | None = None,
        compile_codec: bool | None = None,
        communicator: Communicator | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES} (`compression_plan` resolves 'auto').")
        check_comm_settings(dense_warmup_steps=dense_warmup_steps)
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
        self.simulated_world_size = int(simulated_world_size)
        if communicator is not None and process_group is not None:
            raise ValueError("give a communicator or a process_group, not both (the communicator holds its group).")
        self.communicator = communicator if communicator is not None else ProcessGroupCommunicator(process_group)
        self.compile_codec = compile_codec
        self.names: dict[int, str] = {}
        self.world_size, self.rank = 1, 0
        self.kernels: Kernels | None = None
        self.compile_seconds = 0.0
        self.hooked = False  # a DDP comm hook is registered (else `after_backward` compresses on one process)
        self.residuals = RowStore(RESIDUAL_DTYPE)  # this rank's error feedback, per parameter
        self.owner_residuals = RowStore(RESIDUAL_DTYPE)  # all-reduce mode: the error feedback of the owned chunks
        self.step = 0
        self.pending: list = []  # the current step's buckets, waiting for the last one (see grpo_comm_hook)
        self.stats = StepStats()  # traffic of the current step
        self.nonfinite = False
        self.last_step = "none"  # how the last closed step was sent: see commit_step
        self.step_bytes = 0.0  # bytes of the steps closed since the last `end_step`
        self.layouts: dict[tuple, BucketLayout] = {}  # bucket (names, sizes, offsets) -> its layout
        self.bucket_starts: dict[tuple, list[int]] = {}  # bucket (names, sizes) -> each gradient's offset in it
        self.workspace: dict[tuple, torch.Tensor] = {}  # reusable work buffers (at most one bucket's size each)
        self.hook_calls = 0
        self.traffic = TrafficStats(counters=("dense_steps",), run_counters=("nonfinite_steps",))
        self._warned: set[str] = set()

    @classmethod
    def from_settings(cls, settings: CommSettings) -> "GRPOCommState | None":
        """
        DDP's compressed exchange at every step (on one process its preview, [`compress_locally`]) when the ranks do
        not sync every H steps, something is compressed, and FSDP2 does not reduce the gradients; else `None`.
        """
        if settings.syncing or settings.compression == "none" or settings.engine == "fsdp2":
            return None
        codec = settings.transport.codec
        return cls(
            settings.plan,
            mode=resolve_mode(codec.mode, settings.num_processes),
            dense_warmup_steps=codec.dense_warmup_steps,
            communicator=settings.communicator,
        )

    @property
    def process_group(self):
        """The `torch.distributed` group of a [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`]
        (`None`: the default group, or a communicator of another kind)."""
        return getattr(self.communicator, "group", None)

    def spec_for(self, name: str | None) -> CodecSpec | None:
        """The codec spec a parameter is sent with, `None` when dense."""
        return self.plan.get(name) if name is not None else None

    # --- setup ---
    def bind(self, model: nn.Module) -> "GRPOCommState":
        """
        Map the model's trainable parameters (by `id`) to their names, read the world size and rank from the
        communicator (1 / 0 when `torch.distributed` is not initialized) and make the codec's kernels ready: compiled (the
        one-off compile time is logged; later runs reuse inductor's cache) or eager, the same choice on every rank (an
        all-reduce when there are several). Pass the unwrapped model (a DDP wrapper is unwrapped).
        """
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.world_size, self.rank = self.communicator.world_size, self.communicator.rank
        missing = sorted(set(self.names.values()) - set(self.plan))
        if missing:
            self.warn_once(
                "missing",
                f"{len(missing)} trainable parameters have no compression setting and are sent dense (e.g. "
                f"{missing[0]}). Build the plan with grpo_hf.compression.compression_plan on the same model.",
            )
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        compressed = [n for n in params if self.spec_for(n) is not None]
        self._make_kernels(params, compressed)
        logger.info(
            "GRPO gradient compression: mode=%s, world size %d, %d of %d trainable tensors (%d of %d entries) "
            "compressed, dense warm-up %d steps, codec %s.",
            self.mode,
            self.world_size,
            len(compressed),
            len(params),
            sum(params[n].numel() for n in compressed),
            sum(p.numel() for p in params.values()),
            self.dense_warmup_steps,
            "compiled" if self.kernels.compiled else "eager",
        )
        return self

    def _make_kernels(self, params: dict, compressed: list[str]) -> None:
        if self.kernels is not None:
            return
        wanted = self.compile_codec
        if wanted is None:  # auto: compiled under torch.distributed, unless the environment says otherwise
            wanted = self.world_size > 1 and os.environ.get("GRPO_HF_COMPILE_CODEC", "1") != "0"
        kernels = compile_kernels(bool(wanted))
        if kernels.compiled and compressed:
            first = params[compressed[0]]
            specs = {self.plan[n] for n in compressed}
            try:
                self.compile_seconds = kernels.warm_up(specs, first.dtype, self.world_size, first.device)
            except Exception:  # `Kernels` has already fallen back to eager (and said so)
                pass
            if kernels.compiled:
                logger.info("GRPO compression: codec kernels compiled in %.1f s (one-off).", self.compile_seconds)
        if self.world_size > 1:
            flag = torch.tensor([int(kernels.compiled)], dtype=torch.int64, device=self.communicator.device)
            self.communicator.all_reduce(flag, op=dist.ReduceOp.MIN)
            self.communicator.pop_comm_ms()  # setup, not a step's communication
            if kernels.compiled and not bool(flag.item()):
                kernels = compile_kernels(False)
                self.warn_once("eager", "GRPO compression: another rank cannot compile the codec; all run it eagerly.")
        self.kernels = kernels

    @property
    def warming_up(self) -> bool:
        return self.step < self.dense_warmup_steps

    def layout(self, names: list[str | None], numels: list[int], starts: list[int]) -> BucketLayout:
        """The runs and dense tensors of a bucket (cached per layout: DDP keeps its buckets)."""
        key = (tuple(names), tuple(numels), tuple(starts))
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = bucket_layout(names, numels, starts, [self.spec_for(n) for n in names])
        return layout

    def buffer(self, kind, length: int, device, dtype=torch.float32) -> torch.Tensor:
        """A `[length]` work buffer of `kind` kept from step to step (fresh multi-megabyte ones cost page faults)."""
        key = (kind, device, dtype)
        held = self.workspace.get(key)
        if held is None or held.numel() < length:
            held = self.workspace[key] = torch.empty(length, dtype=dtype, device=device)
        return held[:length]

    # --- the transports' protocol ---
    def attach(self, wrapped: nn.Module, model: nn.Module, optimizer) -> None:
        """
        [`bind`] `model`, and register [`~grpo_hf.compression.grpo_comm_hook`] on `wrapped` when it is the DDP model
        (on one process [`after_backward`] compresses instead); the optimizer is not read.
        """
        self.bind(model)
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(self, grpo_comm_hook)
            self.hooked = True

    def count_bytes_for(self, world_size: int) -> None:
        """[`~grpo_hf.compression.compress_locally`] counts the bytes one of `world_size` workers would send."""
        self.simulated_world_size = int(world_size)

    def after_backward(self, model: nn.Module) -> None:
        """Without a DDP hook (one process): the article's sparse updates, [`~grpo_hf.compression.compress_locally`]."""
        if not self.hooked:
            compress_locally(self, model)

    def end_step(self, finite: bool = True, last: bool = False) -> float:
        """The bytes of the step the hook closed (at its last bucket); nothing else is left to do."""
        sent, self.step_bytes = self.step_bytes, 0.0
        return sent

    def resumes(self, mode: str | None) -> bool:
        return mode is None or mode in MODES

    def restore(self, saved: SavedComms) -> None:
        """This rank's state, or every saved rank's residuals re-split for this world size and mode (a warning says so)."""
        comms = saved.comms
        if any(comm is not None and comm.get("squares") for comm in comms):  # written by a run with gradient scales
            raise CheckpointError(
                f"the checkpoint's compression state keeps gradient scales (grpo_scale_gradients=True): {SCALES_REMOVED} "
                "Resume it with the grpo_hf version that wrote it, or start a new run from the checkpoint's model."
            )
        if any(comm is not None for comm in comms):
            if len(comms) == 1:
                self.load_state_dict(comms[0])
            else:
                self.load_state_dict(
                    reshard_comm_state(comms, saved.numels, self.plan, self.mode, saved.world_size, saved.rank)
                )
        if len(comms) > 1:
            saved.warn(world_size_message(saved, self.mode))

    # --- steps ---
    def mark_nonfinite(self) -> None:
        """Flag the current optimizer step as not finite (it was sent dense and raw; nothing was updated)."""
        self.nonfinite = True
        self.warn_once(
            "nonfinite",
            f"GRPO compression: NaN/Inf gradients at optimizer step {self.step}; the step was sent dense and the "
            "error-feedback residuals were left unchanged (GRPOTrainer skips the optimizer step; later ones are "
            "counted in the totals' nonfinite_steps).",
        )

    def commit_step(self, dense: bool, compressed: bool = False) -> None:
        """
        Close an optimizer step: count its statistics. `last_step` then says how it was sent:
        `"nonfinite"` (a NaN/Inf, or a magnitude of `SAFE_MAGNITUDE` or more, in some rank's gradients: sent dense and
        raw), `"compressed"` (finite input went through the codec) or `"dense"` (warm-up, or nothing to compress).
        """
        nonfinite = self.nonfinite
        self.last_step = "nonfinite" if nonfinite else "compressed" if compressed else "dense"
        self.nonfinite = False
        self.stats.comm_ms += self.communicator.pop_comm_ms()
        self.traffic.close_step(self.stats, dense_steps=dense or nonfinite, nonfinite_steps=nonfinite)
        self.step_bytes += self.stats.bytes_sent
        self.stats = StepStats()
        self.step += 1

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time `key` is seen by this state."""
        warn_once(logger, self._warned, key, message)

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
        return self.traffic.pop_stats()

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): `steps`, `dense_steps`, `nonfinite_steps`, `bytes_sent`,
        `bytes_dense_fp32`, `bytes_dense_fp16`, `ratio_fp32`, `ratio_fp16`, `density`, `hook_ms` (time in the hook),
        `comm_ms` (the part of it spent inside collectives, waiting for other ranks included), `kept`, `numel`.
        """
        return self.traffic.totals()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this state holds: `residuals`, `owner_residuals` and `workspace`."""
        return {
            "residuals": self.residuals.nbytes(),
            "owner_residuals": self.owner_residuals.nbytes(),
            "workspace": sum(t.numel() * t.element_size() for t in self.workspace.values()),
        }

    # --- checkpointing ---
    def state_dict(self) -> dict:
        """
        This rank's residuals (bf16), keyed by parameter name, on cpu; counters and totals.
        """
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "hook_calls": self.hook_calls,
            "residuals": self.residuals.state_dict(),
            "owner_residuals": self.owner_residuals.state_dict(),
            "totals": self.traffic.state_dict(),
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
        self.hook_calls = int(state_dict.get("hook_calls", 0))
        self.residuals.load_state_dict(state_dict["residuals"])
        self.owner_residuals.load_state_dict(state_dict.get("owner_residuals", {}))
        self.nonfinite = False
        self.last_step = "none"
        self.step_bytes = 0.0
        self.pending = []
        self.stats = StepStats()
        self.traffic.load_state_dict(state_dict.get("totals", {}))

    def __getstate__(self):
        """
        Pickle without the communicator and the kernels, as torch's `PowerSGDState` does without its process group
        (the copy communicates over the default group: bind it again before using it).
        """
        dropped = ("communicator", "workspace", "kernels", "pending", "bucket_starts")
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in dropped}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.kernels = None
        self.communicator = ProcessGroupCommunicator()
        self.workspace, self.pending, self.bucket_starts = {}, [], {}

    def __repr__(self) -> str:
        compressed = sum(1 for spec in self.plan.values() if spec is not None)
        return (
            f"GRPOCommState(mode={self.mode!r}, dense_warmup_steps={self.dense_warmup_steps}, "
            f"compressed={compressed}/{len(self.plan)}, step={self.step}, world_size={self.world_size})"
        )


__all__ = ["RESIDUAL_DTYPE", "STATE_VERSION", "GRPOCommState"]
