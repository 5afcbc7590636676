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
  (12-byte header, fp32 scales, codes, compact indices per parameter: [`~grpo_hf.compression.codec.serialize`]).
  It grows with `W`: use it for few workers.
- `allreduce`: `(W - 1) / W * (16 * n_sparse + I) + 2 (W - 1) / W * (4 * (n_dense + k_32 + 1) + Q)`, where `I`
  are the leader's index bytes, `k_32` the 32-bit values, `+ 1` the non-finite flag and `Q` the quantized values of
  the bucket (codes and one fp32 scale per block and chunk; the two all-to-alls cost `(W - 1) / W * Q` each). Flat
  in `W`: below `2 (4 k_32 + Q)` plus the indices, however many workers.
- Warm-up steps and all-dense buckets are all-reduced in the bucket's dtype (2 bytes per entry for a bf16 model);
  the dense tensors of a compressed bucket travel as fp32.
- The baselines `grpo/comm/bytes_dense_fp32` / `_fp16` are a plain all-reduce of every gradient at 4 / 2 bytes per
  entry; `ratio_* = baseline / bytes_sent` (higher is better).

## Tuning

- `density` (per group, default 0.15): the main knob. Error feedback keeps what is not sent, so quality usually holds
  down to a few percent; go lower for large, redundant FFN and embedding matrices first.
- `bits` (per group): 4 for linear weights, 8 for embeddings and convolutions (the article); 16 or 32 for groups that
  are sensitive (e.g. attention Q/K in short fine-tunes). Each chunk of values gets its own fp32 scale per block of
  128, so one outlier only coarsens its block.
- `mode`: `allgather` costs `(W - 1) * s` and suits 2-4 workers; beyond that `allreduce` wins (about `2 Q`
  whatever `W`), at the price of sharing the leader's positions (ScaleCom shows the leader's top-k tracks the
  aggregate's well when error feedback is on).
- `dense_warmup_steps`: 2 by default; raise it (e.g. to the LR warm-up length) if the first steps diverge.

## Warnings

- Call [`GRPOCommState.bind`] with the model (not needed again after a DDP rebuild) before the first backward, and
  `register_comm_hook` once per DDP object (a second call raises). Use one state per DDP model.
- The settings, `mode` and `dense_warmup_steps` must be identical on every rank: the collectives' sizes derive from
  them, and a mismatch hangs or fails the job.
- Collectives are issued synchronously inside the hook, in the same order on every rank (torch's `powerSGD_hook`,
  which chains collectives in future callbacks, was seen to desynchronise at `W = 4` on gloo). The price: this
  bucket's communication does not overlap with the rest of the backward pass.
- One fp32 residual per compressed parameter per rank (memory: 4 bytes per compressed entry), saved with every
  checkpoint (per rank) by [`~grpo_hf.GRPOCallback`].
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
    compress,
    compress_with_feedback,
    decode_indices,
    decompress,
    dequantize,
    deserialize,
    quantize,
    serialize,
)


logger = logging.getLogger(__name__)

MODES = ("allreduce", "allgather")
STATE_VERSION = 1
_META_BYTES = 16  # two int64: [payload size, non-finite flag] (all-gather) or [index scheme, index bytes] (broadcast)


# ----------------------------------------------------------------------------------------------------------------
# Byte model (ring algorithm, average per rank)
# ----------------------------------------------------------------------------------------------------------------


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of an `nbytes` message: `2 (W - 1) / W * nbytes`."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of an `nbytes` message per rank: `(W - 1) * nbytes`."""
    return float((world_size - 1) * nbytes)


def broadcast_bytes(nbytes: float, world_size: int) -> float:
    """Average bytes per rank to broadcast `nbytes` (W - 1 ranks receive it once): `(W - 1) / W * nbytes`."""
    return (world_size - 1) / world_size * nbytes


def alltoall_bytes(nbytes: float, world_size: int) -> float:
    """Average bytes per rank of an all-to-all of `nbytes`-byte buffers split over `W` ranks: `(W - 1) / W * nbytes`."""
    return (world_size - 1) / world_size * nbytes


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
        "_pending",
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
        self._pending: dict[str, torch.Tensor] = {}
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

    def _commit_step(self, dense: bool) -> None:
        """Close an optimizer step: commit the pending residuals (unless it went dense) and record its statistics."""
        nonfinite = self._step_nonfinite
        if not nonfinite:
            self.residuals.update(self._pending)
        self._pending = {}
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
        `bytes_dense_fp16`, `ratio_fp32`, `ratio_fp16`, `density`, `hook_ms`, `kept`, `numel`.
        """
        totals = dict(self._totals)
        totals.update(_metrics(totals, max(1, totals["steps"]), totals["dense_steps"], prefix=False))
        for key in ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "hook_ms"):
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
        self._pending = {}
        self._step_nonfinite = False
        self._step = _StepStats()
        self._window = []
        totals = state_dict.get("totals", {})
        for key in self._totals:
            if key in totals:
                self._totals[key] = type(self._totals[key])(totals[key])

    def __getstate__(self):
        """Pickle without the process group (it cannot be pickled), as torch's `PowerSGDState` does."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.process_group = None

    def __repr__(self) -> str:
        compressed = sum(1 for spec in self._specs.values() if spec is not None)
        return (
            f"GRPOCommState(mode={self.mode!r}, sparse={self.sparse}, quantize={self.quantize}, "
            f"dense_warmup_steps={self.dense_warmup_steps}, compressed={compressed}/{len(self._specs)}, "
            f"step={self.step}, world_size={self.world_size})"
        )


class _StepStats:
    """Traffic of one optimizer step (all buckets)."""

    KEYS = ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "kept", "numel", "hook_ms")
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


def _all_reduce(tensor: torch.Tensor, state: GRPOCommState) -> torch.Tensor:
    if state.world_size > 1:
        dist.all_reduce(tensor, group=state.process_group)
    return tensor


def _all_gather(tensor: torch.Tensor, state: GRPOCommState) -> list[torch.Tensor]:
    if state.world_size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(state.world_size)]
    dist.all_gather(out, tensor, group=state.process_group)
    return out


def _broadcast(tensor: torch.Tensor, src: int, state: GRPOCommState) -> torch.Tensor:
    if state.world_size > 1:
        if state.process_group is not None:
            src = dist.get_global_rank(state.process_group, src)
        dist.broadcast(tensor, src=src, group=state.process_group)
    return tensor


def _all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], state: GRPOCommState
) -> torch.Tensor:
    """`all_to_all_single` with uneven splits (gloo supports them): `send_splits[j]` elements go to rank `j`."""
    if state.world_size == 1:
        return send
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=state.process_group)
    return recv


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


def _allgather_bucket(buffer: torch.Tensor, entries: list[_Entry], state: GRPOCommState, stats: _StepStats) -> None:
    world_size = state.world_size
    compressed = [e for e in entries if e.spec is not None]
    dense = [e for e in entries if e.spec is None]
    nonfinite = bool(not torch.isfinite(buffer).all())
    messages, residuals, kept = [], {}, 0
    if not nonfinite:
        for entry in compressed:
            ct, _, residual = compress_with_feedback(entry.view, state._residual(entry.name, entry.view), entry.spec)
            if ct.nonfinite:  # grad + residual overflowed
                nonfinite = True
                break
            messages.append(serialize(ct))
            residuals[entry.name] = residual
            kept += ct.num_values
    payload = torch.cat(messages) if messages and not nonfinite else buffer.new_zeros(0, dtype=torch.uint8)
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
    # Decode the W messages in rank order on every rank: bit-identical sums everywhere.
    sums = [torch.zeros(e.numel, dtype=torch.float32, device=buffer.device) for e in compressed]
    for message in gathered:
        offset = 0
        for entry, out in zip(compressed, sums):
            ct = deserialize(message[offset:], entry.numel)
            decompress(ct, out=out, accumulate=True)
            offset += ct.nbytes()
    for entry, out in zip(compressed, sums):
        entry.view.copy_(out.div_(world_size))
    summed = _allreduce_dense_part(dense, [], state, stats)
    if summed is not None:
        _write_dense(dense, summed, world_size)
    stats.kept += kept + sum(e.numel for e in dense)
    state._pending.update(residuals)


def _allreduce_bucket(buffer: torch.Tensor, entries: list[_Entry], state: GRPOCommState, stats: _StepStats) -> None:
    world_size, rank, device = state.world_size, state.rank, buffer.device
    compressed = [e for e in entries if e.spec is not None]
    dense = [e for e in entries if e.spec is None]
    accs = []
    for entry in compressed:
        acc = entry.view.to(torch.float32, copy=True)
        residual = state._residual(entry.name, entry.view)
        if residual is not None:
            acc.add_(residual)
        accs.append(acc)
    finite = torch.stack([torch.isfinite(buffer).all()] + [torch.isfinite(a).all() for a in accs])
    nonfinite = bool(not finite.all())

    # 1. Shared positions: the leader's top-k, broadcast as a table (scheme, bytes) and the compact index bytes.
    positions: list[torch.Tensor | None] = [None] * len(compressed)
    sparse = [i for i, e in enumerate(compressed) if e.spec.density < 1.0]
    if sparse:
        leader = state.step % world_size
        table = torch.zeros(2 * len(sparse), dtype=torch.int64, device=device)
        encoded = []
        if rank == leader:
            for row, i in enumerate(sparse):
                acc = torch.nan_to_num(accs[i], nan=0.0, posinf=0.0, neginf=0.0) if nonfinite else accs[i]
                ct = compress(acc, CodecSpec(compressed[i].spec.density, 32, state.block_size))
                index_bytes = ct.indices if ct.indices is not None else table.new_zeros(0, dtype=torch.uint8)
                table[2 * row] = int(ct.index_scheme)
                table[2 * row + 1] = index_bytes.numel()
                encoded.append(index_bytes)
        _broadcast(table, leader, state)
        rows = table.view(-1, 2).tolist()
        total = sum(size for _, size in rows)
        indices = torch.cat(encoded) if rank == leader else torch.empty(total, dtype=torch.uint8, device=device)
        _broadcast(indices, leader, state)
        stats.bytes_sent += broadcast_bytes(8 * table.numel() + total, world_size)
        offset = 0
        for (scheme, size), i in zip(rows, sparse):
            if scheme != IndexScheme.DENSE:
                positions[i] = decode_indices(scheme, indices[offset : offset + size], compressed[i].numel)
            offset += size

    # 2. 32-bit values, dense entries and the non-finite flags: one fp32 all-reduce.
    values = [acc if pos is None else acc[pos] for acc, pos in zip(accs, positions)]
    fp32 = [i for i, e in enumerate(compressed) if e.spec.bits == 32]
    flag = torch.tensor([float(nonfinite)], dtype=torch.float32, device=device)
    summed = _allreduce_dense_part(dense, [values[i] for i in fp32] + [flag], state, stats)
    if summed[-1].item() > 0:
        state._mark_nonfinite()
        _dense_bucket(buffer, state, stats)
        return
    _write_dense(dense, summed, world_size)
    offset = sum(e.numel for e in dense)
    results: list[torch.Tensor] = [None] * len(compressed)  # averaged values at the positions
    residuals = {}
    for i in fp32:
        count = values[i].numel()
        results[i] = summed[offset : offset + count] / world_size
        offset += count
        residual = accs[i]
        if positions[i] is None:
            residual.zero_()
        else:
            residual[positions[i]] = 0.0  # the values went out exactly
        residuals[compressed[i].name] = residual

    # 3. 4/8/16-bit values: compressed reduce-scatter (all_to_all) + all-gather of the requantized means.
    quantized = [i for i, e in enumerate(compressed) if e.spec.bits != 32]
    if quantized:
        means, owner_errors = _reduce_quantized(
            [values[i] for i in quantized],
            [compressed[i].spec.bits for i in quantized],
            [compressed[i].name for i in quantized],
            state,
            stats,
        )
        for i, mean, (decoded, error, bounds) in zip(quantized, means, owner_errors):
            results[i] = mean
            acc, pos = accs[i], positions[i]
            kept_acc = acc if pos is None else acc[pos]
            contribution_error = kept_acc - decoded  # exact: codec guarantees decoded + (v - decoded) == v
            start, end = bounds
            contribution_error[start:end] += error
            if pos is None:
                acc.copy_(contribution_error)
            else:
                acc[pos] = contribution_error
            residuals[compressed[i].name] = acc

    # 4. Write the averaged gradients into the bucket.
    for entry, pos, result in zip(compressed, positions, results):
        if pos is None:
            entry.view.copy_(result)
        else:
            entry.view.zero_()
            entry.view[pos] = result.to(entry.view.dtype)
    stats.kept += sum(v.numel() for v in values) + sum(e.numel for e in dense)
    state._pending.update(residuals)


def _pack(payload: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    parts = [] if scales is None else [scales.reshape(-1).contiguous().view(torch.uint8)]
    parts.append(payload.reshape(-1).contiguous().view(torch.uint8))
    return torch.cat(parts)


def _unpack(buffer: torch.Tensor, offset: int, num_values: int, bits: int, block_size: int):
    """Read `(decoded fp32 values, new offset)` of a chunk packed by [`_pack`]."""
    num_scales, payload_bytes = _quantized_layout(num_values, bits, block_size)
    scales = buffer[offset : offset + 4 * num_scales].clone().view(torch.float32)
    offset += 4 * num_scales
    payload = buffer[offset : offset + payload_bytes].clone()
    if bits == 16:
        payload = payload.view(torch.float16)
    offset += payload_bytes
    return dequantize(payload, scales, bits, num_values, block_size), offset


def chunk_owner_offset(name: str | None, world_size: int) -> int:
    """
    Rank that owns chunk 0 of a parameter in the all-reduce mode (chunk `j` goes to rank `(j + offset) % W`).

    A stable hash of the name (not Python's salted `hash`), so that small tensors, whose values fill only the first
    chunks, spread their reduction work and all-gather bytes over the ranks, the same way on every rank and run.
    """
    return zlib.crc32((name or "").encode()) % world_size


def _reduce_quantized(
    values: list[torch.Tensor], bits: list[int], names: list[str], state: GRPOCommState, stats: _StepStats
):
    """
    Average quantized `values` (one flat fp32 tensor per parameter, same positions on every rank) over the ranks.

    Returns the averaged values per parameter (identical on every rank) and, per parameter, `(decoded own
    contribution, requantization error of the owned chunk times W, owned chunk bounds)`.
    """
    world_size, rank, block = state.world_size, state.rank, state.block_size
    bounds = [chunk_bounds(v.numel(), world_size, block) for v in values]
    offsets = [chunk_owner_offset(name, world_size) for name in names]
    sends = [[] for _ in range(world_size)]
    decoded = []
    for v, b, chunks, off in zip(values, bits, bounds, offsets):
        dec = torch.empty_like(v)
        for j, (start, end) in enumerate(chunks):
            payload, scales = quantize(v[start:end], b, block)
            dec[start:end] = dequantize(payload, scales, b, end - start, block)
            sends[(j + off) % world_size].append(_pack(payload, scales))
        decoded.append(dec)
    send_splits = [sum(p.numel() for p in parts) for parts in sends]
    send = torch.cat([p for parts in sends for p in parts])
    received = _all_to_all(send, send_splits, [send_splits[rank]] * world_size, state)
    stats.bytes_sent += alltoall_bytes(send.numel(), world_size)

    # Reduce the owned chunks: dequantize the W contributions, sum them in rank order, requantize the mean.
    own = [chunks[(rank - off) % world_size] for chunks, off in zip(bounds, offsets)]
    sums = [torch.zeros(end - start, dtype=torch.float32, device=send.device) for start, end in own]
    for r in range(world_size):
        offset = r * send_splits[rank]
        for k, (b, (start, end)) in enumerate(zip(bits, own)):
            contribution, offset = _unpack(received, offset, end - start, b, block)
            sums[k] += contribution
    packed, errors = [], []
    for total, b in zip(sums, bits):
        mean = total / world_size
        payload, scales = quantize(mean, b, block)
        errors.append((mean - dequantize(payload, scales, b, mean.numel(), block)) * world_size)
        packed.append(_pack(payload, scales))
    # All-gather of the owned chunks, whose sizes differ (every rank knows them): an all-to-all that sends the same
    # message to every rank costs exactly what a ring all-gather would, without padding to the largest chunk.
    mine = torch.cat(packed)
    gathered = _all_to_all(mine.repeat(world_size), [mine.numel()] * world_size, send_splits, state)
    stats.bytes_sent += alltoall_bytes(send.numel(), world_size)

    means = [torch.empty_like(v) for v in values]
    for r, message in enumerate(torch.split(gathered, send_splits)):
        offset = 0
        for k, (b, off) in enumerate(zip(bits, offsets)):
            start, end = bounds[k][(r - off) % world_size]
            means[k][start:end], offset = _unpack(message, offset, end - start, b, block)
    return means, list(zip(decoded, errors, own))


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

    The values are compressed per tensor with [`~grpo_hf.compression.codec.compress_with_feedback`] (a single worker
    is its own leader); warm-up steps and steps with NaN/Inf gradients leave the gradients untouched.

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
    if not warmup and any(not torch.isfinite(p.grad).all() for _, p in params):
        state._mark_nonfinite()
        warmup = True
    if warmup or all(state.spec_for(name) is None for name, _ in params):
        stats.dense(numel, world_size)
    else:
        stats.baseline(numel, world_size)
        n_dense = n_fp32 = 0
        index_bytes, messages, n_sparse = 0, 0, 0
        quantized = 0  # quantized values cut into W chunks with their own scales (the hook's layout)
        residuals = {}
        for name, param in params:
            spec = state.spec_for(name)
            if spec is None:
                n_dense += param.numel()
                stats.kept += param.numel()
                continue
            ct, decoded, residual = compress_with_feedback(param.grad, state._residual(name, param.grad), spec)
            if ct.nonfinite:  # grad + residual overflowed in fp32: keep this gradient and its residual as they are
                state._warn_once("overflow", f"GRPO compression: grad + residual of {name} overflowed; sent dense.")
                n_dense += param.numel()
                stats.kept += param.numel()
                continue
            param.grad.copy_(decoded.view_as(param.grad))
            residuals[name] = residual
            stats.kept += ct.num_values
            messages += ct.nbytes()
            if ct.indices is not None:
                n_sparse += 1
                index_bytes += ct.indices.numel()
            if spec.bits == 32:
                n_fp32 += ct.num_values
            else:
                quantized += sum(
                    quantized_nbytes(end - begin, spec.bits, spec.block_size)
                    for begin, end in chunk_bounds(ct.num_values, world_size, spec.block_size)
                )
        if state.mode == "allgather":
            stats.bytes_sent += allgather_bytes(_META_BYTES + messages, world_size)
            if n_dense:
                stats.bytes_sent += allreduce_bytes(4 * n_dense, world_size)
        else:
            if n_sparse:
                stats.bytes_sent += broadcast_bytes(_META_BYTES * n_sparse + index_bytes, world_size)
            stats.bytes_sent += allreduce_bytes(4 * (n_dense + n_fp32 + 1) + quantized, world_size)
        state._pending.update(residuals)
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
