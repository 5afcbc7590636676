"""
DDP communication hook for grouped sparse + quantized gradients with error feedback, and its single-process twin.

[`grpo_comm_hook`] replaces DDP's dense all-reduce. Each trainable parameter is sent with its own `(density, bits)`
(from [`~grpo_hf.grouping.resolve_compression`]); what it does not send is kept in a per-parameter **residual**
(error feedback) and added to the next step's gradient. [`GRPOCommState`] holds the settings, the residuals (keyed by
parameter name) and the traffic statistics. [`compress_locally`] applies the same codec to `p.grad` in a single
process (the article's "sparse updates") and counts what one worker *would* send.

Example:

```python
>>> from grpo_hf.compression import GRPOCommState, grpo_comm_hook

>>> state = GRPOCommState({"w": (0.15, 4), "b": (1.0, 32)}, mode="allreduce")
>>> state.bind(model)  # the unwrapped model: parameter ids -> names, world size and rank
>>> ddp_model.register_comm_hook(state, grpo_comm_hook)
>>> ...  # train; every logging step:
>>> state.pop_stats()["grpo/comm/ratio_fp32"]
```

## Algorithm (per bucket, per optimizer step)

1. **Warm-up.** During the first `dense_warmup_steps` optimizer steps the bucket is all-reduced dense (as DDP would)
   and counted as dense bytes. A bucket whose parameters are all dense (density 1 and 32 bits: norms, biases, tensors
   below `grpo_min_compress_numel`) is always sent that way.
2. **Error feedback.** For every compressed parameter `acc = grad + residual` (fp32, whatever the bucket dtype:
   fp16/bf16 buckets are computed in fp32 and cast back).
3. **Non-finite check.** Each rank flags a NaN/Inf in its bucket; the flags travel inside a collective every rank
   joins anyway (the size all-gather, or the fp32 all-reduce), so all ranks agree. If any rank raised it, the raw bucket is all-reduced dense (an fp16 `GradScaler` then
   sees the Inf and skips the step), the residuals of the *whole step* are left unchanged, the step is counted in
   `grpo/comm/dense_steps` and a warning is logged once.
4. **Exchange**, by `mode`:

   - `"allgather"` (top-k chosen by every rank for itself):
     1. each rank compresses `acc` of each parameter with [`~grpo_hf.compression.codec.compress_with_feedback`]
        (top-k + quantization, compact index encoding) and packs the messages of the bucket into one `uint8` buffer;
     2. `all_gather` of `[payload size, non-finite flag]` (`int64`), then `all_gather` of the payloads padded to the
        largest one (gloo needs equal sizes);
     3. every rank decodes the `W` payloads **in rank order** and sums them, so all ranks get bit-identical results;
        the dense parameters of the bucket go through one fp32 all-reduce.
   - `"allreduce"` (ScaleCom-style cyclic leader; per-rank traffic flat in `W`):
     1. at step `t` the leader `t mod W` takes the top-k positions of its own `acc` of each sparse parameter and
        broadcasts them (a small `int64` table of schemes and sizes, then the compact index bytes);
     2. every rank takes its values of `acc` at those positions. 32-bit values, the dense parameters and the
        non-finite flags are summed by one fp32 all-reduce;
     3. 4/8/16-bit values go through a **compressed reduce-scatter + all-gather**: each parameter's values are cut
        into `W` block-aligned chunks, each chunk is quantized on its own ([`~grpo_hf.compression.codec.quantize`]),
        `all_to_all_single` sends chunk `j` to its owner, rank `(j + crc32(name)) mod W` (so that small tensors do
        not all load rank 0), which dequantizes the `W` contributions, sums them in rank order and requantizes the
        mean; a second `all_to_all_single` hands every owner's chunks to every rank (an all-gather of uneven
        sizes, which gloo's `all_gather` refuses; no padding). The requantization error of a chunk is added
        (times `W`) to its owner's residual, so no gradient mass is lost.
5. **Residuals.** `residual = acc - decoded` (what this rank contributed, decoded), keyed by parameter name and
   committed when the step's last bucket is done (DDP rebuilds buckets after the first iteration and buckets mix
   groups, so nothing is keyed by bucket).
6. The hook divides by the world size itself, writes the averaged gradients into `bucket.buffer()` and returns a
   completed future holding it.

## Bytes per rank and optimizer step (ring model, what `grpo/comm/bytes_sent` reports)

`W` is the world size; `S` a message in bytes. Every rank reports the same average figure:

| collective (used by)                                       | bytes per rank      |
|------------------------------------------------------------|---------------------|
| all-reduce of `S` bytes (dense, warm-up, 32-bit values)    | `2 (W - 1) / W * S` |
| all-gather of an `s`-byte message per rank                 | `(W - 1) * s`       |
| broadcast of `S` bytes (index table + indices)             | `(W - 1) / W * S`   |
| all-to-all of an `S`-byte buffer (reduce-scatter)          | `(W - 1) / W * S`   |
| all-gather of uneven chunks summing to `S` (an all-to-all) | `(W - 1) / W * S`   |

- `allgather`: `(W - 1) * (16 + max_r s_r) + 2 (W - 1) / W * 4 * n_dense`, where `s_r` is rank `r`'s packed messages
  (12-byte header, fp32 scales, codes (2-bit codes as a bitmap plus sign bits), compact indices per parameter:
  [`~grpo_hf.compression.codec.serialize`]).
  It grows with `W`: use it for few workers.
- `allreduce`: `(W - 1) / W * (16 * n_sparse + I) + 2 (W - 1) / W * (4 * (n_dense + k_32 + 1) + Q)`, where `I`
  are the leader's index bytes, `k_32` the 32-bit values, `+ 1` the non-finite flag and `Q` the quantized values of
  the bucket (codes and one fp32 scale per block and chunk; the two all-to-alls cost `(W - 1) / W * Q` each). Flat
  in `W`: below `2 (4 k_32 + Q)` plus the indices, however many workers.
- Warm-up steps and all-dense buckets are all-reduced in the bucket's dtype (2 bytes per entry for a bf16 model);
  the dense tensors of a compressed bucket travel as fp32.
- The baselines `grpo/comm/bytes_dense_fp32` / `_fp16` are a plain all-reduce of every gradient at 4 / 2 bytes per
  entry; `ratio_* = baseline / bytes_sent` (higher is better).

## Speed

Tensors of the same size and spec (a model repeats its layers) are processed together as the rows of one `[T, n]`
fp32 matrix: one top-k (a quickselect per row, or a sampled threshold for large rows), one index coder, one
quantizer, one decoder per group and step, not per tensor, with results bit-identical to the per-tensor codec
(tests compare them). On CPU the full-size passes (threshold compare, `nonzero`, scatters) run in numpy, which is
several times faster than torch's kernels on one thread, and the `acc` / residual matrices are double-buffered (no
fresh multi-megabyte allocations, hence no page faults, after the first steps). 2-bit codes are turned into their
wire form (bitmap + signs) from the decoded values with numpy's `packbits`. `recipes/bench_hook_speed.py` measures
it (world size 1, one thread, 2 CPU cores; the table is in the README): at the default density 1 and 2 bits, the
`allgather` hook took 163 ms per step for a 6.3M-parameter Llama (26 ms per million entries) and 51 ms for
SmolLM2-135M's LoRA r=8 adapters (2.4M parameters in 420 tensors).

## Tuning

Measured on a 4.2M-parameter Llama trained from scratch for 150 AdamW steps under 2-process DDP
(`recipes/bench_comm.py`, 2 seeds; the table is in the README):

- **Default: density 1, 2 bits (ternary), `allgather`.** Every entry is considered every step; per block of 128, the
  entries of at least half the block's absmax are sent as +-absmax (one bitmap bit and one sign bit), the others as
  0 (one bitmap bit); error feedback keeps the rest: 16.8x fewer bytes than dense fp32 at 1.034x dense perplexity.
- `density` < 1 (top-k, the article's 0.15) costs much more perplexity than the bytes it saves: Adam normalises each
  coordinate, so a coordinate that top-k sends once every few steps moves less per step than a dense one, and
  top-15% lost 23-42% perplexity at 4-8 bits whatever the value bits. Per-block top-k (19 of every 128) was worse
  still; ternary codes keep the per-block selection data-dependent (at least one entry per block, more where the
  block is flat) and decode overshooting values that error feedback corrects on the next step.
- `bits` (per group): 2 by default; 4 for linear weights and 8 for embeddings and convolutions is the article's
  (`grpo_bits="auto"`); 16 or 32 for groups that are sensitive. Each chunk of values gets its own fp32 scale per
  block of 128, so one outlier only coarsens its block.
- `mode`: `allgather` costs `(W - 1) * s` and suits 2-3 workers. `allreduce` costs about `2 Q` whatever `W`, but its
  owners re-quantize the averaged values to the same bits, and at 2 bits that second rounding cost 34% perplexity
  (1.34x): use 4 bits with it. Its quantized chunks are sent as packed codes
  (2 bits per value at 2 bits, not the bitmap + signs of `allgather`), so that every size is known in advance.
- `dense_warmup_steps`: 2 by default; raise it (e.g. to the LR warm-up length) if the first steps diverge.

## Warnings

- Call [`GRPOCommState.bind`] with the model (not needed again after a DDP rebuild) before the first backward, and
  `register_comm_hook` once per DDP object (a second call raises). Use one state per DDP model.
- The settings, `mode` and `dense_warmup_steps` must be identical on every rank: the collectives' sizes derive from
  them, and a mismatch hangs or fails the job.
- Collectives are issued synchronously inside the hook, in the same order on every rank (torch's `powerSGD_hook`,
  which chains collectives in future callbacks, was seen to desynchronise at `W = 4` on gloo). The price: this
  bucket's communication does not overlap with the rest of the backward pass.
- One fp32 residual per compressed parameter per rank (memory: 4 bytes per compressed entry, twice that while the
  previous step's buffers are kept for reuse), saved with every checkpoint (per rank) by [`~grpo_hf.GRPOCallback`].
  `state.residuals[name]` are rows of the hook's matrices: copy one (`.clone()`) to keep it across steps, as its
  storage is reused two steps later.
- Residuals are in the units of the gradients the hook sees: an fp16 `GradScaler` that changes its scale leaves
  them at the old scale for one step (error feedback absorbs it; skipped steps leave residuals untouched).
- Sparse gradients (`nn.Embedding(sparse=True)`), FSDP and DeepSpeed are not supported.
"""

import logging
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn

from .codec import (
    DEFAULT_BLOCK_SIZE,
    CodecSpec,
    IndexScheme,
    _compress_rows_into_residual,
    _decode_rows,
    _dequantize_rows,
    _deserialize_rows,
    _encode_rows,
    _gather,
    _quantize_rows,
    _rows_as,
    _scatter_,
    _serialize_rows,
    _topk_rows,
    num_kept,
)
from .traffic import allgather_bytes, allreduce_bytes, alltoall_bytes, broadcast_bytes


logger = logging.getLogger(__name__)

MODES = ("allreduce", "allgather")
STATE_VERSION = 1
_META_BYTES = 16  # two int64: [payload size, non-finite flag] (all-gather) or [index scheme, index bytes] (broadcast)


# ----------------------------------------------------------------------------------------------------------------
# Byte model (ring algorithm, average per rank)
# ----------------------------------------------------------------------------------------------------------------


def _quantized_layout(num_values: int, bits: int, block_size: int) -> tuple[int, int]:
    """`(number of fp32 scales, payload bytes)` of [`quantize`] on `num_values` values at 16, 8 or 4 bits."""
    if bits == 16:
        return 1, 2 * num_values
    return -(-num_values // block_size), (num_values * bits + 7) // 8


def quantized_nbytes(num_values: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of [`quantize`]'s output (fp32 scales + codes) for `num_values` values at 16, 8 or 4 bits."""
    num_scales, payload = _quantized_layout(num_values, bits, block_size)
    return 4 * num_scales + payload


def chunk_bounds(num_values: int, world_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> list[tuple[int, int]]:
    """
    The `W` block-aligned `[start, end)` ranges the all-reduce mode cuts a parameter's values into: whole blocks of
    `block_size` values spread as evenly as possible (chunks are empty when there are fewer blocks than ranks).
    """
    blocks = -(-num_values // block_size)
    starts = [min(j * blocks // world_size * block_size, num_values) for j in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))


# ----------------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------------


class GRPOCommState:
    r"""
    Settings, error-feedback residuals and traffic statistics of [`grpo_comm_hook`] and [`compress_locally`].

    Example:

    ```python
    >>> state = GRPOCommState(trainer.grpo_compression_settings, mode="allreduce")
    >>> state.bind(trainer.model)
    >>> ddp_model.register_comm_hook(state, grpo_comm_hook)
    ```

    Args:
        settings (`dict[str, tuple[float, int]]`):
            Parameter name -> `(density, bits)` for every trainable parameter (`(1.0, 32)` = dense). Parameters
            missing from it are sent dense (with a warning).
        mode (`str`, *optional*, defaults to `"allreduce"`):
            `"allreduce"` (shared indices chosen by a cyclic leader; bytes per rank flat in the world size) or
            `"allgather"` (every rank its own top-k; bytes per rank grow with the world size).
        sparse (`bool`, *optional*, defaults to `True`):
            Use each parameter's density. `False` sends every entry (density 1).
        quantize (`bool`, *optional*, defaults to `True`):
            Use each parameter's bits. `False` sends fp32 values.
        dense_warmup_steps (`int`, *optional*, defaults to `2`):
            Optimizer steps sent dense before compression starts. Residuals are keyed by parameter name, so DDP's
            bucket rebuild after the first iteration does not require it; a short dense start protects the first,
            large gradients (as PowerSGD's `start_powerSGD_iter`).
        simulated_world_size (`int`, *optional*, defaults to `2`):
            World size used by [`compress_locally`] to count the bytes one worker would send (a single process
            sends nothing). The DDP hook always uses the real world size.
        block_size (`int`, *optional*, defaults to `128`):
            Values per fp32 scale at 8 and 4 bits (see [`~grpo_hf.compression.codec.CodecSpec`]).
        process_group (`torch.distributed.ProcessGroup`, *optional*):
            Group to communicate in; the default group when `None`.
    """

    __slots__ = (
        # --- tuned ---
        "settings",
        "mode",
        "sparse",
        "quantize",
        "dense_warmup_steps",
        # --- seldom tuned ---
        "simulated_world_size",
        "block_size",
        "process_group",
        # --- bound by bind() ---
        "names",
        "world_size",
        "rank",
        # --- internal state (checkpointed) ---
        "residuals",
        "step",
        # --- per-step scratch ---
        "_specs",
        "_pending_rows",
        "_spare",
        "_step_nonfinite",
        "_step",
        # --- statistics ---
        "hook_calls",
        "_window",
        "_totals",
        "_warned",
    )

    def __init__(
        self,
        settings: dict[str, tuple[float, int]],
        mode: str = "allreduce",
        sparse: bool = True,
        quantize: bool = True,
        dense_warmup_steps: int = 2,
        simulated_world_size: int = 2,
        block_size: int = DEFAULT_BLOCK_SIZE,
        process_group: dist.ProcessGroup | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES}.")
        if dense_warmup_steps < 0:
            raise ValueError(f"dense_warmup_steps={dense_warmup_steps}: use 0 or more.")
        if simulated_world_size < 1:
            raise ValueError(f"simulated_world_size={simulated_world_size}: use 1 or more (2 is the default).")
        self.settings = dict(settings)
        self.mode = mode
        self.sparse = bool(sparse)
        self.quantize = bool(quantize)
        self.dense_warmup_steps = int(dense_warmup_steps)
        self.simulated_world_size = int(simulated_world_size)
        self.block_size = int(block_size)
        self.process_group = process_group
        self.names: dict[int, str] = {}
        self.world_size = 1
        self.rank = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.step = 0
        self._specs = {name: self._spec(density, bits) for name, (density, bits) in self.settings.items()}
        self._pending_rows: dict[tuple[str, ...], torch.Tensor] = {}  # new residual matrices, committed at step end
        self._spare: dict[tuple[str, ...], torch.Tensor] = {}  # last step's residual matrices, reused for `acc`
        self._step_nonfinite = False
        self._step = _StepStats()
        self.hook_calls = 0
        self._window: list[dict] = []
        self._totals = {key: 0.0 for key in _StepStats.KEYS} | {"steps": 0, "dense_steps": 0}
        self._warned: set[str] = set()

    def _spec(self, density: float, bits: int) -> CodecSpec | None:
        density = float(density) if self.sparse else 1.0
        bits = int(bits) if self.quantize else 32
        if density >= 1.0 and bits >= 32:
            return None
        return CodecSpec(density=min(density, 1.0), bits=bits, block_size=self.block_size)

    def spec_for(self, name: str | None) -> CodecSpec | None:
        """The codec spec a parameter is sent with, `None` when dense."""
        return self._specs.get(name) if name is not None else None

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
        missing = sorted(set(self.names.values()) - set(self.settings))
        if missing:
            self._warn_once(
                "missing",
                f"{len(missing)} trainable parameters have no compression setting and are sent dense (e.g. "
                f"{missing[0]}). Build the settings with grpo_hf.grouping.resolve_compression on the same model.",
            )
        numels = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
        compressed = [n for n in numels if self.spec_for(n) is not None]
        logger.info(
            "GRPO gradient compression: mode=%s, world size %d, %d of %d trainable tensors (%d of %d entries) "
            "compressed, dense warm-up %d steps.",
            self.mode,
            self.world_size,
            len(compressed),
            len(numels),
            sum(numels[n] for n in compressed),
            sum(numels.values()),
            self.dense_warmup_steps,
        )
        return self

    # --- residuals ---
    def _residual(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        residual = self.residuals.get(name)
        if residual is not None and residual.device != like.device:
            residual = self.residuals[name] = residual.to(like.device)
        return residual

    @staticmethod
    def _matrix_of(residuals: list, rows: int, numel: int) -> torch.Tensor | None:
        """The `[rows, numel]` matrix whose rows are exactly `residuals` (in order), or `None`."""
        first = residuals[0]
        base = None if first is None else first._base
        if base is None or base.shape != (rows, numel) or base.dtype != torch.float32:
            return None
        start = base.storage_offset()
        for row, residual in enumerate(residuals):
            if residual is None or residual._base is not base or residual.storage_offset() != start + row * numel:
                return None
        return base

    def _accumulate_rows(self, names: tuple[str, ...], grads: list[torch.Tensor]) -> torch.Tensor:
        """
        `grad + residual` of `T` same-size tensors as a new `[T, n]` fp32 matrix (the residuals are left untouched).
        It is written into the residual matrix these tensors had two steps ago when there is one, and the residuals
        are added in one operation when they are the rows of one matrix (the usual case): a few calls per step
        instead of a few per tensor, and no allocation (no page faults) after the first steps.
        """
        rows, numel, device = len(grads), grads[0].numel(), grads[0].device
        out = self._spare.pop(names, None)
        if out is None or out.shape != (rows, numel) or out.device != device:
            out = torch.empty(rows, numel, dtype=torch.float32, device=device)
        flat = [g.detach().reshape(-1) for g in grads]
        if all(g.dtype == torch.float32 for g in flat):
            torch.stack(flat, out=out)
        else:
            out.copy_(torch.stack(flat))  # fp16/bf16 buckets: computed in fp32
        residuals = [self._residual(name, g) for name, g in zip(names, flat)]
        matrix = self._matrix_of(residuals, rows, numel)
        if matrix is not None:
            out.add_(matrix)
        else:
            for row, residual in zip(out, residuals):
                if residual is not None:
                    row.add_(residual.reshape(-1))
        return out

    def _commit_step(self, dense: bool) -> None:
        """Close an optimizer step: commit the pending residuals (unless it went dense) and record its statistics."""
        nonfinite = self._step_nonfinite
        spare = {}
        if nonfinite:
            spare.update(self._pending_rows)  # unused: next step's `acc` goes there
        else:
            for names, matrix in self._pending_rows.items():
                old = self._matrix_of([self.residuals.get(name) for name in names], *matrix.shape)
                if old is not None and old is not matrix:
                    spare[names] = old  # no longer referenced once its rows are replaced below
                for name, row in zip(names, matrix):
                    self.residuals[name] = row
        self._spare = spare
        self._pending_rows = {}
        self._step_nonfinite = False
        record = self._step.as_dict()
        record["dense"] = dense or nonfinite
        self._step = _StepStats()
        self.step += 1
        self._window.append(record)
        for key in _StepStats.KEYS:
            self._totals[key] += record[key]
        self._totals["steps"] += 1
        self._totals["dense_steps"] += int(record["dense"])

    def _mark_nonfinite(self) -> None:
        self._step_nonfinite = True
        self._warn_once(
            "nonfinite",
            f"GRPO compression: NaN/Inf gradients at optimizer step {self.step}; the affected buckets were sent dense "
            "and the error-feedback residuals were left unchanged for this step (an fp16 GradScaler skips it).",
        )

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
        nothing was sent, e.g. world size 1), `grpo/density` (kept fraction of all trainable entries, element
        weighted), `grpo/sparsity` (`1 - density`), `grpo/comm/hook_ms` (time in the hook per step) and
        `grpo/comm/dense_steps` (warm-up and non-finite steps in the window).
        """
        window, self._window = self._window, []
        if not window:
            return {}
        summed = {key: sum(r[key] for r in window) for key in _StepStats.KEYS}
        return _metrics(summed, len(window), sum(int(r["dense"]) for r in window), prefix=True)

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): `steps`, `dense_steps`, `bytes_sent`, `bytes_dense_fp32`,
        `bytes_dense_fp16`, `ratio_fp32`, `ratio_fp16`, `density`, `hook_ms` (time in the hook),
        `comm_ms` (the part of it spent inside collectives, waiting for other ranks included; `hook_ms - comm_ms` is
        the compression work), `kept`, `numel`.
        """
        totals = dict(self._totals)
        totals.update(_metrics(totals, max(1, totals["steps"]), totals["dense_steps"], prefix=False))
        for key in ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "hook_ms", "comm_ms"):
            totals[key] = self._totals[key]
        return totals

    # --- checkpointing ---
    def state_dict(self) -> dict:
        """This rank's residuals (cpu fp32, keyed by parameter name), step counter and totals; plain types only."""
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "hook_calls": self.hook_calls,
            "residuals": {name: r.detach().to("cpu", copy=True) for name, r in self.residuals.items()},
            "totals": {key: float(v) for key, v in self._totals.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore [`state_dict`]; residuals move to their parameter's device on first use."""
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(f"compression state of version {state_dict.get('version')}, expected {STATE_VERSION}.")
        if state_dict["mode"] != self.mode:
            logger.warning(
                f"Resuming compression state saved in mode {state_dict['mode']!r} with mode {self.mode!r}; "
                "the residuals are reused as they are."
            )
        unknown = sorted(set(state_dict["residuals"]) - set(self.settings))
        if unknown:
            raise ValueError(
                f"the checkpoint holds residuals for parameters this run does not compress (e.g. {unknown[0]}); "
                "resume with the same model and adapters as the run that wrote it."
            )
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(self.process_group)
            if state_dict.get("world_size", world_size) != world_size:
                logger.warning(
                    f"The compression state was saved with world size {state_dict['world_size']} and is resumed with "
                    f"{world_size}: each rank resumes the residuals its rank saved; ranks without a file start at 0."
                )
        self.step = int(state_dict["step"])
        self.hook_calls = int(state_dict.get("hook_calls", 0))
        self.residuals = {name: r.to(torch.float32).reshape(-1) for name, r in state_dict["residuals"].items()}
        self._pending_rows = {}
        self._spare = {}
        self._step_nonfinite = False
        self._step = _StepStats()
        self._window = []
        totals = state_dict.get("totals", {})
        for key in self._totals:
            if key in totals:
                self._totals[key] = type(self._totals[key])(totals[key])

    def __getstate__(self):
        """Pickle without the process group (it cannot be pickled), as torch's `PowerSGDState` does."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in ("process_group", "_spare")}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.process_group = None
        self._spare = {}

    def __repr__(self) -> str:
        compressed = sum(1 for spec in self._specs.values() if spec is not None)
        return (
            f"GRPOCommState(mode={self.mode!r}, sparse={self.sparse}, quantize={self.quantize}, "
            f"dense_warmup_steps={self.dense_warmup_steps}, compressed={compressed}/{len(self._specs)}, "
            f"step={self.step}, world_size={self.world_size})"
        )


class _StepStats:
    """Traffic of one optimizer step (all buckets)."""

    KEYS = ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "kept", "numel", "hook_ms", "comm_ms")
    __slots__ = KEYS

    def __init__(self):
        for key in self.KEYS:
            setattr(self, key, 0.0)

    def dense(self, numel: int, world_size: int, element_size: int = 4) -> None:
        """Account `numel` entries all-reduced dense."""
        self.bytes_sent += allreduce_bytes(numel * element_size, world_size)
        self.kept += numel
        self.baseline(numel, world_size)

    def baseline(self, numel: int, world_size: int) -> None:
        self.bytes_dense_fp32 += allreduce_bytes(4 * numel, world_size)
        self.bytes_dense_fp16 += allreduce_bytes(2 * numel, world_size)
        self.numel += numel

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.KEYS}


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


# ----------------------------------------------------------------------------------------------------------------
# Collectives (synchronous; no-ops at world size 1)
# ----------------------------------------------------------------------------------------------------------------


def _timed(state: GRPOCommState, start: float) -> None:
    state._step.comm_ms += (time.perf_counter() - start) * 1000


def _all_reduce(tensor: torch.Tensor, state: GRPOCommState) -> torch.Tensor:
    if state.world_size > 1:
        start = time.perf_counter()
        dist.all_reduce(tensor, group=state.process_group)
        _timed(state, start)
    return tensor


def _all_gather(tensor: torch.Tensor, state: GRPOCommState) -> list[torch.Tensor]:
    if state.world_size == 1:
        return [tensor]
    start = time.perf_counter()
    out = [torch.empty_like(tensor) for _ in range(state.world_size)]
    dist.all_gather(out, tensor, group=state.process_group)
    _timed(state, start)
    return out


def _broadcast(tensor: torch.Tensor, src: int, state: GRPOCommState) -> torch.Tensor:
    if state.world_size > 1:
        start = time.perf_counter()
        if state.process_group is not None:
            src = dist.get_global_rank(state.process_group, src)
        dist.broadcast(tensor, src=src, group=state.process_group)
        _timed(state, start)
    return tensor


def _all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], state: GRPOCommState
) -> torch.Tensor:
    """`all_to_all_single` with uneven splits (gloo supports them): `send_splits[j]` elements go to rank `j`."""
    if state.world_size == 1:
        return send
    start = time.perf_counter()
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=state.process_group)
    _timed(state, start)
    return recv


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is free of NaN/Inf: one `aminmax` pass each (NaN propagates) and one sync in all."""
    extremes = [torch.stack(torch.aminmax(t.detach().reshape(-1))).float() for t in tensors if t.numel()]
    return not extremes or bool(torch.isfinite(torch.cat(extremes)).all())


def _completed_future(tensor: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future(devices=[tensor.device]) if tensor.device.type != "cpu" else torch.futures.Future()
    future.set_result(tensor)
    return future


# ----------------------------------------------------------------------------------------------------------------
# Hook
# ----------------------------------------------------------------------------------------------------------------


class _Entry:
    """One parameter of a bucket: its name, its flat view into the bucket buffer and its codec spec."""

    __slots__ = ("name", "view", "spec", "numel")

    def __init__(self, name, view, spec):
        self.name, self.view, self.spec, self.numel = name, view, spec, view.numel()


def grpo_comm_hook(state: GRPOCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""
    DDP communication hook: grouped top-k sparsification and quantization with error feedback (see the module
    docstring for the algorithm and its byte cost).

    The module does not use `from __future__ import annotations`: DDP's `register_comm_hook` compares this
    function's annotations with `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` as objects.

    Args:
        state (`GRPOCommState`): settings, residuals and statistics; [`GRPOCommState.bind`] must have been called.
        bucket (`torch.distributed.GradBucket`): the bucket of flattened gradients DDP hands to the hook.

    Returns:
        A completed `torch.futures.Future` holding `bucket.buffer()`, which now holds the averaged gradients.

    Example:

    ```python
    >>> state = GRPOCommState(settings, mode="allgather").bind(model)
    >>> ddp_model.register_comm_hook(state, grpo_comm_hook)
    ```
    """
    start = time.perf_counter()
    if not state.names:
        raise RuntimeError("grpo_comm_hook: call `state.bind(model)` before the first backward pass.")
    buffer = bucket.buffer()
    world_size = state.world_size
    state.hook_calls += 1
    entries = []
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        name = state.names.get(id(param))
        if name is None:
            state._warn_once("unknown", "a DDP bucket holds a parameter that `bind` did not see; it is sent dense.")
        entries.append(_Entry(name, grad.view(-1), state.spec_for(name)))
    stats = state._step
    stats.baseline(buffer.numel(), world_size)
    warmup = state.step < state.dense_warmup_steps
    if warmup or all(e.spec is None for e in entries):
        _dense_bucket(buffer, state, stats)
    elif state.mode == "allgather":
        _allgather_bucket(buffer, entries, state, stats)
    else:
        _allreduce_bucket(buffer, entries, state, stats)
    stats.hook_ms += (time.perf_counter() - start) * 1000
    if bucket.is_last():
        state._commit_step(dense=warmup)
    return _completed_future(buffer)


def _dense_bucket(buffer: torch.Tensor, state: GRPOCommState, stats: _StepStats) -> None:
    """Plain all-reduce of the whole bucket in its own dtype (warm-up, all-dense buckets, non-finite fallback)."""
    _all_reduce(buffer, state).div_(state.world_size)
    stats.bytes_sent += allreduce_bytes(buffer.numel() * buffer.element_size(), state.world_size)
    stats.kept += buffer.numel()


def _allreduce_dense_part(dense: list[_Entry], extra: list[torch.Tensor], state: GRPOCommState, stats: _StepStats):
    """One fp32 all-reduce of the dense entries followed by `extra` tensors; returns the summed vector."""
    parts = [e.view.to(torch.float32) for e in dense] + extra
    if not parts:
        return None
    vector = torch.cat(parts)
    _all_reduce(vector, state)
    stats.bytes_sent += allreduce_bytes(4 * vector.numel(), state.world_size)
    return vector


def _write_dense(dense: list[_Entry], summed: torch.Tensor, world_size: int) -> None:
    offset = 0
    for entry in dense:
        entry.view.copy_(summed[offset : offset + entry.numel] / world_size)
        offset += entry.numel


def _group_entries(entries: list[_Entry]) -> list[tuple[CodecSpec, int, list[_Entry]]]:
    """The compressed entries by `(spec, size)`, in order of first appearance: each group is one `[T, n]` matrix."""
    groups: dict[tuple[CodecSpec, int], list[_Entry]] = {}
    for entry in entries:
        if entry.spec is not None:
            groups.setdefault((entry.spec, entry.numel), []).append(entry)
    return [(spec, numel, members) for (spec, numel), members in groups.items()]


def _scatter_rows_(target: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor, add: bool) -> None:
    """`target[r, positions[r]] (+)= values[r]` for every row of a contiguous `[T, n]` fp32 matrix (all when None)."""
    if positions is None:
        target.add_(values) if add else target.copy_(values)
        return
    rows, numel = target.shape
    flat = (positions + torch.arange(rows, device=target.device).view(-1, 1) * numel).view(-1)
    values = values.reshape(-1)
    if add:
        values = _gather(target.view(-1), flat) + values
    _scatter_(target.view(-1), flat, values)


def _dense_rows(positions: torch.Tensor | None, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The `[T, numel]` fp32 matrix holding `values` at `positions` in each row, zeros elsewhere."""
    if positions is None:
        return values
    dense = torch.zeros(values.shape[0], numel, dtype=torch.float32, device=values.device)
    _scatter_rows_(dense, positions, values, add=False)
    return dense


def _copy_rows(targets: list[torch.Tensor], rows: torch.Tensor) -> None:
    """`targets[i].copy_(rows[i])` for every row (one multi-tensor call; casts to each target's dtype)."""
    if hasattr(torch, "_foreach_copy_") and all(t.is_contiguous() for t in targets):
        torch._foreach_copy_([t.view(-1) for t in targets], list(rows.unbind(0)))
    else:
        for target, row in zip(targets, rows):
            target.copy_(row.view_as(target))


def _write_rows(members: list[_Entry], positions: torch.Tensor | None, values: torch.Tensor, numel: int) -> None:
    """Write each row's values into its entry's view of the bucket (zeros where nothing was kept)."""
    _copy_rows([entry.view for entry in members], _dense_rows(positions, values, numel))


def _allgather_bucket(buffer: torch.Tensor, entries: list[_Entry], state: GRPOCommState, stats: _StepStats) -> None:
    world_size, rank = state.world_size, state.rank
    groups = _group_entries(entries)
    dense = [e for e in entries if e.spec is None]
    keys = [tuple(e.name for e in members) for _, _, members in groups]
    nonfinite = not _all_finite([buffer])
    pieces, batches, sizes, accs, kept = [], [], [], [], 0
    if not nonfinite:
        accs = [state._accumulate_rows(key, [e.view for e in members]) for key, (_, _, members) in zip(keys, groups)]
        nonfinite = not _all_finite(accs)  # grad + residual overflowed in fp32
        if not nonfinite:
            for (spec, _, _), acc in zip(groups, accs):
                batch = _compress_rows_into_residual(acc, spec)  # `acc` is now the new residuals
                batches.append(batch)
                serialized = _serialize_rows(batch)
                sizes.append(sum(piece.numel() for piece in serialized))  # this batch's bytes in the message
                pieces.extend(serialized)
                kept += batch.num_values * batch.rows
    payload = torch.cat(pieces) if pieces and not nonfinite else buffer.new_zeros(0, dtype=torch.uint8)
    meta = torch.tensor([payload.numel(), int(nonfinite)], dtype=torch.int64, device=buffer.device)
    metas = torch.stack(_all_gather(meta, state)).tolist()
    stats.bytes_sent += allgather_bytes(_META_BYTES, world_size)
    if any(flag for _, flag in metas):
        state._mark_nonfinite()
        _dense_bucket(buffer, state, stats)
        return
    longest = max(size for size, _ in metas)
    padded = torch.cat([payload, payload.new_zeros(longest - payload.numel())])
    gathered = _all_gather(padded, state)
    stats.bytes_sent += allgather_bytes(longest, world_size)
    # Decode the W messages in rank order on every rank and sum them from zero: bit-identical sums everywhere. This
    # rank's own message is not decoded: its positions and decoded values are those the encoder produced.
    sums = [torch.zeros(len(members), numel, device=buffer.device) for _, numel, members in groups]
    for source, message in enumerate(gathered):
        offset = 0
        for (spec, numel, members), batch, size, total in zip(groups, batches, sizes, sums):
            if source == rank:
                positions, decoded = batch.positions, batch.decoded
                offset += size
            else:
                positions, decoded, offset = _deserialize_rows(message, offset, len(members), numel, spec)
            _scatter_rows_(total, positions, decoded, add=True)
    for (_, numel, members), total in zip(groups, sums):
        _write_rows(members, None, total.div_(world_size), numel)
    summed = _allreduce_dense_part(dense, [], state, stats)
    if summed is not None:
        _write_dense(dense, summed, world_size)
    stats.kept += kept + sum(e.numel for e in dense)
    state._pending_rows.update(zip(keys, accs))


def _allreduce_bucket(buffer: torch.Tensor, entries: list[_Entry], state: GRPOCommState, stats: _StepStats) -> None:
    world_size, rank, device = state.world_size, state.rank, buffer.device
    groups = _group_entries(entries)
    dense = [e for e in entries if e.spec is None]
    keys = [tuple(e.name for e in members) for _, _, members in groups]
    accs = [state._accumulate_rows(key, [e.view for e in members]) for key, (_, _, members) in zip(keys, groups)]
    nonfinite = not _all_finite([buffer, *accs])

    # 1. Shared positions: the leader's top-k, broadcast as a table (scheme, bytes per tensor) and the index bytes.
    positions: list[torch.Tensor | None] = [None] * len(groups)
    sparse = [g for g, (spec, _, _) in enumerate(groups) if spec.density < 1.0]
    if sparse:
        leader = state.step % world_size
        table, encoded = [], []
        if rank == leader:
            for g in sparse:
                spec, numel, members = groups[g]
                acc = torch.nan_to_num(accs[g], nan=0.0, posinf=0.0, neginf=0.0) if nonfinite else accs[g]
                k = num_kept(numel, spec.density)
                if k < numel:
                    positions[g] = _topk_rows(acc, k)
                    schemes, indices = _encode_rows(positions[g], numel)
                else:
                    schemes = [int(IndexScheme.DENSE)] * len(members)
                    indices = [torch.zeros(0, dtype=torch.uint8, device=device)] * len(members)
                table += [value for scheme, index in zip(schemes, indices) for value in (scheme, index.numel())]
                encoded += indices
        num_rows = sum(len(groups[g][2]) for g in sparse)
        if rank == leader:
            table = torch.tensor(table, dtype=torch.int64, device=device)
        else:
            table = torch.zeros(2 * num_rows, dtype=torch.int64, device=device)
        _broadcast(table, leader, state)
        rows = table.view(-1, 2).tolist()
        total = sum(size for _, size in rows)
        indices = torch.cat(encoded) if rank == leader else torch.empty(total, dtype=torch.uint8, device=device)
        _broadcast(indices, leader, state)
        stats.bytes_sent += broadcast_bytes(8 * 2 * len(rows) + total, world_size)
        if rank != leader:  # the leader keeps its own positions
            offset, row = 0, 0
            for g in sparse:
                spec, numel, members = groups[g]
                mine = rows[row : row + len(members)]
                row += len(members)
                sizes = [size for _, size in mine]
                payloads = list(torch.split(indices[offset : offset + sum(sizes)], sizes))
                offset += sum(sizes)
                if mine[0][0] != IndexScheme.DENSE:
                    k = num_kept(numel, spec.density)
                    positions[g] = _decode_rows([scheme for scheme, _ in mine], payloads, numel, k)

    # 2. 32-bit values, dense entries and the non-finite flags: one fp32 all-reduce.
    values = [acc if pos is None else torch.gather(acc, 1, pos) for acc, pos in zip(accs, positions)]
    fp32 = [g for g, (spec, _, _) in enumerate(groups) if spec.bits == 32]
    flag = torch.tensor([float(nonfinite)], dtype=torch.float32, device=device)
    summed = _allreduce_dense_part(dense, [values[g].reshape(-1) for g in fp32] + [flag], state, stats)
    if summed[-1].item() > 0:
        state._mark_nonfinite()
        _dense_bucket(buffer, state, stats)
        return
    _write_dense(dense, summed, world_size)
    offset = sum(e.numel for e in dense)
    results: list[torch.Tensor] = [None] * len(groups)  # averaged values at the positions, [T, k]
    for g in fp32:
        count = values[g].numel()
        results[g] = (summed[offset : offset + count] / world_size).view_as(values[g])
        offset += count
        if positions[g] is None:
            accs[g].zero_()
        else:  # the values went out exactly
            _scatter_rows_(accs[g], positions[g], torch.zeros_like(values[g]), add=False)

    # 3. 4/8/16-bit values: compressed reduce-scatter (all_to_all) + all-gather of the requantized means.
    quantized = [g for g, (spec, _, _) in enumerate(groups) if spec.bits != 32]
    if quantized:
        means, owner_errors = _reduce_quantized(
            [values[g] for g in quantized], [groups[g][0].bits for g in quantized], [keys[g] for g in quantized],
            state, stats,
        )  # fmt: skip
        for g, mean, (decoded, errors) in zip(quantized, means, owner_errors):
            results[g] = mean
            contribution_error = values[g] - decoded  # exact: the codec guarantees decoded + (v - decoded) == v
            for rows_owned, start, end, error in errors:
                contribution_error[rows_owned, start:end] += error
            _scatter_rows_(accs[g], positions[g], contribution_error, add=False)

    # 4. Write the averaged gradients into the bucket.
    for (_, numel, members), pos, result in zip(groups, positions, results):
        _write_rows(members, pos, result, numel)
    stats.kept += sum(v.numel() for v in values) + sum(e.numel for e in dense)
    state._pending_rows.update(zip(keys, accs))


def _pack(payload: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """`[T, bytes]` of each row's chunk as sent: its fp32 scales, then its codes."""
    if scales is None:
        return payload
    return torch.cat([scales.contiguous().view(torch.uint8).view(payload.shape[0], -1), payload], dim=1)


def _unpack(pieces: torch.Tensor, num_values: int, bits: int, block_size: int) -> torch.Tensor:
    """Decoded fp32 values `[T, num_values]` of `[T, bytes]` chunks packed by [`_pack`]."""
    num_scales, _ = _quantized_layout(num_values, bits, block_size)
    scales = _rows_as(pieces[:, : 4 * num_scales], torch.float32)
    return _dequantize_rows(pieces[:, 4 * num_scales :], scales, bits, num_values, block_size)


def chunk_owner_offset(name: str | None, world_size: int) -> int:
    """
    Rank that owns chunk 0 of a parameter in the all-reduce mode (chunk `j` goes to rank `(j + offset) % W`).

    A stable hash of the name (not Python's salted `hash`), so that small tensors, whose values fill only the first
    chunks, spread their reduction work and all-gather bytes over the ranks, the same way on every rank and run.
    """
    return zlib.crc32((name or "").encode()) % world_size


def _reduce_quantized(
    values: list[torch.Tensor], bits: list[int], keys: list[tuple[str, ...]], state: GRPOCommState, stats: _StepStats
):
    """
    Average quantized `values` (per group, a `[T, k]` fp32 matrix: one row per parameter, same positions on every
    rank) over the ranks.

    Each row is cut into `W` block-aligned chunks (the same bounds for the rows of a group); chunk `j` of a row is
    quantized on its own and owned by rank `(j + chunk_owner_offset(name)) % W`. Pieces travel grouped by (group,
    chunk, row), every rank knowing the layout, so each step costs a few calls per group and chunk, not per tensor.

    Returns the averaged values per group (identical on every rank) and, per group, `(decoded own contribution
    [T, k], [(owned rows, start, end, requantization error of those chunks times W), ...])`.
    """
    world_size, rank, block = state.world_size, state.rank, state.block_size
    layout = []  # per group: [(start, end, rows per destination rank)] for each chunk
    sends: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    decoded = []
    for v, b, key in zip(values, bits, keys):
        offsets = [chunk_owner_offset(name, world_size) for name in key]
        dec = torch.empty_like(v)
        chunks = []
        for j, (start, end) in enumerate(chunk_bounds(v.shape[1], world_size, block)):
            payload, scales, dec[:, start:end] = _quantize_rows(v[:, start:end], b, block)
            packed = _pack(payload, scales)
            owners = [
                [row for row, off in enumerate(offsets) if (j + off) % world_size == r] for r in range(world_size)
            ]
            for r, rows in enumerate(owners):
                if rows and packed.shape[1]:
                    sends[r].append(packed[rows].reshape(-1))
            chunks.append((start, end, owners))
        layout.append(chunks)
        decoded.append(dec)
    send_splits = [sum(p.numel() for p in parts) for parts in sends]
    send = (
        torch.cat([p for parts in sends for p in parts])
        if any(send_splits)
        else values[0].new_zeros(0, dtype=torch.uint8)
    )
    received = _all_to_all(send, send_splits, [send_splits[rank]] * world_size, state)
    stats.bytes_sent += alltoall_bytes(send.numel(), world_size)

    # Reduce the owned chunks: dequantize the W contributions, sum them from zero in rank order, requantize the mean.
    def pieces_of(message: torch.Tensor, owner: int):
        """(group, chunk, rows, `[rows, bytes]` pieces) of `owner`'s chunks in a message laid out as `sends`."""
        offset = 0
        for g, (chunks, b) in enumerate(zip(layout, bits)):
            for j, (start, end, owners) in enumerate(chunks):
                rows = owners[owner]
                if not rows:
                    continue
                size = quantized_nbytes(end - start, b, block)
                yield g, j, start, end, rows, message[offset : offset + len(rows) * size].view(len(rows), size)
                offset += len(rows) * size

    sums = {}
    for message in torch.split(received, [send_splits[rank]] * world_size):
        for g, j, start, end, rows, pieces in pieces_of(message, rank):
            total = sums.setdefault((g, j), torch.zeros(len(rows), end - start, device=send.device))
            total += _unpack(pieces, end - start, bits[g], block)
    packed, errors = [], [[] for _ in values]
    for g, j, start, end, rows, _ in pieces_of(received[: send_splits[rank]], rank):
        mean = sums[(g, j)] / world_size
        payload, scales, requantized = _quantize_rows(mean, bits[g], block)
        errors[g].append((rows, start, end, (mean - requantized) * world_size))
        packed.append(_pack(payload, scales).reshape(-1))
    # All-gather of the owned chunks, whose sizes differ (every rank knows them): an all-to-all that sends the same
    # message to every rank costs exactly what a ring all-gather would, without padding to the largest chunk.
    mine = torch.cat(packed) if packed else send.new_zeros(0)
    gathered = _all_to_all(mine.repeat(world_size), [mine.numel()] * world_size, send_splits, state)
    stats.bytes_sent += alltoall_bytes(send.numel(), world_size)

    means = [torch.empty_like(v) for v in values]
    for owner, message in enumerate(torch.split(gathered, send_splits)):
        for g, _, start, end, rows, pieces in pieces_of(message, owner):
            means[g][rows, start:end] = _unpack(pieces, end - start, bits[g], block)
    return means, list(zip(decoded, errors))


# ----------------------------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------------------------


def compress_locally(state: GRPOCommState, model: nn.Module) -> None:
    """
    The article's "sparse updates" in a single process: replace every `p.grad` by its compressed-and-decoded value,
    with error feedback. Call it after the backward of the last micro-batch, before clipping and `optimizer.step`.

    Nothing is sent, so the bytes are those one worker **would** send in `state.mode` with
    `W = state.simulated_world_size` (default 2), as if all parameters were in one DDP bucket:

    - `allgather`: `(W - 1) * (16 + sum of the serialized messages) + 2 (W - 1) / W * 4 * n_dense`;
    - `allreduce`: `(W - 1) / W * (16 * n_sparse + index bytes) + 2 (W - 1) / W * (4 * (n_dense + k_32 + 1) + Q)`,
      `Q` the quantized values cut into `W` chunks with their own scales (the hook's layout).

    The values are compressed per tensor as [`~grpo_hf.compression.codec.compress_with_feedback`] does (a single
    worker is its own leader); warm-up steps and steps with NaN/Inf gradients leave the gradients untouched.

    Args:
        state (`GRPOCommState`): the compression state (bound to `model` if it was not yet).
        model (`torch.nn.Module`): the model whose gradients to compress.
    """
    start = time.perf_counter()
    if not state.names:
        state.bind(model)
    world_size = state.simulated_world_size
    stats = state._step
    params = [(state.names.get(id(p)), p) for p in model.parameters() if p.requires_grad and p.grad is not None]
    numel = sum(p.numel() for _, p in params)
    warmup = state.step < state.dense_warmup_steps
    groups: dict[tuple[CodecSpec, int], list[tuple[str, torch.Tensor]]] = {}
    dense_grads = []
    for name, param in params:
        spec = state.spec_for(name)
        if spec is None:
            dense_grads.append(param.grad)
        else:
            groups.setdefault((spec, param.numel()), []).append((name, param))
    accs = []
    if not warmup and groups:
        # grad + residual of every group (a few matrices): one finiteness check covers the gradients and the sums;
        # only if it fails are the gradients checked one by one (a NaN/Inf gradient makes the whole step dense).
        accs = [
            state._accumulate_rows(tuple(name for name, _ in members), [param.grad for _, param in members])
            for members in groups.values()
        ]
        small = torch.cat([g.detach().reshape(-1).float() for g in dense_grads]) if dense_grads else None
        if not _all_finite([*accs, *([small] if small is not None else [])]):
            if not _all_finite([p.grad for _, p in params]):
                state._mark_nonfinite()
                warmup = True
    elif not warmup and not _all_finite([p.grad for _, p in params]):
        state._mark_nonfinite()
        warmup = True
    if warmup or not groups:
        stats.dense(numel, world_size)
    else:
        stats.baseline(numel, world_size)
        n_dense = sum(g.numel() for g in dense_grads)
        stats.kept += n_dense
        n_fp32 = 0
        index_bytes, messages, n_sparse = 0, 0, 0
        quantized = 0  # quantized values cut into W chunks with their own scales (the hook's layout)
        for ((spec, size), members), acc in zip(groups.items(), accs):
            if not _all_finite([acc]):  # rare: grad + residual overflowed in fp32 in some rows
                extremes = torch.stack(torch.aminmax(acc, dim=1), dim=1)
                finite = torch.isfinite(extremes).all(dim=1).tolist()
                for (name, param), ok in zip(members, finite):
                    if not ok:  # keep this gradient and its residual as they are
                        state._warn_once(
                            "overflow", f"GRPO compression: grad + residual of {name} overflowed; sent dense."
                        )
                        n_dense += param.numel()
                        stats.kept += param.numel()
                members = [member for member, ok in zip(members, finite) if ok]
                if not members:
                    continue
                acc = acc[[row for row, ok in enumerate(finite) if ok]]
            batch = _compress_rows_into_residual(acc, spec)  # `acc` is now the new residuals
            _copy_rows([param.grad for _, param in members], _dense_rows(batch.positions, batch.decoded, size))
            state._pending_rows[tuple(name for name, _ in members)] = acc
            rows, k = len(members), batch.num_values
            stats.kept += rows * k
            messages += sum(batch.nbytes())
            if batch.positions is not None:
                n_sparse += rows
                index_bytes += sum(index.numel() for index in batch.indices)
            if spec.bits == 32:
                n_fp32 += rows * k
            else:
                quantized += rows * sum(
                    quantized_nbytes(end - begin, spec.bits, spec.block_size)
                    for begin, end in chunk_bounds(k, world_size, spec.block_size)
                )
        if state.mode == "allgather":
            stats.bytes_sent += allgather_bytes(_META_BYTES + messages, world_size)
            if n_dense:
                stats.bytes_sent += allreduce_bytes(4 * n_dense, world_size)
        else:
            if n_sparse:
                stats.bytes_sent += broadcast_bytes(_META_BYTES * n_sparse + index_bytes, world_size)
            stats.bytes_sent += allreduce_bytes(4 * (n_dense + n_fp32 + 1) + quantized, world_size)
    stats.hook_ms += (time.perf_counter() - start) * 1000
    state.hook_calls += 1
    state._commit_step(dense=warmup)


__all__ = [
    "MODES",
    "GRPOCommState",
    "allgather_bytes",
    "allreduce_bytes",
    "alltoall_bytes",
    "broadcast_bytes",
    "chunk_bounds",
    "chunk_owner_offset",
    "compress_locally",
    "grpo_comm_hook",
    "quantized_nbytes",
]
