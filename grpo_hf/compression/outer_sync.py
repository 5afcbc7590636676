"""`OuterSyncState` and `local_gradient_hook`: sync every H steps (DiLoCo), GRPO's groups as Streaming-DiLoCo fragments.

With `grpo_sync_every = H > 1`, DDP exchanges nothing at the inner steps: [`local_gradient_hook`] hands every bucket
back as it is, so each rank steps its own optimizer on its own gradients. Every `H` optimizer steps (per fragment, at
its own offset) the ranks agree on one global model `θ_global` through the codec of the per-step hook, with error
feedback, and an outer SGD step with Nesterov momentum. Read it the way torch's `powerSGD_hook.py` reads: one state,
one hook, and the encode / exchange / decode seam (`exchange.py`) and byte formulas (`traffic.py`) the per-step hook
uses too.

Example:

```python
>>> from grpo_hf.compression import compression_plan
>>> from grpo_hf.compression.outer_sync import OuterSyncState, local_gradient_hook, pack_fragments

>>> plan = compression_plan(model, groups, compression="quantize", bits=4)
>>> fragments = pack_fragments([(g.name, g.param_names, [p.numel() for p in g.params]) for g in groups], count=2)
>>> state = OuterSyncState(plan, fragments, every=16).bind(model, optimizer)  # the unwrapped model
>>> ddp_model.register_comm_hook(state, local_gradient_hook)
>>> ...  # after every optimizer.step():
>>> state.end_step(last=step == max_steps)
```

## Algorithm

At [`OuterSyncState.bind`] every rank copies the trainable parameters into `θ_global` (identical on every rank: DDP
broadcast rank 0's at wrapping) and zeros the outer momentum `m`. Then, per optimizer step:

1. **Inner step.** The backward's buckets go through [`local_gradient_hook`]: no collective, each rank keeps its own
   gradient. Clipping, the LR scheduler, GRPO's LR ratios and the optimizer run as usual, locally; the inner optimizer
   state stays on its rank. Only the per-group gradient norms behind the importance multipliers and the skip of a
   NaN/Inf step are agreed on ([`OuterSyncState.agree_norms`]: one all-reduce of `G` float64 values), so that every
   rank takes the same decision.
2. **Due fragments** ([`fragments_due`]): with the ramp, every fragment syncs after steps 1, 3, 7, 15, … (intervals
   1, 2, 4, … below `H`); after the ramp, fragment `f` of `F` syncs every `H` steps at offset `ceil((f + 1) H / F)`,
   so that the bytes of one interval are spread over `F` steps. The last step of training syncs every fragment.
3. **Pseudo-gradient.** Fragment by fragment, per parameter, `Δ = θ_global − θ_local` (fp32). One flag all-reduce: if
   any rank's `Δ` holds a NaN, an Inf or a value at or above `2**60`, every rank restarts the fragment from
   `θ_global` (its local progress since the last sync is dropped; momentum and residuals, the owners' included,
   are left unchanged).
4. **Exchange** ([`~grpo_hf.compression.compression_plan`] decides each tensor's spec): tensors with a spec (8, 4 or
   16 bits) are encoded with the per-step hook's kernel (`Δ + residual`, block absmax, codes, new bf16 residual in
   place), one padded row per bit width. Then, by the world size `W`:
   - `W = 2`: the messages are all-gathered and every rank decodes the `W` of them in rank order, its own included,
     into the mean `Δ̄`.
   - `W >= 3` (`OWNER_MIN_WORLD_SIZE`; blocking syncs): owner reduction, as the per-step hook's `allreduce` mode does
     it and with the same functions (`encode_to_owners`, `exchange_with_owners`, `reduce_owned`, `decode_from_owners`
     of `exchange.py`): each tensor's blocks are cut into `W` contiguous chunks, chunk `j` owned by rank
     `(j + crc32(name)) mod W` (`layout.Run.owned_blocks`). Each rank sends each owner the codes of its blocks (one
     all-to-all); each owner decodes its `W` contributions in rank order, averages them and encodes the mean again
     with its own error feedback (the owner residual, bf16, of the blocks it owns only); the owners' messages are
     all-gathered and every rank decodes them, in owner order, into `Δ̄`. Both ways every rank decodes the same
     messages in the same order: the same bits of `Δ̄` on every rank.
     At `W = 2` both would send the same bytes, and the owners would quantize `Δ̄` twice.
   Tensors without a spec (norms, biases, `grpo_bits=32`, `grpo_compression="none"`) go through one fp32
   all-reduce.
5. **Outer step** ([`outer_step`], torch's `SGD(nesterov=True)` on `Δ̄`): `m = μ m + Δ̄`, `θ_global -= lr (Δ̄ + μ m)`;
   with `μ = 0` the momentum is not kept.
6. **Restart.** Every rank copies `θ_global` into its parameters in place (`p.copy_`: never
   `vector_to_parameters`, which would make the parameters views of a reused buffer).
7. **Moments** (`moments="second"` or `"both"`, blocking syncs only): the inner optimizer's `exp_avg_sq` (and
   `exp_avg`) of the fragment's parameters are averaged over the ranks in place in `optimizer.state`: per moment one
   fp32 row of the fragment (as its dense tensors), one all-reduce, divided by `W`. They join step 3's NaN/Inf check;
   with the flag set they are left as they are.

## Overlap (`delay = τ > 0`, Streaming DiLoCo)

Without delay the exchange of step 4 blocks the step that syncs. With `τ > 0` (after the ramp, whose syncs stay
blocking) a due fragment's exchange is only started at its sync step: `Δ` is taken, the flag's all-reduce, the
messages' all-gathers and the dense all-reduce are started (`Collectives.start_*`), and the next `τ` inner steps
compute while they run. After step `s + τ` every rank waits for them, takes the outer step of step 5 on `Δ̄` exactly as
without delay (same `θ_global`, same momentum), and merges instead of restarting ([`merge_with_global`], torchft's
`p.lerp_(local, fragment_update_alpha)` on the global weights):

    θ_local ← (1 − α) θ_global + α θ_local          (α = `mix`)

where `θ_local` holds the `τ` local steps taken while the exchange ran. `α = 0` takes `θ_global`, as a sync without
delay does, and drops those steps; `α > 0` keeps that share of them (and of the local model's distance to the new
`θ_global`): the late outer step does not throw away the work done meanwhile. The next `Δ` is measured from the new
`θ_global`, so the sign is DiLoCo's: `Δ = θ_global − θ_local` points away from the local progress and the outer step
`θ_global −= lr Δ̄` moves toward it.

- **Bits.** The exchange is the same as without delay (the residuals are replaced when it completes, not when it
  starts), `θ_global` and the momentum are identical on every rank, and each rank's merged parameters are a function
  of that `θ_global` and its own local ones.
- **NaN/Inf.** The flag travels with the exchange (a rank whose `Δ` is not safe sends zeros). Set, every rank restarts
  the fragment from `θ_global` when the exchange is applied, dropping the local steps, those taken while the exchange
  ran included; `θ_global`, momentum and residuals are unchanged, as without delay.
- **When it is waited for.** At its due step; earlier when another fragment becomes due (never, with `τ < H / F`), at
  the last step of training (whose sync of every fragment then blocks, so that training ends on `θ_global` with no
  exchange in flight), in [`OuterSyncState.finish`], and in [`OuterSyncState.state_dict`], which waits without
  applying: a checkpoint holds the completed exchange (flag and `Δ̄`), and the outer step and merge happen at the due
  step in a resumed run as in an uninterrupted one; saving does not change training. `θ_global` is only written
  when an exchange is applied, on the training thread, so evaluation and `save_model` read the `θ_global` of the
  last applied outer step.
- **Bytes.** Counted in the step that starts the exchange (the flag's and the messages', also when the flag turns out
  set: with a delay they are sent before the flag is known). A delayed exchange always all-gathers the messages: owner
  reduction (`W >= 3`) serves the blocking syncs only (the ramp's, the last step's, those without delay), since its
  owners can only start their half once the all-to-all has arrived. From 3 ranks a delayed sync therefore sends
  `(W − 1) s` where a blocking one sends about `2 (W − 1) / W s`.
- **Memory.** The fragment's `Δ` row, the `W` messages and its new bf16 residual live for `τ` steps.
- **Process group.** Under DDP the exchanges run in a process group of their own (the same ranks, made at
  [`OuterSyncState.bind`] on every rank): NCCL runs the collectives of one group in order, and the next steps' norm
  all-reduce must not queue behind the exchange under way.

## Bytes per rank (ring model, [`~grpo_hf.compression.traffic`]; `grpo/comm/bytes_sent`)

- Every step: `2 (W − 1) / W × 8 G` for the agreed group norms (`G` groups).
- Per fragment synced: `2 (W − 1) / W × 8` for the flag, plus `2 (W − 1) / W × 4 n_dense` for its dense tensors,
  plus with `moments` `2 (W − 1) / W × 4 n` per moment averaged (`n` the fragment's entries),
  plus for its codes (`s` = `4 + bits × 128 / 8` bytes per block of 128 entries, padded to 16 bytes):
  - `W = 2`, and delayed exchanges: `(W − 1) × s`, the all-gather of the messages;
  - `W >= 3`, blocking: `(W − 1) / W × S + (W − 1) × s_owner` ([`~grpo_hf.compression.traffic.owner_reduction_bytes`]):
    the all-to-all of this rank's `W` parts (`S` bytes in all, about `s`) and the all-gather of the owners' messages
    (about `s / W` each, padded to the longest). About `2 (W − 1) / W × s`: never more than `2 s`, whatever `W`.
- `grpo/comm/bytes_peak`: the most bytes of any one step of the window; the per-step average is `bytes_sent`.

The baselines `grpo/comm/bytes_dense_fp32` / `_fp16` are DDP's all-reduce of every gradient at every step.

## Without an exchange

On one process, and with `exchange=False` under DDP (`grpo_outer_control=True`: DDP's own all-reduce of the gradients
at every step keeps every rank identical), `Δ̄` is the rank's own `Δ`, exact, and nothing is sent for it: only the
outer step is added (the outer-step-only control, which separates the outer optimizer's effect from the savings).
Under DDP the control's bytes are DDP's fp32 all-reduce of the gradients at every step.

## Warnings

- Register the hook once per DDP object and [`OuterSyncState.bind`] before the first backward; the plan, the
  fragments and the settings must be identical on every rank.
- Memory per trainable entry and rank: `θ_global` and the momentum (4 bytes each, 2 in `bfloat16`; no momentum when
  `μ = 0`), the bf16 residual of the compressed tensors (2 bytes; from 3 ranks also the owner residual of the blocks
  it owns, `2 / W` bytes), and during a sync the fragment's `Δ` (4 bytes per entry) and the messages (every rank's,
  or about two of them with owners): `F` fragments divide the sync's work memory by `F`.
- Sparse gradients, FSDP and DeepSpeed are not supported; fp16 mixed precision is not (its `GradScaler` would skip
  steps on one rank and not on another).
"""

import contextlib
import itertools
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..optim.moments import averaging_refusal, moment_numel, moment_tensors
from .codec import ENCODE_CHUNK, all_safe, compile_kernels
from .exchange import (
    Collectives,
    decode,
    decode_from_owners,
    encode,
    encode_to_owners,
    exchange_with_owners,
    message_nbytes,
    owned_blocks,
    reduce_owned,
    split_messages,
)
from .layout import Run
from .spec import CodecSpec
from .state import RESIDUAL_DTYPE, RowStore
from .traffic import FLAG_BYTES, StepStats, TrafficStats, allgather_bytes, allreduce_bytes


logger = logging.getLogger(__name__)

OUTER_MODE = "outer-sync"  # the `mode` of this state in checkpoints (beside "allgather", "allreduce", FSDP's)
STATE_VERSION = 1
DEFAULT_OUTER_LR = 1.0  # plain averaging: best against best on the suite (benchmarks/LOG.md, 2026-12-04)
DEFAULT_OUTER_MOMENTUM = 0.0
DEFAULT_SYNC_RAMP = True
DEFAULT_SYNC_DELAY = 0
DEFAULT_SYNC_MIX = 0.5  # α, provisional (not measured on the suite); torchft's `fragment_update_alpha` defaults to 0
OUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# grpo_sync_moments: the inner optimizer's state averaged over ranks at a sync (hivemind averages Adam's exp_avg_sq)
SYNC_MOMENTS = {"none": (), "second": ("second",), "both": ("first", "second")}
DEFAULT_SYNC_MOMENTS = "none"
# From this many ranks a blocking sync's codes go through owners (the per-step hook's `allreduce` mode); at 2 the owners'
# reduce-scatter and all-gather send the bytes of the all-gather, and would quantize `Δ̄` twice.
OWNER_MIN_WORLD_SIZE = 3
SYNC_BITS = (4, 8, 16)  # codes of fixed size; 32 bits and dense tensors go through an fp32 all-reduce


# ----------------------------------------------------------------------------------------------------------------
# The math: schedule, fragments, outer step (pure functions)
# ----------------------------------------------------------------------------------------------------------------


def ramp_points(every: int) -> list[int]:
    """
    The steps after which every fragment syncs while the interval ramps up: intervals 1, 2, 4, … below `every`, so
    `[1, 3, 7, 15]` for `every=16` and `[]` for `every <= 1`.
    """
    points, interval, step = [], 1, 0
    while interval < every:
        step += interval
        points.append(step)
        interval *= 2
    return points


def fragment_offsets(every: int, fragments: int) -> list[int]:
    """Step of each fragment's first sync after the ramp, counted from its end: `ceil((f + 1) * every / fragments)`."""
    return [-(-(f + 1) * every // fragments) for f in range(fragments)]


def fragments_due(step: int, every: int, fragments: int = 1, ramp: bool = DEFAULT_SYNC_RAMP) -> list[int]:
    """
    The fragments that sync after optimizer step `step` (1 for the first step of training).

    Args:
        step (`int`): optimizer steps taken, this one included.
        every (`int`): `H`, the steps between two syncs of one fragment.
        fragments (`int`, *optional*, defaults to `1`): `F`; fragment `f` syncs at offset `ceil((f + 1) H / F)` of
            every interval, so that fragment `F - 1` syncs when one fragment would.
        ramp (`bool`, *optional*, defaults to `True`): first sync every fragment after steps 1, 3, 7, …
            ([`ramp_points`]), then start the intervals of `H`.
    """
    points = ramp_points(every) if ramp else []
    if points and step <= points[-1]:
        return list(range(fragments)) if step in points else []
    since = step - (points[-1] if points else 0)
    return [f for f, offset in enumerate(fragment_offsets(every, fragments)) if (since - offset) % every == 0]


def pack_fragments(groups: list[tuple[str, list[str], list[int]]], count: int) -> list[list[str]]:
    """
    GRPO's groups packed into `count` fragments of balanced sizes: the parameter names of each fragment, in the order
    of `groups`.

    A group is kept whole unless it holds more than `1 / count` of the entries, in which case its parameters are
    packed one by one. Units are placed largest first, each in the lightest fragment so far (ties: the first).

    Args:
        groups (`list[tuple[str, list[str], list[int]]]`): per group, its name, parameter names and sizes.
        count (`int`): the number of fragments.

    Raises:
        `ValueError`: fewer groups and parameters than fragments.
    """
    order = {name: i for i, (_, names, _) in enumerate(groups) for name in names}
    if count <= 1:
        return [sorted(order, key=order.get)]
    total = sum(sum(numels) for _, _, numels in groups)
    units = []
    for _, names, numels in groups:
        if sum(numels) * count > total:
            units += [([name], numel) for name, numel in zip(names, numels)]
        else:
            units.append((list(names), sum(numels)))
    if len(units) < count:
        raise ValueError(
            f"grpo_sync_fragments={count}: the model has only {len(units)} groups and parameters to spread over "
            "fragments. Use fewer fragments or a finer grouping (grpo_groups='semantic+shape', or a group file)."
        )
    loads, packed = [0] * count, [[] for _ in range(count)]
    for names, numel in sorted(units, key=lambda unit: -unit[1]):  # stable: ties keep the order of the groups
        lightest = min(range(count), key=lambda f: (loads[f], f))
        loads[lightest] += numel
        packed[lightest] += names
    return [sorted(names, key=order.get) for names in packed]


def outer_step(global_param: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor | None, lr: float, mu: float):
    """
    One outer SGD step with Nesterov momentum on the mean pseudo-gradient `delta` (fp32), in place, as torch's
    `SGD(nesterov=True, dampening=0)` takes it: `m = mu * m + delta`, `θ -= lr * delta + lr * mu * m` (`θ -= lr *
    delta` without momentum). In place for fp32 tensors; bf16 ones are updated through an fp32 copy.
    """
    buffer = None
    if momentum is not None and mu > 0:
        buffer = momentum if momentum.dtype == torch.float32 else momentum.float()
        buffer.mul_(mu).add_(delta)
        if buffer is not momentum:
            momentum.copy_(buffer)
    value = global_param if global_param.dtype == torch.float32 else global_param.float()
    value.add_(delta, alpha=-lr)
    if buffer is not None:
        value.add_(buffer, alpha=-lr * mu)
    if value is not global_param:
        global_param.copy_(value)


def merge_with_global(local: torch.Tensor, global_param: torch.Tensor, mix: float) -> torch.Tensor:
    """
    A fragment's new local parameters after a delayed sync (Streaming DiLoCo's merge): `(1 − mix) θ_global + mix
    θ_local`, computed in fp32 as `torch.lerp(θ_global, θ_local, mix)` (torchft's `p.lerp_(local, alpha)` on the
    global weights) and returned in `local`'s dtype. `mix = 0` is `θ_global` exactly (the restart of a sync without
    delay, whatever `θ_local` holds); `mix = 1` keeps `θ_local`.

    Args:
        local (`torch.Tensor`): this rank's parameters now, after the steps taken while the exchange ran.
        global_param (`torch.Tensor`): `θ_global` after the outer step on the averaged pseudo-gradient.
        mix (`float`): `α` in `[0, 1]`, the share of the local parameters kept.
    """
    if mix == 0:
        return global_param.to(local.dtype, copy=True)
    return torch.lerp(global_param.float(), local.float(), mix).to(local.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The state
# ----------------------------------------------------------------------------------------------------------------


class _Fragment:
    """One fragment's tensors: the codec runs (one padded row per bit width, each tensor block-aligned) and the dense."""

    def __init__(self, index: int, names: list[str], plan: dict, numels: dict[str, int]):
        self.index, self.names = index, list(names)
        self.numel = sum(numels[name] for name in names)
        self.dense = [name for name in names if plan.get(name) is None]
        self.runs = []  # (spec, slots [(name, offset, numel)], length)
        self.owners: dict[int, Run] = {}  # bits -> the run's row as a layout `Run`: who owns which blocks
        for bits in sorted({plan[name].bits for name in names if plan.get(name) is not None}):
            members = [name for name in names if plan.get(name) is not None and plan[name].bits == bits]
            spec, slots, offset = plan[members[0]], [], 0
            for name in members:
                slots.append((name, offset, numels[name]))
                offset += -(-numels[name] // spec.block_size) * spec.block_size
            self.runs.append((spec, slots, offset))
            # The row is the buffer of a run of the per-step hook (each tensor block-aligned, in place): its tensors'
            # blocks are cut into owners' chunks exactly as the hook's `allreduce` mode cuts a bucket's.
            offsets, sizes = tuple(o for _, o, _ in slots), tuple(n for _, _, n in slots)
            self.owners[bits] = Run(spec, tuple(members), sizes, tuple(range(len(members))), offsets, offsets, offset,
                                    True, tuple(zip(range(len(members)), offsets, sizes)))  # fmt: skip


class _Exchange:
    """
    One fragment's exchange under way (`delay > 0`): started after step `started`, applied after step `due`. Until
    [`OuterSyncState._complete`] it holds the collectives in flight; after it, only `unsafe` (the agreed NaN/Inf flag)
    and `delta` (parameter name -> the mean `Δ̄`, flat fp32), which is what a checkpoint saves of it.
    """

    __slots__ = ("fragment", "started", "due", "comm", "flag", "dense", "dense_sum", "rows", "gathers", "unsafe",
                 "delta")  # fmt: skip

    def __init__(self, fragment: int, started: int, due: int):
        self.fragment, self.started, self.due = fragment, started, due
        self.comm = self.flag = self.dense = self.dense_sum = None
        self.rows, self.gathers = [], []  # per codec run: its Δ row, and (the Started all-gather, the new residual)
        self.unsafe: bool | None = None
        self.delta: dict[str, torch.Tensor] | None = None

    @property
    def completed(self) -> bool:
        return self.delta is not None

    def state_dict(self) -> dict:
        return {
            "fragment": self.fragment,
            "started": self.started,
            "due": self.due,
            "unsafe": self.unsafe,
            "delta": {name: t.detach().to("cpu", copy=True) for name, t in self.delta.items()},
        }


class OuterSyncState:
    r"""
    Settings, global model, outer momentum, error-feedback residuals and traffic statistics of the sync every `H` steps
    (see the module docstring); the state [`local_gradient_hook`] is registered with.

    Args:
        plan (`dict[str, CodecSpec | None]`):
            Parameter name -> how its `Δ` is sent (`None`: fp32 all-reduce), from
            [`~grpo_hf.compression.compression_plan`]; specs of density 1 and 4, 8 or 16 bits.
        fragments (`list[list[str]]`):
            The parameter names of each fragment ([`pack_fragments`]); together, every trainable parameter once.
        every (`int`, *optional*, defaults to `16`):
            `H`: optimizer steps between two syncs of a fragment. Longer saves bytes and costs quality (small models
            and more workers most); tune it first.
        outer_lr (`float`, *optional*, defaults to `1.0`) and outer_momentum (`float`, *optional*, defaults to `0.0`):
            The outer SGD step (Nesterov). `1` and `0` is plain parameter averaging (accelerate's `LocalSGD`), which
            held best against best on the suite's tasks; DiLoCo publishes `0.7` / `0.9` for large models.
        ramp (`bool`, *optional*, defaults to `True`):
            Sync after steps 1, 3, 7, … (intervals doubling up to `H`) before the first full interval: the workers
            drift apart most at the start.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Of `θ_global` and the momentum; `torch.bfloat16` halves their memory, but the model restarts from bf16
            values after each sync: updates below bf16's spacing (fine-tunes at small learning rates) are lost.
        exchange (`bool`, *optional*, defaults to `True`):
            `False`: the gradients are averaged every step by DDP itself (or there is one process), `Δ̄` is the
            rank's own `Δ` and nothing is sent for it (the outer-step-only control).
        process_group (`torch.distributed.ProcessGroup`, *optional*):
            Group to communicate in; the default group when `None`.
        delay (`int`, *optional*, defaults to `0`):
            `τ`: with `τ > 0` a fragment's exchange starts at its sync step and runs while the next `τ` inner steps
            compute; its outer step is applied `τ` steps later and merged with the local parameters (see "Overlap" in
            the module docstring). Below `every / len(fragments)`; the ramp's syncs and the last step's do not wait.
        mix (`float`, *optional*, defaults to `0.5`):
            `α` in `[0, 1]`: after a delayed sync a fragment's parameters become `(1 − α) θ_global + α θ_local`
            ([`merge_with_global`]); `0` restarts from `θ_global` as a sync without delay does. Unused when `delay=0`.
        moments (`str`, *optional*, defaults to `"none"`):
            The inner optimizer's moments averaged over ranks at every sync of a fragment, for its parameters, in place
            in the optimizer's state ([`SYNC_MOMENTS`]): `"none"`, `"second"` or `"both"` (first and second), as
            [`~grpo_hf.optim.moments`] reads them (AdamW's `exp_avg_sq`, Adafactor's factors, GroupedAdamW's blocks);
            one fp32 all-reduce per moment and fragment, blocking. Needs an optimizer that keeps them in fp32 at
            [`bind`] and `delay=0`; nothing to average without an exchange.
    """

    __slots__ = (
        # --- tuned ---
        "every",
        "outer_lr",
        "outer_momentum",
        "ramp",
        "plan",
        "fragments",
        "delay",
        "mix",
        "moments",
        # --- seldom tuned ---
        "dtype",
        "exchange",
        "process_group",
        "simulated_world_size",
        "exchange_group",
        # --- bound by bind() ---
        "names",
        "params",
        "numels",
        "layouts",
        "world_size",
        "rank",
        "kernels",
        "optimizer",
        # --- internal state (checkpointed) ---
        "global_params",
        "momentum",
        "residuals",
        "owner_residuals",
        "step",
        "last_sync",
        "hook_calls",
        "pending",
        "in_flight",
        # --- per step ---
        "stats",
        "swapped",
        # --- statistics ---
        "traffic",
        "_warned",
    )

    def __init__(
        self,
        plan: dict[str, CodecSpec | None],
        fragments: list[list[str]],
        every: int = 16,
        outer_lr: float = DEFAULT_OUTER_LR,
        outer_momentum: float = DEFAULT_OUTER_MOMENTUM,
        ramp: bool = DEFAULT_SYNC_RAMP,
        dtype: torch.dtype = torch.float32,
        exchange: bool = True,
        process_group: dist.ProcessGroup | None = None,
        delay: int = DEFAULT_SYNC_DELAY,
        mix: float = DEFAULT_SYNC_MIX,
        moments: str = DEFAULT_SYNC_MOMENTS,
    ):
        if every < 1:
            raise ValueError(f"every={every}: use 1 or more steps between syncs.")
        if not fragments or any(not names for names in fragments) or len(fragments) > every:
            raise ValueError(f"{len(fragments)} fragments for every={every}: use 1 to {every} non-empty fragments.")
        if delay < 0 or (delay > 0 and delay * len(fragments) >= every):
            raise ValueError(
                f"delay={delay} with every={every} and {len(fragments)} fragments: use 0, or a delay below every / "
                "fragments (an exchange must end before the next fragment's starts)."
            )
        if not 0 <= mix <= 1:
            raise ValueError(f"mix={mix}: use a value in [0, 1] (0 takes θ_global, 1 keeps the local parameters).")
        if moments not in SYNC_MOMENTS:
            raise ValueError(f"moments={moments!r}: use one of {tuple(SYNC_MOMENTS)}.")
        if moments != "none" and delay > 0:
            raise ValueError(
                f"moments={moments!r} with delay={delay}: the moments are averaged by the blocking syncs only; use "
                "delay=0 or moments='none'."
            )
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_lr={outer_lr}, outer_momentum={outer_momentum}: use lr > 0, 0 <= momentum < 1.")
        if dtype not in OUTER_DTYPES.values():
            raise ValueError(f"dtype={dtype}: use torch.float32 or torch.bfloat16.")
        for name, spec in plan.items():
            if spec is not None and (spec.density < 1 or spec.bits not in SYNC_BITS):
                raise ValueError(
                    f"{name}: the sync sends every entry of Δ in codes of one size (4, 8 or 16 bits, or fp32); got "
                    f"density {spec.density} and {spec.bits} bits. Use grpo_compression='quantize' or 'none' and "
                    "grpo_bits 4, 8, 16 or 32 (no top-k, no ternary codes)."
                )
        listed = [name for names in fragments for name in names]
        if len(listed) != len(set(listed)):
            raise ValueError("a parameter is in two fragments; build them with pack_fragments.")
        self.plan = dict(plan)
        self.fragments = [list(names) for names in fragments]
        self.every, self.outer_lr, self.outer_momentum = int(every), float(outer_lr), float(outer_momentum)
        self.ramp, self.dtype, self.exchange = bool(ramp), dtype, bool(exchange)
        self.delay, self.mix, self.moments = int(delay), float(mix), moments
        self.process_group = process_group
        self.exchange_group: dist.ProcessGroup | None = None  # with delay > 0 under DDP: the exchanges' own group
        self.simulated_world_size = 2  # the per-step state's interface; one process exchanges and counts nothing
        self.names: dict[int, str] = {}
        self.params: dict[str, nn.Parameter] = {}
        self.numels: dict[str, int] = {}
        self.layouts: list[_Fragment] = []
        self.world_size, self.rank = 1, 0
        self.kernels = None
        self.optimizer = None
        self.global_params: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self.residuals = RowStore(RESIDUAL_DTYPE)
        self.owner_residuals = RowStore(RESIDUAL_DTYPE)  # from OWNER_MIN_WORLD_SIZE ranks: of the blocks it owns
        self.step = 0
        self.last_sync = [0] * len(self.fragments)
        self.hook_calls = 0
        self.pending: dict | None = None  # a checkpoint's state, applied at bind (the Trainer loads its own first)
        self.in_flight: _Exchange | None = None  # with delay > 0: the fragment exchange under way, or completed
        self.stats = StepStats()
        self.swapped: dict[str, torch.Tensor] | None = None
        # dense_steps and nonfinite_steps stay 0: the keys of the per-step hook's totals
        self.traffic = TrafficStats(
            counters=("syncs",),
            run_counters=("nonfinite_syncs", "dense_steps", "nonfinite_steps"),
            peak=True,
            default_density=0.0,
        )
        self._warned: set[str] = set()

    @property
    def mode(self) -> str:
        return OUTER_MODE

    @property
    def step_world_size(self) -> int:
        """Ranks whose `Δ` differ and are exchanged: the world size, or 1 without an exchange."""
        return self.world_size if self.exchange else 1

    @property
    def in_sync(self) -> bool:
        """
        Whether the parameters are `θ_global`: every fragment restarted from it at this step, and no exchange is under
        way (`last_sync` holds the step at which each fragment last restarted from `θ_global`).
        """
        return self.in_flight is None and all(last == self.step for last in self.last_sync)

    # --- setup ---
    def bind(self, model: nn.Module, optimizer=None) -> "OuterSyncState":
        """
        Follow the model's trainable parameters by name, read the world size, and start `θ_global` from the
        parameters (identical on every rank: DDP broadcast rank 0's), or from the checkpoint given to
        [`load_state_dict`]: then the parameters and `optimizer`'s state become this rank's saved local ones.
        Pass the unwrapped model (a DDP wrapper is unwrapped) and the optimizer that steps.
        """
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.names = {id(p): name for name, p in self.params.items()}
        listed = {name for names in self.fragments for name in names}
        if listed != set(self.params):
            missing = sorted(set(self.params) - listed) or sorted(listed - set(self.params))
            raise ValueError(
                f"the fragments and the model's trainable parameters differ (e.g. {missing[0]}); build the fragments "
                "from this model's groups."
            )
        self.numels = {name: p.numel() for name, p in self.params.items()}
        self.layouts = [_Fragment(i, names, self.plan, self.numels) for i, names in enumerate(self.fragments)]
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        else:
            self.world_size, self.rank = 1, 0
        self.kernels = compile_kernels(False)  # a sync every H steps: the eager kernels, the same on every rank
        self.optimizer = optimizer
        self._check_moments(optimizer)
        self.in_flight = None  # a fresh θ_global: nothing of another binding is under way
        if self.delay > 0 and self.exchange and self.world_size > 1 and self.exchange_group is None:
            # The exchanges get a process group of their own (the same ranks, in order): NCCL runs the collectives of
            # one group in order, and the next steps' norm all-reduce must not queue behind an exchange under way.
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self.exchange_group = dist.new_group(ranks)
        with torch.no_grad():
            self.global_params = {n: p.detach().to(self.dtype, copy=True) for n, p in self.params.items()}
            keep = self.outer_momentum > 0
            self.momentum = {n: torch.zeros_like(g) for n, g in self.global_params.items()} if keep else {}
            if self.pending is not None:
                self._apply(self.pending)
                self.pending = None
        logger.info(
            "GRPO sync every %d steps: %s, world size %d, %d fragments of %s entries, outer lr %g momentum %g, ramp %s, "
            "delay %d (mix %g), θ_global in %s, optimizer moments averaged: %s.",
            self.every,
            "exchange" if self.exchange else "no exchange (the outer step only)",
            self.world_size,
            len(self.fragments),
            "/".join(str(f.numel) for f in self.layouts),
            self.outer_lr,
            self.outer_momentum,
            "on" if self.ramp else "off",
            self.delay,
            self.mix,
            str(self.dtype).replace("torch.", ""),
            self.moments,
        )
        return self

    def _check_moments(self, optimizer) -> None:
        """
        With `moments` other than `"none"`: refuse an optimizer that does not keep them as fp32 tensors
        ([`~grpo_hf.optim.moments.averaging_refusal`]).
        """
        field = f"grpo_sync_moments={self.moments!r}"
        for which in SYNC_MOMENTS[self.moments]:
            if optimizer is None:
                raise ConfigError(f"{field} averages the optimizer's moments: bind the optimizer that steps.")
            refusal = averaging_refusal(optimizer, which)
            if refusal is not None:
                adam_key = "exp_avg" if which == "first" else "exp_avg_sq"
                raise ConfigError(
                    f"{field} averages the optimizer's {which} moment ({adam_key} in AdamW), which {refusal}. Use "
                    "torch's AdamW, grpo_sync_moments='second' (or 'none'), or a grpo_optimizer_state that keeps it in fp32."
                )

    # --- per step ---
    def _collectives(self) -> Collectives:
        return Collectives(self)

    def _device_tensor(self, values: torch.Tensor) -> torch.Tensor:
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        return values.to(device)

    def agree_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """
        Per-group gradient norms every rank shares between syncs: the RMS over ranks of the local norms (one
        all-reduce of their squares in float64); a NaN or an Inf on any rank reaches every rank. As is without an
        exchange (DDP's all-reduce, or one process, made them identical).
        """
        if not self.exchange or self.world_size == 1:
            return norms
        return (self._all_reduce_mean(norms.double() ** 2)).sqrt().to(norms.dtype)

    def agree_mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of per-group `values` (float64; e.g. the importance coherence); as is without exchange."""
        if not self.exchange or self.world_size == 1:
            return values
        return self._all_reduce_mean(values.double()).to(values.dtype)

    def _all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        summed = self._collectives().all_reduce(self._device_tensor(values.clone())).cpu()
        self.stats.bytes_sent += allreduce_bytes(8 * values.numel(), self.world_size)
        self.stats.hook_ms += (time.perf_counter() - start) * 1000
        return summed / self.world_size

    def end_step(self, last: bool = False) -> float:
        """
        Close an optimizer step (call it after `optimizer.step()`): sync the fragments due ([`fragments_due`]; every
        fragment when `last`), count the step. Returns the bytes this rank sent in the step.

        With `delay > 0`, after the ramp and before the last step, a due fragment's exchange is only started (its bytes
        count in this step) and applied `delay` steps later. The exchange under way is applied first when it is due,
        when another fragment is due, and at the last step, whose sync then waits at once: no exchange outlives
        training.
        """
        start = time.perf_counter()
        self.step += 1
        due = fragments_due(self.step, self.every, len(self.fragments), self.ramp)
        if last:
            due = list(range(len(self.fragments)))
        if not self.exchange and self.world_size > 1:  # the control: DDP all-reduced the gradients in fp32
            self.stats.bytes_sent += allreduce_bytes(4 * sum(self.numels.values()), self.world_size)
        if self.in_flight is not None and (due or self.in_flight.due <= self.step):
            self._apply_in_flight()
        if len(due) == 1 and self.delay > 0 and not last and not self._in_ramp():
            self.in_flight = self._start_exchange(due[0])
        elif due:
            self._sync(due)
        self.stats.baseline(sum(self.numels.values()), self.world_size)
        self.stats.hook_ms += (time.perf_counter() - start) * 1000
        return self._close(count_step=True)

    def finish(self) -> float:
        """
        Sync every fragment that took local steps since its last sync (training stopped before its last step, e.g.
        by a callback), after applying the exchange under way; not an optimizer step. Returns the bytes sent.
        """
        if not self.params or self.in_sync:
            return 0.0
        start = time.perf_counter()
        if self.in_flight is not None:
            self._apply_in_flight()
        self._sync([f for f, last in enumerate(self.last_sync) if last != self.step])
        self.stats.hook_ms += (time.perf_counter() - start) * 1000
        return self._close(count_step=False)

    def _in_ramp(self) -> bool:
        points = ramp_points(self.every) if self.ramp else []
        return bool(points) and self.step <= points[-1]

    def _close(self, count_step: bool) -> float:
        record, self.stats = self.stats, StepStats()
        self.traffic.close_step(record, optimizer_step=count_step)
        return record.bytes_sent

    def _count_sync(self, fragment: _Fragment) -> None:
        self.stats.kept += fragment.numel
        self.traffic.count(syncs=1)

    def _warn_nonfinite(self, dropped: str) -> None:
        self.traffic.count(nonfinite_syncs=1)
        self._warn_once(
            "nonfinite",
            f"GRPO sync at step {self.step}: a rank's model moved to NaN/Inf (or beyond 2**60) since the last sync; "
            f"every rank restarts the fragment from θ_global ({dropped}).",
        )

    @torch.no_grad()
    def _sync(self, due: list[int]) -> None:
        """Steps 3-6 of the module docstring for the fragments `due`, one after the other (work memory: one)."""
        comm, world_size = self._collectives(), self.step_world_size
        keys = SYNC_MOMENTS[self.moments] if self.optimizer is not None else ()
        for fragment in (self.layouts[f] for f in due):
            dense, rows = self._deltas(fragment)
            # the moments to average join the NaN/Inf check (read in place): set, the flag leaves them alone
            moments = [t for key in keys if world_size > 1 for held in self._moments(fragment, key) for t in held]
            unsafe = not all_safe([dense, *rows, *moments])
            del moments
            if world_size > 1:
                flag = self._device_tensor(torch.tensor([int(unsafe)], dtype=torch.int64))
                unsafe = bool(comm.all_reduce(flag, op=dist.ReduceOp.MAX).item())
                self.stats.bytes_sent += allreduce_bytes(FLAG_BYTES, world_size)
            if unsafe:
                self._warn_nonfinite("its local steps are dropped")
            else:
                if world_size > 1:
                    rows = [self._exchange(comm, fragment, run, row) for run, row in zip(fragment.runs, rows)]
                    if dense.numel():
                        comm.all_reduce(dense)
                        dense /= world_size
                        self.stats.bytes_sent += allreduce_bytes(4 * dense.numel(), world_size)
                self._outer_step(fragment, dense, rows)
            del dense, rows
            for name in fragment.names:
                self.params[name].copy_(self.global_params[name])
            if keys and world_size > 1 and not unsafe:
                self._average_moments(comm, fragment, keys)
            self.last_sync[fragment.index] = self.step
            self._count_sync(fragment)

    def _moments(self, fragment: _Fragment, which: str) -> list[list[torch.Tensor]]:
        """
        The tensors that hold the optimizer's `which` moment of each of the fragment's parameters (`[]` for a parameter
        without state: it never had a gradient, on every rank under DDP, which agrees on the unused parameters).
        """
        return [moment_tensors(self.optimizer, self.params[name], which) for name in fragment.names]

    def _average_moments(self, comm: Collectives, fragment: _Fragment, keys: tuple[str, ...]) -> None:
        """
        Average the optimizer's moments `keys` of the fragment's parameters over the ranks, in place: per moment, the
        tensors that hold it flat in one fp32 row (zeros for a parameter without state), one all-reduce, divided by
        `W` and copied back. Every rank then holds the same bits. Work memory: one row at a time.
        """
        world_size = comm.world_size
        device = next(iter(self.params.values())).device
        for key in keys:
            tensors = self._moments(fragment, key)
            sizes = [moment_numel(self.optimizer, self.params[name], key) for name in fragment.names]
            flat = torch.zeros(sum(sizes), device=device)
            for start, held in zip(itertools.accumulate([0, *sizes]), tensors):
                for moment in held:
                    flat[start : start + moment.numel()].copy_(moment.reshape(-1))
                    start += moment.numel()
            comm.all_reduce(flat)
            flat /= world_size
            self.stats.bytes_sent += allreduce_bytes(4 * flat.numel(), world_size)
            for start, held in zip(itertools.accumulate([0, *sizes]), tensors):
                for moment in held:
                    moment.copy_(flat[start : start + moment.numel()].view_as(moment))
                    start += moment.numel()
            del flat

    # --- overlap (delay > 0) ---
    @torch.no_grad()
    def _start_exchange(self, index: int) -> _Exchange:
        """
        Steps 3-4 of the module docstring for fragment `index`, started and not waited for: `Δ`, then the flag's
        all-reduce, the messages' all-gathers and the dense all-reduce under way. The residuals stay as they are until
        [`_complete`]. A `Δ` that is not safe here is sent as zeros (the agreed flag then discards the exchange).
        """
        fragment, world_size = self.layouts[index], self.step_world_size
        exchange = _Exchange(index, self.step, self.step + self.delay)
        exchange.dense, exchange.rows = self._deltas(fragment)
        exchange.unsafe = not all_safe([exchange.dense, *exchange.rows])  # this rank's; completed with the agreed one
        if world_size > 1:
            if exchange.unsafe:
                for tensor in (exchange.dense, *exchange.rows):
                    tensor.zero_()
            comm = exchange.comm = Collectives(self, group=self.exchange_group)
            flag = self._device_tensor(torch.tensor([int(exchange.unsafe)], dtype=torch.int64))
            exchange.flag = comm.start_all_reduce(flag, op=dist.ReduceOp.MAX)
            self.stats.bytes_sent += allreduce_bytes(FLAG_BYTES, world_size)
            exchange.gathers = [
                self._start_run(comm, fragment, run, row, tag=tag, in_place=False)
                for tag, (run, row) in enumerate(zip(fragment.runs, exchange.rows))
            ]  # a tag per run: their send/recv pairs are under way at once
            if exchange.dense.numel():
                exchange.dense_sum = comm.start_all_reduce(exchange.dense)
                self.stats.bytes_sent += allreduce_bytes(4 * exchange.dense.numel(), world_size)
        self._count_sync(fragment)
        return exchange

    @torch.no_grad()
    def _complete(self, exchange: _Exchange) -> None:
        """
        Wait for `exchange`'s collectives; keep the agreed flag and the mean `Δ̄` by parameter name, and, unless the
        flag is set, make the new residuals the fragment's. Nothing else changes: the outer step waits for
        [`_apply_in_flight`].
        """
        if exchange.completed:
            return
        fragment, world_size = self.layouts[exchange.fragment], self.step_world_size
        if exchange.comm is not None:
            exchange.comm.stats = self.stats  # the time spent waiting counts in the step that waits
            exchange.unsafe = bool(exchange.flag.wait().item())
            gathered = [started.wait() for started, _ in exchange.gathers]
            if exchange.dense_sum is not None:
                exchange.dense_sum.wait()
                exchange.dense /= world_size
            if not exchange.unsafe:
                for run, row, parts, (_, residual) in zip(fragment.runs, exchange.rows, gathered, exchange.gathers):
                    spec, slots, _ = run
                    self.residuals.replace((OUTER_MODE, fragment.index, spec.bits), slots, residual)
                    self._decode_run(run, row, parts)
        exchange.delta = self._by_name(fragment, exchange.dense, exchange.rows)
        exchange.comm = exchange.flag = exchange.dense_sum = exchange.dense = None
        exchange.rows, exchange.gathers = [], []

    @torch.no_grad()
    def _apply_in_flight(self) -> None:
        """
        Steps 5 and 6 for the exchange under way (completed first when needed): the outer step on `Δ̄`, then the
        fragment's parameters merged with `θ_global` ([`merge_with_global`]); with the flag set, the restart from
        `θ_global` instead.
        """
        exchange, self.in_flight = self.in_flight, None
        self._complete(exchange)
        fragment = self.layouts[exchange.fragment]
        if exchange.unsafe:
            self._warn_nonfinite("its local steps, those taken while the exchange ran included, are dropped")
            for name in fragment.names:
                self.params[name].copy_(self.global_params[name])
            self.last_sync[fragment.index] = self.step
            return
        for name, delta in exchange.delta.items():
            self._step_one(name, delta)
        for name in fragment.names:
            param = self.params[name]
            param.copy_(merge_with_global(param.detach(), self.global_params[name], self.mix))
        if self.mix == 0:  # the parameters are θ_global
            self.last_sync[fragment.index] = self.step

    def _by_name(self, fragment: _Fragment, dense: torch.Tensor, rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fragment's flat per-parameter views of its dense tensor and its codec rows."""
        views, offset = {}, 0
        for name in fragment.dense:
            views[name] = dense[offset : offset + self.numels[name]]
            offset += self.numels[name]
        for (_, slots, _), row in zip(fragment.runs, rows):
            for name, start, numel in slots:
                views[name] = row[start : start + numel]
        return views

    def _deltas(self, fragment: _Fragment) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`Δ = θ_global − θ_local` of the fragment: its dense tensors flat, and one padded fp32 row per codec run."""
        device = next(iter(self.params.values())).device

        def delta(name, out):
            torch.sub(self.global_params[name].view(-1).float(), self.params[name].detach().view(-1).float(), out=out)

        dense = torch.empty(sum(self.numels[n] for n in fragment.dense), device=device)
        offset = 0
        for name in fragment.dense:
            delta(name, dense[offset : offset + self.numels[name]])
            offset += self.numels[name]
        rows = []
        for _, slots, length in fragment.runs:
            row = torch.zeros(length, device=device)
            for name, start, numel in slots:
                delta(name, row[start : start + numel])
            rows.append(row)
        return dense, rows

    def _exchange(self, comm: Collectives, fragment: _Fragment, run, row: torch.Tensor) -> torch.Tensor:
        """
        Encode one run's `Δ` with error feedback and exchange it: the mean `Δ̄`, in `row`. Below
        `OWNER_MIN_WORLD_SIZE` ranks every rank's message is all-gathered and decoded; from it the owners reduce
        ([`_owner_exchange`]).
        """
        if comm.world_size >= OWNER_MIN_WORLD_SIZE:
            return self._owner_exchange(comm, fragment, run, row)
        started, _ = self._start_run(comm, fragment, run, row, in_place=True)
        return self._decode_run(run, row, started.wait())

    # --- owner reduction (OWNER_MIN_WORLD_SIZE ranks and more; blocking syncs) ---
    def _owner_exchange(self, comm: Collectives, fragment: _Fragment, run, row: torch.Tensor) -> torch.Tensor:
        """
        Step 4 with owners (the per-step hook's `allreduce` mode): this rank's codes of each owner's blocks go to
        their owner (all-to-all); each owner averages the `W` contributions and compresses the mean again with its
        own residual; the owners' messages are all-gathered and every rank decodes them, in owner order, into `row`.
        The collectives and their bytes: [`~grpo_hf.compression.exchange.exchange_with_owners`].
        """
        world_size, rank = comm.world_size, comm.rank
        send, sizes = self._to_owners(fragment, run, row, world_size)

        def reduce_into(contributions: list, message: torch.Tensor) -> None:
            self._reduce_owned(fragment, run, contributions, world_size, rank, message)

        messages, nbytes = exchange_with_owners(comm, send, sizes, reduce_into)
        self.stats.bytes_sent += nbytes
        return self._from_owners(fragment, run, row, messages, world_size)

    def _owned(self, fragment: _Fragment, run, world_size: int, device) -> list[tuple]:
        """Per rank, the blocks of the run's row it owns: `(ranges, index)` as the exchange's functions take them."""
        return owned_blocks(fragment.owners[run[0].bits], world_size, device)

    def _to_owners(self, fragment: _Fragment, run, row: torch.Tensor, world_size: int):
        """
        The sender's half: `Δ + residual` of the run encoded in one kernel call (the residual replaced in place), cut
        into one message per owner. Returns the send buffer (the `W` messages one after the other) and their sizes.
        """
        spec, slots, length = run
        nblocks = length // spec.block_size
        owned = self._owned(fragment, run, world_size, row.device)
        sizes = [message_nbytes(spec, index.numel()) for _, index in owned]
        key = (OUTER_MODE, fragment.index, spec.bits)
        residual = self.residuals.row(key, slots, length, row.device).view(nblocks, spec.block_size)
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=row.device)
        _, new_residual = encode_to_owners(self.kernels, spec, row.view(nblocks, spec.block_size), residual, owned,
                                           messages=split_messages(send, sizes))  # fmt: skip
        self.residuals.replace(key, slots, new_residual)
        return send, sizes

    def _reduce_owned(self, fragment: _Fragment, run, contributions: list, world_size: int, rank: int,
                      message: torch.Tensor) -> None:  # fmt: skip
        """
        The owner's half: the `W` contributions to the blocks `rank` owns (rank order) averaged and compressed again
        with its owner residual (replaced in place), into `message`. Nothing when it owns no block of the run.
        """
        spec = run[0]
        owners = fragment.owners[spec.bits]
        slots = owners.owned_slots(world_size, rank)
        count = owners.owned_blocks(world_size)[rank].numel()
        if not count:
            return
        key = (OUTER_MODE, fragment.index, spec.bits, world_size, rank)
        residual = self.owner_residuals.row(key, slots, count * spec.block_size, message.device)
        _, new_residual = reduce_owned(self.kernels, spec, contributions, residual.view(count, spec.block_size),
                                       message=message)  # fmt: skip
        self.owner_residuals.replace(key, slots, new_residual)

    def _from_owners(self, fragment: _Fragment, run, row: torch.Tensor, messages: list, world_size: int):
        """Every rank's last half: the owners' messages (owner order) decoded into `row`, the mean `Δ̄`."""
        spec, _, length = run
        nblocks, block = length // spec.block_size, spec.block_size
        owned = self._owned(fragment, run, world_size, row.device)
        # the decode's temporaries: a few chunks
        decode_from_owners(self.kernels, spec, messages, owned, nblocks, out=row.view(nblocks, block),
                           max_blocks=max(1, ENCODE_CHUNK // block))  # fmt: skip
        return row

    def _start_run(self, comm: Collectives, fragment: _Fragment, run, row: torch.Tensor, tag: int = 0,
                   in_place: bool = True):  # fmt: skip
        """
        Encode one run's `Δ + residual` into this rank's message and start the all-gather of the `W` messages. Returns
        the `Started` all-gather and, unless `in_place` (the residual replaced at once), the new residual row.
        """
        spec, slots, length = run
        world_size, block = comm.world_size, spec.block_size
        nblocks = length // block
        size = message_nbytes(spec, nblocks)
        gathered = torch.empty(world_size * size, dtype=torch.uint8, device=row.device)
        message = gathered[comm.rank * size : (comm.rank + 1) * size]
        key = (OUTER_MODE, fragment.index, spec.bits)
        residual = self.residuals.row(key, slots, length, row.device).view(nblocks, block)
        _, new_residual = encode(self.kernels, spec, row.view(nblocks, block), residual, message=message,
                                 in_place=in_place)  # fmt: skip
        if in_place:
            self.residuals.replace(key, slots, new_residual)
            new_residual = None
        started = comm.start_all_gather(message, gathered, tag=tag)
        self.stats.bytes_sent += allgather_bytes(size, world_size)
        return started, new_residual

    def _decode_run(self, run, row: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """Decode the `W` gathered messages (`[W, size]`, rank order) of one run into `row`: the mean `Δ̄`."""
        spec, _, length = run
        block = spec.block_size
        nblocks, world_size = length // block, parts.shape[0]
        # the eager decode's temporaries: a few chunks, not a few fragments
        decode(self.kernels, spec, [parts[r] for r in range(world_size)], nblocks, divide=world_size,
               out=row.view(nblocks, block), max_blocks=max(1, ENCODE_CHUNK // block))  # fmt: skip
        return row

    def _outer_step(self, fragment: _Fragment, dense: torch.Tensor, rows: list[torch.Tensor]) -> None:
        offset = 0
        for name in fragment.dense:
            self._step_one(name, dense[offset : offset + self.numels[name]])
            offset += self.numels[name]
        for (_, slots, _), row in zip(fragment.runs, rows):
            for name, start, numel in slots:
                self._step_one(name, row[start : start + numel])

    def _step_one(self, name: str, delta: torch.Tensor) -> None:
        global_param = self.global_params[name]
        momentum = self.momentum.get(name)
        outer_step(global_param.view(-1), delta, None if momentum is None else momentum.view(-1), self.outer_lr,
                   self.outer_momentum)  # fmt: skip

    # --- the global model for evaluation and saving ---
    @contextlib.contextmanager
    def global_weights(self):
        """
        Within the block the parameters hold `θ_global` (evaluation, `save_model`, `predict`); this rank's local
        parameters come back after it. Nothing is copied when they are `θ_global` already, nor before [`bind`].
        """
        if not self.global_params or self.in_sync or self.swapped is not None:
            yield
            return
        with torch.no_grad():
            self.swapped = {name: p.detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                p.copy_(self.global_params[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self.swapped[name])
            self.swapped = None

    # --- statistics ---
    def pop_stats(self) -> dict[str, float]:
        """
        Metrics of the optimizer steps since the last call (then cleared); `{}` when there were none:
        `grpo/comm/bytes_sent` (per rank and step, averaged), `grpo/comm/bytes_peak` (the most of any one step),
        `grpo/comm/bytes_dense_fp32` / `_fp16` (DDP's per-step all-reduce), `grpo/comm/ratio_fp32` / `_fp16`,
        `grpo/comm/syncs` (fragments synced), `grpo/density` (entries exchanged per step over trainable entries),
        `grpo/sparsity`, and `grpo/comm/hook_ms` (time in the syncs per step; measured).
        """
        return self.traffic.pop_stats()

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): `steps`, `syncs`, `nonfinite_syncs`, `bytes_sent`,
        `bytes_peak`, `bytes_dense_fp32` / `_fp16`, `ratio_fp32` / `_fp16`, `density`, `hook_ms`, `comm_ms`, `kept`,
        `numel` (`dense_steps` and `nonfinite_steps` are 0: the keys of the per-step hook's totals).
        """
        return self.traffic.totals()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this state holds: `global` (`θ_global`), `momentum` and `residuals`."""

        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "global": size(self.global_params.values()),
            "momentum": size(self.momentum.values()),
            "residuals": self.residuals.nbytes() + self.owner_residuals.nbytes(),
        }

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time `key` is seen."""
        self._warn_once(key, message)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # --- checkpointing ---
    def settings(self) -> dict:
        return {
            "every": self.every,
            "fragments": len(self.fragments),
            "ramp": self.ramp,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "dtype": str(self.dtype).replace("torch.", ""),
            "exchange": self.exchange,
            "delay": self.delay,
            "mix": self.mix,
            "moments": self.moments,
        }

    def state_dict(self) -> dict:
        """
        What a resumed run needs to continue bit for bit, on cpu: the step, each fragment's last sync, the settings
        and fragments; on rank 0 only `θ_global` and the momentum (the same on every rank); on every rank its own bf16
        residuals (`residuals`; from 3 ranks also `owner_residuals`: per parameter name, the chunk of it this rank
        owns), its local parameters and its optimizer's state (the Trainer saves rank 0's only).

        With an exchange under way (`delay > 0`) it is waited for here, not applied: the state holds its agreed flag
        and mean `Δ̄` (`in_flight`), and the outer step and merge still happen at its due step, in the resumed run as
        in one that was not interrupted. No collective under way is saved, and saving does not change the training.
        """

        def cpu(tensors):
            return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}

        if self.in_flight is not None:
            self._complete(self.in_flight)  # before the residuals are read: the exchange's new ones are committed
        return {
            "version": STATE_VERSION,
            "mode": OUTER_MODE,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "last_sync": list(self.last_sync),
            "hook_calls": self.hook_calls,
            "settings": self.settings(),
            "fragments": [list(names) for names in self.fragments],
            "global": cpu(self.global_params) if self.rank == 0 else {},
            "momentum": cpu(self.momentum) if self.rank == 0 else {},
            "residuals": self.residuals.state_dict(),
            "owner_residuals": self.owner_residuals.state_dict(),
            "local": cpu(self.params),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "totals": self.traffic.state_dict(),
            "in_flight": self.in_flight.state_dict() if self.in_flight is not None else None,
        }

    def load_state_dict(self, state_dict: dict | None, shared: dict | None = None) -> None:
        """
        Restore [`state_dict`] at the next [`bind`] (at once when bound already). `state_dict` is this rank's saved
        state, `shared` rank 0's (`θ_global`, momentum; defaults to `state_dict`). `state_dict=None` restarts every
        rank from rank 0's `θ_global` with its momentum, step and schedule, without residuals or local steps (a
        checkpoint of another world size; the owner residuals, cut per world size, go with the residuals).
        """
        shared = state_dict if shared is None else shared
        for saved in (state_dict, shared):
            if saved is not None and saved.get("version") != STATE_VERSION:
                raise ValueError(
                    f"outer-sync state of version {saved.get('version')}, expected {STATE_VERSION}: written by another "
                    "grpo_hf version; resume with that version or from a checkpoint written by this one."
                )
        names = {name for names in self.fragments for name in names}
        if set(shared["global"]) != names:
            other = sorted(set(shared["global"]) ^ names)
            raise ValueError(
                f"the checkpoint's global model and this run's trainable parameters differ (e.g. {other[0]}); resume "
                "with the same model and adapters as the run that wrote it."
            )
        same_fragments = state_dict is not None and state_dict["fragments"] == self.fragments
        self.pending = {"own": state_dict, "shared": shared, "same_fragments": same_fragments}
        self.in_flight = None
        self.step = int(shared["step"])
        if state_dict is None:  # every rank restarts from θ_global: in sync
            self.last_sync = [self.step] * len(self.fragments)
        elif len(state_dict["last_sync"]) == len(self.fragments):
            self.last_sync = list(state_dict["last_sync"])
        else:  # other fragments: each holds local steps since the oldest saved sync
            self.last_sync = [min(state_dict["last_sync"])] * len(self.fragments)
        self.residuals.load_state_dict(state_dict.get("residuals", {}) if state_dict is not None else {})
        self.owner_residuals.load_state_dict(state_dict.get("owner_residuals", {}) if state_dict is not None else {})
        source = state_dict if state_dict is not None else shared
        self.hook_calls = int(source.get("hook_calls", 0))
        self.traffic.load_state_dict(source.get("totals", {}))
        self.stats = StepStats()
        if self.params:
            with torch.no_grad():
                self._apply(self.pending)
            self.pending = None

    def _apply(self, pending: dict) -> None:
        own, shared = pending["own"], pending["shared"]
        for name, value in shared["global"].items():
            self.global_params[name].copy_(value.view_as(self.global_params[name]))
        for name in self.momentum:
            if name in shared["momentum"]:
                self.momentum[name].copy_(shared["momentum"][name].view_as(self.momentum[name]))
        saved = (own if own is not None else shared).get("in_flight")
        exchange = self._saved_exchange(saved) if saved is not None else None
        if exchange is not None and not pending.get("same_fragments"):
            # another world size (every rank restarts from θ_global) or other fragments: its outer step now, no merge
            if not exchange.unsafe:
                for name, delta in exchange.delta.items():
                    self._step_one(name, delta)
            exchange = None
        self.in_flight = exchange
        source = own["local"] if own is not None else None
        for name, p in self.params.items():
            p.copy_(source[name].view_as(p) if source is not None else self.global_params[name])
        if own is not None and self.optimizer is not None and own.get("optimizer") is not None:
            self.optimizer.load_state_dict(own["optimizer"])

    def _saved_exchange(self, saved: dict) -> _Exchange:
        """A completed exchange from [`_Exchange.state_dict`], its `Δ̄` on the parameters' device."""
        exchange = _Exchange(int(saved["fragment"]), int(saved["started"]), int(saved["due"]))
        exchange.unsafe = bool(saved["unsafe"])
        exchange.delta = {name: t.to(self.params[name].device) for name, t in saved["delta"].items()}
        return exchange

    def __getstate__(self):
        """
        Pickle without the process group, the parameters, the optimizer and the kernels (bind the copy again); an
        exchange under way is waited for first (as by [`state_dict`]).
        """
        if self.in_flight is not None and self.params:
            self._complete(self.in_flight)
        dropped = ("process_group", "exchange_group", "params", "names", "kernels", "optimizer", "layouts", "swapped")
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in dropped}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.process_group = self.exchange_group = self.kernels = self.optimizer = self.swapped = None
        self.params, self.names, self.layouts = {}, {}, []

    def __repr__(self) -> str:
        return (
            f"OuterSyncState(every={self.every}, fragments={len(self.fragments)}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, ramp={self.ramp}, exchange={self.exchange}, delay={self.delay}, "
            f"mix={self.mix}, moments={self.moments!r}, step={self.step}, "
            f"world_size={self.world_size})"
        )


def _unwrap_optimizer(optimizer):
    """The torch optimizer under Accelerate's `AcceleratedOptimizer` (itself an `Optimizer`); `None` stays `None`."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def local_gradient_hook(state: OuterSyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """
    DDP communication hook of the inner steps: no collective; the future holds the bucket's own buffer, so every rank
    steps on its own gradients (see the module docstring). The module does not use `from __future__ import
    annotations`: DDP compares these annotations with `dist.GradBucket` and `torch.futures.Future[torch.Tensor]`.
    """
    buffer = bucket.buffer()
    future = torch.futures.Future(devices=[buffer.device]) if buffer.device.type != "cpu" else torch.futures.Future()
    future.set_result(buffer)
    state.hook_calls += 1
    return future


__all__ = [
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "DEFAULT_SYNC_DELAY",
    "DEFAULT_SYNC_MIX",
    "DEFAULT_SYNC_MOMENTS",
    "DEFAULT_SYNC_RAMP",
    "OUTER_DTYPES",
    "OUTER_MODE",
    "OuterSyncState",
    "SYNC_MOMENTS",
    "fragment_offsets",
    "fragments_due",
    "local_gradient_hook",
    "merge_with_global",
    "outer_step",
    "pack_fragments",
    "ramp_points",
]
