"""A compressed reduce-scatter for FSDP2 (`fully_shard`): [`FSDPCommState`] and [`GRPOReduceScatter`].

FSDP2 reduces each unit's gradients with one reduce-scatter per backward (with gradient sync) and lets a module replace
it ([`torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter`]). [`install_compressed_reduce_scatter`] puts a
[`GRPOReduceScatter`] on every FSDP2 unit of a model; one [`FSDPCommState`] holds the settings, the error-feedback
residuals and the traffic statistics of all of them.

Example:

```python
>>> from torch.distributed.fsdp import fully_shard
>>> from grpo_hf.compression.fsdp import FSDPCommState, install_compressed_reduce_scatter

>>> for layer in model.model.layers:
...     fully_shard(layer)
>>> fully_shard(model)
>>> state = FSDPCommState(bits=8, error_feedback="none")
>>> install_compressed_reduce_scatter(model, state)  # before the first backward (or `state.attach(model, model, opt)`)
>>> for batch in batches:
...     model(**batch).loss.backward()
...     optimizer.step()
...     optimizer.zero_grad()
...     state.end_step()  # `end_step(finite=False)` for a step whose update was skipped
```

## Algorithm (one unit, one backward)

FSDP hands the comm the unit's flat gradient `input` of `W * S` entries laid out rank by rank: chunk `j` (`S` entries,
padding included) is what rank `j` owns. On rank `r`:

1. The `W - 1` chunks it does not own are encoded: with error feedback, the residual of the chunk is added first and
   what the codec does not transmit becomes the new residual. The codec cuts a chunk into blocks of `block_size`
   entries, each sent as one fp32 absmax scale and `bits`-bit codes (`bits=32`: the fp32 values as they are).
2. One all-to-all of equal-sized byte messages ([`~grpo_hf.compression.exchange.Exchange.reduce_scatter`], through
   the state's [`~grpo_hf.compression.communicator.Communicator`], timed, an emulated slow link included): rank `r` receives the
   `W - 1` messages for its own chunk.
3. The owner decodes them and sums the `W` contributions in rank order, its own chunk exact (it never travels); with
   `op=AVG` (FSDP's default for fp32 and bf16 gradients) it divides by `W`, with `op=SUM` not (FSDP then divides by
   its `gradient_divide_factor` itself), exactly as the built-in reduce-scatter does. The sum is written into
   `output` in its dtype.

Every owner adds the same values in the same order in every run: a run is deterministic, and with `bits=32` it equals
the built-in reduce-scatter up to the order of the additions.

## Error feedback (`error_feedback`)

- `"none"`: no memory. The only contribution that reaches an owner exactly is its own; quantization errors of the
  others are dropped. Feedback on the owner side alone has nothing to correct in a one-phase reduce-scatter (the
  owner never re-encodes), so this is also what owner-side feedback amounts to here.
- `"worker-bf16"`: each rank keeps the residual of every chunk it sends, in bf16: `2 (W - 1) / W` bytes per gradient
  entry of the unit on every rank (FSDP2 keeps `16 / W` bytes per entry for fp32 weights, gradients and AdamW's
  moments: the residual does not shrink with `W`, so it undoes part of the sharding as `W` grows).
- `"worker-int8"`: the same residual stored as 8-bit blocks (codes and one fp32 scale per block): about half of it.

## Bytes per rank and backward (`grpo/comm/bytes_sent`)

`(W - 1) * m(S)` with `m(S) = ceil(S / B) * (4 + B * bits / 8)` (`bits=32`: `m(S) = 4 S`), against `(W - 1) * 4 S`
for the built-in fp32 reduce-scatter (ring model) and `(W - 1) * 2 S` for a 16-bit one (`bytes_dense_fp32` /
`bytes_dense_fp16`). Flat in `W` for a given model size, as the built-in reduce-scatter. FSDP's parameter all-gathers
are not counted: compression does not change them.

## Non-finite gradients

A chunk holding a NaN or an Inf reaches its owner as NaN (its blocks' scales are sent as NaN), as with the built-in
reduce-scatter: the owner's shard is not finite, and so is every rank's global gradient norm computed from all shards
(what [`~grpo_hf.GRPOTrainer`] uses to skip the step). The residuals staged for a step are committed by
[`FSDPCommState.end_step`] only when that step was finite on every rank.

## Warnings

- Call [`FSDPCommState.end_step`] once per optimizer step (after the backward of its last micro-batch): residuals are
  committed there and the dense warm-up counts those steps. `GRPOTrainer` does it.
- FSDP2 allows a custom reduce-scatter only on units with one parameter group (one mesh); it raises otherwise.
- Top-k (`grpo_density`) is not used here: top-k messages differ in size from rank to rank.
"""

import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from ..choices import DEFAULT_FSDP_ERROR_FEEDBACK, ERROR_FEEDBACK_CHOICES, SUPPORTED_BITS
from .codec import compile_kernels
from .codes import code_for
from .communicator import Communicator, ProcessGroupCommunicator
from .exchange import Exchange, decode_rows, encode_rows
from .settings import check_comm_settings
from .spec import DEFAULT_BLOCK_SIZE, CodecSpec
from .traffic import StepStats, TrafficStats, reduce_scatter_bytes
from .transport import FSDP_MODE, CommSettings, CommState, SavedComms


logger = logging.getLogger(__name__)

STATE_VERSION = 1
# The widths whose code sends rows of one size (one all-to-all needs equal sizes; 2-bit codes vary): 4, 8, 16 and 32
FSDP_BITS = tuple(bits for bits in SUPPORTED_BITS if code_for(CodecSpec(bits=bits)).fixed_size)


class _StagedResidual:
    """
    One unit's error feedback as [`~grpo_hf.compression.exchange.Exchange.reduce_scatter`] reads and writes it: the
    committed residual of its `W - 1` chunks (bf16, or 8-bit blocks), and the new one staged until [`FSDPCommState.end_step`].
    """

    __slots__ = ("state", "key", "numel")

    def __init__(self, state: "FSDPCommState", key: str, numel: int):
        self.state, self.key, self.numel = state, key, numel

    def read(self) -> torch.Tensor | None:
        stored = self.state.residuals.get(self.key)
        if stored is None:
            return None
        if self.state.error_feedback == "worker-int8":
            return decode_rows(self.state.kernels, self.state._residual_spec(), stored, self.numel)
        return stored.float()

    def write(self, values: torch.Tensor) -> None:
        if self.state.error_feedback == "worker-int8":
            stored = encode_rows(self.state.kernels, self.state._residual_spec(), values)[0].clone()
        else:
            stored = values.to(torch.bfloat16)
        self.state._staged[self.key] = stored


# ----------------------------------------------------------------------------------------------------------------
# The state
# ----------------------------------------------------------------------------------------------------------------


class FSDPCommState(CommState):
    r"""
    Settings, error-feedback residuals and traffic statistics of [`GRPOReduceScatter`] (see the module docstring for
    the algorithm, the bytes and the warnings).

    Args:
        bits (`int`, *optional*, defaults to `8`):
            Bits per sent gradient entry: `4`, `8` (symmetric codes, one fp32 absmax per block),
            `16` (fp16 after a power-of-two shift per block) or `32` (fp32: lossless, for checks).
        error_feedback (`str`, *optional*, defaults to `"none"`):
            `"none"`, `"worker-bf16"` or `"worker-int8"` (where the quantization error of the sent chunks is kept).
        dense_warmup_steps (`int`, *optional*, defaults to `0`):
            Optimizer steps sent as fp32 before compression starts.
        block_size (`int`, *optional*, defaults to `128`):
            Entries per scale.
        compile_codec (`bool`, *optional*):
            Run the codec's kernels compiled by `torch.compile` (`True`) or eagerly (`False`). `None` (default):
            compiled unless the environment variable `GRPO_HF_COMPILE_CODEC=0` is set.
        communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*):
            The way to the wire of every reduce-scatter (over the group FSDP2 hands it: the same ranks in the same
            order). `None`: a [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`] over the group FSDP2
            hands each call, one per group, kept.
    """

    __slots__ = (
        # --- tuned ---
        "bits",
        "error_feedback",
        "dense_warmup_steps",
        # --- seldom tuned ---
        "block_size",
        "compile_codec",
        # --- internal state (checkpointed) ---
        "mode",
        "world_size",
        "rank",
        "residuals",
        "step",
        "hook_calls",
        # --- per step ---
        "kernels",
        "_staged",
        "_nonfinite",
        "stats",
        "communicator",
        "_communicators",
        # --- statistics ---
        "traffic",
        "_logged",
    )
    nonfinite_origin = (
        "They were NaN/Inf as the backward pass and FSDP2's compressed reduce-scatter delivered them (its residuals "
        "stay unchanged for such a step)"
    )

    def __init__(
        self,
        bits: int = 8,
        error_feedback: str = DEFAULT_FSDP_ERROR_FEEDBACK,
        dense_warmup_steps: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        compile_codec: bool | None = None,
        communicator: Communicator | None = None,
    ):
        if isinstance(bits, bool) or bits not in FSDP_BITS:
            raise ValueError(
                f"bits={bits!r}: FSDP2's compressed reduce-scatter sends {FSDP_BITS} bits per entry (its all-to-all "
                "needs messages of one size; 2-bit codes vary); use grpo_bits=8 (the default) or 4."
            )
        check_comm_settings(error_feedback=error_feedback, dense_warmup_steps=dense_warmup_steps)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size}: use a power of two, e.g. 128.")
        self.bits, self.error_feedback = int(bits), error_feedback
        self.dense_warmup_steps, self.block_size = int(dense_warmup_steps), int(block_size)
        self.compile_codec = compile_codec
        self.mode = FSDP_MODE
        self.world_size, self.rank = 1, 0
        self.kernels = None  # made at the first reduce-scatter (see `compile_codec`)
        self.residuals: dict[str, torch.Tensor] = {}  # "<unit>:<flat size>" -> this rank's residual of its W-1 chunks
        self.step = 0
        self.hook_calls = 0
        self._staged: dict[str, torch.Tensor] = {}
        self._nonfinite = False
        self.stats = StepStats()  # traffic of the current step
        self.communicator = communicator
        self._communicators: dict = {}  # without a communicator: FSDP2's group -> its ProcessGroupCommunicator
        # every entry is sent: no kept entries are counted and the density is 1
        sums = tuple(key for key in StepStats.KEYS if key != "kept")
        self.traffic = TrafficStats(counters=("dense_steps",), run_counters=("nonfinite_steps",), sums=sums)
        self._logged = False

    # --- building ---
    @classmethod
    def from_settings(cls, settings: CommSettings) -> "FSDPCommState | None":
        """FSDP2's compressed reduce-scatter when FSDP2 reduces the gradients at every step with compression on (the
        settings it cannot carry were refused where they were made: the reduce-scatter's codes of one size)."""
        if settings.syncing or settings.compression == "none" or settings.engine != "fsdp2":
            return None
        codec = settings.transport.codec
        return cls(
            bits=int(codec.bits),
            error_feedback=codec.error_feedback,
            dense_warmup_steps=codec.dense_warmup_steps,
            communicator=settings.communicator,
        )

    @property
    def warming_up(self) -> bool:
        return self.step < self.dense_warmup_steps

    def residual_nbytes(self) -> int:
        """Bytes this rank holds in error-feedback residuals (committed ones; a step's staged ones double it briefly)."""
        return sum(t.numel() * t.element_size() for t in self.residuals.values())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this state holds: `residuals` (committed)."""
        return {"residuals": self.residual_nbytes()}

    @property
    def _lossless(self) -> bool:
        """Whether every step sends the fp32 values as they are (`bits=32`): dense, without error feedback."""
        return CodecSpec(bits=self.bits, block_size=self.block_size).lossless

    def _residual_spec(self) -> CodecSpec:
        return CodecSpec(bits=8, block_size=self.block_size)  # "worker-int8": the residual as 8-bit blocks

    # --- the reduce-scatter ---
    def communicator_for(self, group) -> Communicator:
        """The communicator of a reduce-scatter over `group` (the one given, or `group`'s own, made once)."""
        if self.communicator is not None:
            return self.communicator
        held = self._communicators.get(group)
        if held is None:
            held = self._communicators[group] = ProcessGroupCommunicator(group)
        return held

    def reduce_scatter(self, unit: str, output: torch.Tensor, input: torch.Tensor, group, op) -> None:
        """
        The compressed reduce-scatter of one unit's flat gradient (see the module docstring).

        Args:
            unit (`str`): the unit's name (its residuals are kept under `"<unit>:<input size>"`).
            output (`torch.Tensor`): this rank's chunk of the result, `S` entries (FSDP's reduce-scatter output).
            input (`torch.Tensor`): the unit's flat gradient, `W * S` entries laid out rank by rank.
            group (`torch.distributed.ProcessGroup`): the FSDP shard group.
            op (`torch.distributed.ReduceOp`): `AVG` (the sum divided by `W`) or `SUM`.

        Raises:
            `ValueError`: another reduce op (a pre-multiplied sum), or sizes that do not split over the group.
        """
        start = time.perf_counter()
        comm = self.communicator_for(group)
        world_size, rank = comm.world_size, comm.rank
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"GRPO's FSDP2 reduce-scatter supports op SUM and AVG, got {op}: FSDP passes a pre-multiplied sum when "
                "a gradient_divide_factor other than the world size is set. Call "
                "`module.set_force_sum_reduction_for_comms(True)` on the FSDP modules so that FSDP divides afterwards."
            )
        numel = input.numel() // world_size
        if numel * world_size != input.numel() or output.numel() != numel:
            raise ValueError(f"reduce-scatter of {input.numel()} entries into {output.numel()} on {world_size} ranks.")
        self._log_once(world_size, rank)
        if self.kernels is None:
            wanted = self.compile_codec
            self.kernels = compile_kernels(
                os.environ.get("GRPO_HF_COMPILE_CODEC", "1") != "0" if wanted is None else wanted
            )
        dense = self.warming_up or self._lossless
        spec = CodecSpec(bits=32 if dense else self.bits, block_size=self.block_size)
        feedback = self.error_feedback != "none" and not dense
        residual = _StagedResidual(self, f"{unit}:{input.numel()}", numel) if feedback else None
        stats = self.stats
        exchange = Exchange(self.kernels, comm, stats)
        total, finite = exchange.reduce_scatter(input.view(world_size, numel), spec, residual, op == dist.ReduceOp.AVG)
        self._nonfinite |= not finite
        output.copy_(total.view_as(output))
        self.hook_calls += 1
        stats.comm_ms += comm.pop_comm_ms()  # done: nothing of it is left under way
        stats.bytes_dense_fp32 += reduce_scatter_bytes(4 * input.numel(), world_size)
        stats.bytes_dense_fp16 += reduce_scatter_bytes(2 * input.numel(), world_size)
        stats.numel += input.numel()
        stats.hook_ms += (time.perf_counter() - start) * 1000

    def _log_once(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        if not self._logged:
            self._logged = True
            logger.info(
                "GRPO FSDP2 compressed reduce-scatter: %d bits, blocks of %d, error feedback %s, dense warm-up %d "
                "steps, world size %d.",
                self.bits,
                self.block_size,
                self.error_feedback,
                self.dense_warmup_steps,
                world_size,
            )

    # --- the transports' protocol ---
    def attach(self, wrapped: nn.Module, model: nn.Module, optimizer) -> None:
        """Give every FSDP2 unit of `wrapped` this state's reduce-scatter ([`install_compressed_reduce_scatter`])."""
        install_compressed_reduce_scatter(wrapped, self)

    def end_step(self, finite: bool = True, last: bool = False) -> float:
        """
        Close an optimizer step: commit the residuals staged by its reduce-scatters when the step was finite on every
        rank (`finite`) and on this one, drop them otherwise, and add the step to the statistics. Returns the bytes
        this rank sent in the step.
        """
        nonfinite = self._nonfinite or not finite
        if not nonfinite:
            self.residuals.update(self._staged)
        self._staged = {}
        dense = self.warming_up or nonfinite or self._lossless
        self._nonfinite = False
        record, self.stats = self.stats, StepStats()
        self.traffic.close_step(record, dense_steps=dense, nonfinite_steps=nonfinite)
        self.step += 1
        return record.bytes_sent

    def resumes(self, mode: str | None) -> bool:
        return mode is None or mode == FSDP_MODE

    def restore(self, saved: SavedComms) -> None:
        """
        This rank's own state when the checkpoint was written by as many ranks; otherwise its residuals are dropped
        with a warning (their chunks are laid out per world size: they cannot be re-split as the DDP hook's can),
        keeping the counters.
        """
        comms = saved.comms
        if len(comms) == 1 and comms[0] is not None:
            self.load_state_dict(comms[0])
            return
        if comms[0] is not None:
            self.load_state_dict(comms[0], residuals=False)
        if any(comm is not None for comm in comms):
            saved.warn(
                f"{saved.folder} was written by {saved.saved_world_size} rank(s) with compression mode {saved.mode!r} "
                f"and is resumed by {saved.world_size} in mode {self.mode!r}: the error-feedback residuals are dropped "
                "(the FSDP2 reduce-scatter lays them out per world size). Resume with the same world size and "
                "compression to keep them."
            )

    # --- statistics ---
    def pop_stats(self) -> dict[str, float]:
        """
        Metrics of the optimizer steps since the last call (then cleared; `{}` when there were none), per rank and
        step: `grpo/comm/bytes_sent`, `grpo/comm/bytes_dense_fp32`, `grpo/comm/bytes_dense_fp16`,
        `grpo/comm/ratio_fp32`, `grpo/comm/ratio_fp16`, `grpo/density` (1), `grpo/sparsity` (0), `grpo/comm/hook_ms`,
        `grpo/comm/dense_steps`.
        """
        return self.traffic.pop_stats()

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): the summed traffic (`kept` left out; the reduce-scatters of the
        step not yet closed by [`end_step`] included), `steps`, `dense_steps`, `nonfinite_steps`, ratios.
        """
        return self.traffic.totals(open_step=self.stats)

    # --- checkpointing ---
    def state_dict(self) -> dict:
        """This rank's residuals (cpu), counters and totals."""
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "bits": self.bits,
            "error_feedback": self.error_feedback,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "hook_calls": self.hook_calls,
            "residuals": {key: t.detach().cpu().clone() for key, t in self.residuals.items()},
            "totals": self.traffic.state_dict(),
        }

    def load_state_dict(self, state_dict: dict, residuals: bool = True) -> None:
        """
        Restore [`state_dict`] (`residuals=False`: the counters and totals only, e.g. after a change of world size,
        where the residuals' chunks mean other entries). Residuals move to the gradients' device on first use.
        """
        if state_dict.get("version") != STATE_VERSION or state_dict.get("mode") != FSDP_MODE:
            raise ValueError(
                f"the checkpoint's compression state is not an FSDP2 reduce-scatter state of version {STATE_VERSION} "
                f"(mode {state_dict.get('mode')!r}): resume with the engine and grpo_hf version that wrote it."
            )
        if residuals and state_dict["error_feedback"] != self.error_feedback:
            raise ValueError(
                f"the checkpoint's error feedback is {state_dict['error_feedback']!r}, this run's "
                f"{self.error_feedback!r}: resume with the same grpo_fsdp_error_feedback."
            )
        self.step = int(state_dict["step"])
        self.hook_calls = int(state_dict["hook_calls"])
        self.residuals = dict(state_dict["residuals"]) if residuals else {}
        self._staged, self._nonfinite = {}, False
        self.stats = StepStats()
        self.traffic.load_state_dict(state_dict.get("totals", {}))

    def __getstate__(self):
        """Pickled without the communicators made for FSDP2's groups (they belong to this process)."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "_communicators"}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self._communicators = {}

    def __repr__(self) -> str:
        return (
            f"FSDPCommState(bits={self.bits}, error_feedback={self.error_feedback!r}, "
            f"dense_warmup_steps={self.dense_warmup_steps}, step={self.step}, units={len(self.residuals)})"
        )


# ----------------------------------------------------------------------------------------------------------------
# The comm object FSDP2 calls, and its installation
# ----------------------------------------------------------------------------------------------------------------


class GRPOReduceScatter:
    """
    The custom reduce-scatter of one FSDP2 unit: the interface of torch's `ReduceScatter` comm (`allocate`, and a call
    with `output_tensor, input_tensor, group, op, async_op`), backed by [`FSDPCommState.reduce_scatter`].
    """

    def __init__(self, state: FSDPCommState, unit: str):
        self.state, self.unit = state, unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.state.reduce_scatter(self.unit, output_tensor, input_tensor, group, op)
        return None  # done synchronously: FSDP waits on nothing


def fsdp_units(model: nn.Module) -> dict[str, nn.Module]:
    """The FSDP2 units of `model` (modules `fully_shard` was applied to), by module name (`""` for the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return {}
    return {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}


def install_compressed_reduce_scatter(model: nn.Module, state: FSDPCommState) -> int:
    """
    Give every FSDP2 unit of `model` a [`GRPOReduceScatter`] bound to `state`; returns how many units got one.

    Raises:
        `ValueError`: `model` holds no FSDP2 unit, or this torch lacks `set_custom_reduce_scatter`.
    """
    units = fsdp_units(model)
    if not units:
        raise ValueError("the model has no FSDP2 unit: apply `torch.distributed.fsdp.fully_shard` to it first.")
    for name, module in units.items():
        if not hasattr(module, "set_custom_reduce_scatter"):
            raise ValueError(
                "this torch has no FSDPModule.set_custom_reduce_scatter (torch 2.13 has it): upgrade torch, or train "
                "FSDP2 without gradient compression (grpo_compression='none')."
            )
        module.set_custom_reduce_scatter(GRPOReduceScatter(state, name or "<root>"))
    return len(units)


__all__ = [
    "DEFAULT_FSDP_ERROR_FEEDBACK",
    "ERROR_FEEDBACK_CHOICES",
    "FSDP_MODE",
    "FSDPCommState",
    "GRPOReduceScatter",
    "fsdp_units",
    "install_compressed_reduce_scatter",
    "reduce_scatter_bytes",
]
