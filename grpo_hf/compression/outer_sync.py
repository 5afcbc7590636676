"""`OuterSyncState` and `local_gradient_hook`: sync every H steps (DiLoCo), GRPO's groups as Streaming-DiLoCo fragments.

With `grpo_sync_every = H > 1`, DDP exchanges nothing at the inner steps: [`local_gradient_hook`] hands every bucket
back as it is, so each rank steps its own optimizer on its own gradients. Every `H` optimizer steps (per fragment, at
its own offset) the ranks agree on one global model `θ_global` through the codec of the per-step hook, with error
feedback, and an outer SGD step with Nesterov momentum. Read it as torchft's `local_sgd.py` reads: this module's
state keeps the schedule, the agreed norms, the statistics and the checkpoints; each fragment (`fragment.py`) owns its
tensors and takes the algorithm's steps; the exchange (`exchange.py`) and the byte formulas (`traffic.py`) are the
per-step hook's.

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
3. **Pseudo-gradient.** Fragment by fragment, one row at a time, `Δ = θ_global − θ_local` (fp32). One flag all-reduce: if
   any rank's `Δ` holds a NaN, an Inf or a value at or above `2**60`, every rank restarts the fragment from
   `θ_global` (its local progress since the last sync is dropped; momentum and residuals, the owners' included,
   are left unchanged).
4. **Exchange** ([`~grpo_hf.compression.compression_plan`] decides each tensor's spec): tensors with a spec (16, 8,
   4 or 2 bits, or ternary; `grpo_sync_bits`) are encoded by their code ([`~grpo_hf.compression.codes.code_for`]: the per-step hook's kernel, `Δ +
   residual`, block absmax, codes, new bf16 residual in place), one padded row per setting (the whole spec). Then, by the world size `W`:
   - `W = 2`: the messages are all-gathered and every rank decodes the `W` of them in rank order, its own included,
     into the mean `Δ̄`.
   - `W >= 3` (`OWNER_MIN_WORLD_SIZE`; blocking syncs): owner reduction, the per-step hook's `allreduce` mode
     (`Exchange.reduce_with_owners`): chunk `j` of each tensor's blocks is owned by rank `(j + crc32(name)) mod W`;
     each owner averages the `W` contributions to its blocks and encodes the mean again with its own error feedback
     (the owner residual, of the blocks it owns only); the owners' messages are all-gathered and decoded in owner
     order. Both ways every rank decodes the same messages in the same order: the same bits of `Δ̄` on every rank.
     At `W = 2` both would send the same bytes, and the owners would quantize `Δ̄` twice.
   - The chunked top-k code (`grpo_sync_density < 1`, SparseLoCo, `codes/chunk_topk.py`) is all-gathered whatever
     `W`: each rank's `k` entries of every chunk of `C`, decoded in rank order into the mean of what the ranks sent.
   Tensors without a spec (norms, biases, `grpo_bits=32`, `grpo_compression="none"`) go through one fp32
   all-reduce.
5. **Outer step** ([`outer_step`], torch's `SGD(nesterov=True)` on `Δ̄`): `m = μ m + Δ̄`, `θ_global -= lr (Δ̄ + μ m)`;
   with `μ = 0` the momentum is not kept.
6. **Restart.** Every rank copies `θ_global` into its parameters in place (never `vector_to_parameters`, which would
   make the parameters views of a reused buffer).
7. **Moments** (`moments="second"` or `"both"`, blocking syncs only): the inner optimizer's `exp_avg_sq` (and
   `exp_avg`) of the fragment's parameters are averaged over the ranks in place in `optimizer.state`: per moment one
   fp32 row of the fragment (as its dense tensors), one all-reduce, divided by `W`. They join step 3's NaN/Inf check;
   with the flag set they are left as they are.

## Overlap (`delay = τ > 0`, Streaming DiLoCo)

Without delay the exchange of step 4 blocks the step that syncs. With `τ > 0` (after the ramp, whose syncs stay
blocking) a due fragment's exchange is only started at its sync step, and the next `τ` inner steps compute while it
runs; `τ` steps later its outer step is applied and the fragment merged with the local parameters, `(1 − α) θ_global +
α θ_local` (`α = mix`). What it keeps the same (bits, NaN/Inf, bytes) and when it is waited for: `fragment.py`.

## Bytes per rank (ring model, [`~grpo_hf.compression.traffic`]; `grpo/comm/bytes_sent`)

- Every step: `2 (W − 1) / W × 8 G` for the agreed group norms (`G` groups).
- Per fragment synced: `2 (W − 1) / W × 8` for the flag, plus `2 (W − 1) / W × 4 n_dense` for its dense tensors,
  plus with `moments` `2 (W − 1) / W × 4 n` per moment averaged (`n` the fragment's entries),
  plus for its codes (`s` = `4 + bits × 128 / 8` bytes per block of 128 entries at 4, 8 and 16 bits, `4 + 32` at 2
  bits and `4 + 26` in trits, 5 per byte, for ternary; padded to 16 bytes per message):
  - `W = 2`, and delayed exchanges: `(W − 1) × s`, the all-gather of the messages;
  - `W >= 3`, blocking: `(W − 1) / W × S + (W − 1) × s_owner` ([`~grpo_hf.compression.traffic.owner_reduction_bytes`]):
    the all-to-all of this rank's `W` parts (`S` bytes in all, about `s`) and the all-gather of the owners' messages
    (about `s / W` each, padded to the longest). About `2 (W − 1) / W × s`: never more than `2 s`, whatever `W`.
  - the chunked top-k code, any `W`: `(W − 1) × s`, the all-gather, with `s` = `4 + k (2 + log2 C) / 8` bytes per
    chunk of `C` entries (`n` chunks: `4 n + ceil(2 n k / 8) + ceil(log2(C) n k / 8)`, padded to 16 bytes;
    [`~grpo_hf.compression.codes.chunk_topk.chunk_topk_nbytes`]). It grows linearly with `W`: `3 s` at `W = 4`
    where owner reduction would send about `1.5 s`; at 64 of 4,096 entries `s` is 116 bytes per chunk, 0.23 bits per
    entry, about 19 times less than the 4-bit codes' 2,176.
- `grpo/comm/bytes_peak`: the most bytes of any one step of the window; the per-step average is `bytes_sent`.
- The baselines `grpo/comm/bytes_dense_fp32` / `_fp16`: DDP's all-reduce of every gradient at every step.

## Warnings

- Attach the state ([`OuterSyncState.attach`]: bind and register the hook) once per DDP object, before the first
  backward; the plan, the fragments and the settings must be identical on every rank.
- Memory per trainable entry and rank: `θ_global` and the momentum (4 bytes each, 2 in `bfloat16`; no momentum when
  `μ = 0`), the bf16 residual of the compressed tensors (2 bytes; from 3 ranks also the owner residual of the blocks
  it owns, `2 / W` bytes), and during a sync the fragment's `Δ` (4 bytes per entry) and the messages (every rank's,
  or about two of them with owners): `F` fragments divide the sync's work memory by `F`.
- Sparse gradients and DeepSpeed are not supported, nor is fp16 mixed precision (its `GradScaler` would skip steps
  on one rank and not on another).

## Replica groups (FSDP2 inside each replica)

With `replicas` ([`~grpo_hf.compression.replicas.ReplicaGroups`]), FSDP2 shards each replica over its `S` ranks and
the sync runs over this rank's replicate group, the `R` ranks holding the same shard index: every step above reads
"the ranks" as that group and "the parameters" as this rank's local shards, `W = R`, and the byte formulas count the
local sizes. What changes: at [`OuterSyncState.bind`] replica 0's shards are broadcast over the replicate group (`θ`
starts identical); between syncs nothing crosses the replicate dimension (the group norms are the replica's own,
FSDP2's shards summed, and [`OuterSyncState.agree_norms`] leaves them; the importance state is averaged at each sync,
[`OuterSyncState.share_at_sync`]); the NaN/Inf flag is agreed within the replica before it is sent, so that every
rank of the world takes the same decision; `θ_global` and the momentum are saved by replica 0's ranks, one file per
shard.
"""

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from ..choices import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_SYNC_DELAY,
    DEFAULT_SYNC_ERROR_DECAY,
    DEFAULT_SYNC_GLOBAL_DEVICE,
    DEFAULT_SYNC_MIX,
    DEFAULT_SYNC_MOMENTS,
    DEFAULT_SYNC_RAMP,
    SYNC_MOMENTS,
)
from ..errors import ConfigError, warn_once
from ..optim.moments import local_tensor
from .codec import all_safe, compile_kernels
from .codes import code_for
from .codes.base import ENCODE_CHUNK
from .communicator import Communicator, ProcessGroupCommunicator, process_rank
from .exchange import Exchange
from .fragment import Fragment, InFlight, check_moments, global_device, merge_with_global, outer_step, pack_fragments
from .replicas import ReplicaGroups, fsdp_modules, local_optimizer_state, reshard
from .schedule import fragment_offsets, fragments_due, ramp_points
from .settings import check_sync_settings
from .spec import CodecSpec
from .sync_checkpoint import STATE_VERSION, apply_saved, load_sync_state, restore_sync_state
from .traffic import StepStats, TrafficStats, allreduce_bytes
from .transport import OUTER_MODE, CommSettings, CommState, SavedComms


logger = logging.getLogger(__name__)

OUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # SYNC_DTYPE_CHOICES as torch dtypes
# From this many ranks a blocking sync's codes go through owners (the per-step hook's `allreduce` mode); at 2 the owners'
# reduce-scatter and all-gather send the bytes of the all-gather, and would quantize `Δ̄` twice.
OWNER_MIN_WORLD_SIZE = 3
# Counted between fault-tolerant replica groups only, logged as `grpo/sync/<name>` (beside `grpo/sync/participants`)
ELASTIC_COUNTERS = ("discarded", "retried", "heals", "taken_over")


# ----------------------------------------------------------------------------------------------------------------
# The state: the schedule, the agreed norms, the statistics, the checkpoints
# ----------------------------------------------------------------------------------------------------------------


class OuterSyncState(CommState):
    r"""
    Settings, schedule, fragments and traffic statistics of the sync every `H` steps (see the module docstring); the
    state [`local_gradient_hook`] is registered with. Each [`~grpo_hf.compression.fragment.Fragment`] owns its
    `θ_global`, momentum, residuals, last sync and exchange in flight; this state decides when each syncs, agrees on
    the group norms between syncs, counts the bytes and assembles the checkpoints.

    Args:
        plan (`dict[str, CodecSpec | None]`):
            Parameter name -> how its `Δ` is sent (`None`: fp32 all-reduce), from
            [`~grpo_hf.compression.compression_plan`]; specs of density 1 whose code is fixed in size (`in_sync`):
            4, 8 or 16 bits, and the sync's 2-bit and ternary codes (`CodecSpec(code="two-bit" or "ternary")`), or of the chunked top-k code
            ([`~grpo_hf.compression.plan.sparse_sync_plan`]).
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
            rank's own `Δ`, exact, and nothing is sent for it: only the outer step is added (the outer-step-only
            control, which separates the outer optimizer's effect from the savings; under DDP its bytes are DDP's fp32
            all-reduce of the gradients at every step).
        process_group (`torch.distributed.ProcessGroup`, *optional*):
            Group to communicate in; the default group when `None`. A convenience for
            `communicator=ProcessGroupCommunicator(process_group)`.
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
        replicas ([`~grpo_hf.compression.replicas.ReplicaGroups`], *optional*):
            FSDP2 shards each replica: the sync runs over this rank's replicate group, on its local shards (see
            "Replica groups" in the module docstring) through their `replicate_communicator`; give no `communicator`
            or `process_group` with them.
        global_device (`str`, *optional*, defaults to `"auto"`):
            Where `θ_global` and the momentum live ([`~grpo_hf.compression.fragment.global_device`]): `"cpu"`
            (pinned when the parameters are on an accelerator), `"parameters"`, or `"auto"` (`"cpu"` on an
            accelerator). The same bits whatever the choice.
        error_decay (`float`, *optional*, defaults to `1.0`):
            `β` in `(0, 1]`: each sync sends the codes of `Δ + β r` and keeps what they did not carry as the new
            residual `r` (SparseLoCo's error-feedback accumulator, with `β = 0.95`); `1` is the error feedback as it
            was, bit for bit. Below 1 a residual entry that is never sent stays bounded (`|Δ| / (1 − β)` for a
            constant `Δ`) instead of growing; what decays away is never sent.
        communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*):
            The way to the wire: every collective of the sync goes through it, or, with `delay > 0`, the exchanges
            through its twin ([`~grpo_hf.compression.communicator.Communicator.duplicate`], made at [`bind`]). `None`:
            a [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`] over `process_group` (or the replicas').
    """

    __slots__ = (
        # --- tuned ---
        "every",
        "outer_lr",
        "outer_momentum",
        "ramp",
        "plan",
        "fragment_names",
        "delay",
        "mix",
        "moments",
        "error_decay",
        # --- seldom tuned ---
        "dtype",
        "exchange",
        "communicator",
        "exchange_communicator",
        "replicas",
        "global_device",
        # --- bound by bind() ---
        "params",
        "fragments",
        "world_size",
        "rank",
        "kernels",
        "optimizer",
        "fsdp_units",
        "share",
        # --- internal state (checkpointed) ---
        "step",
        "hook_calls",
        "pending",
        # --- per step ---
        "stats",
        "swapped",
        # --- statistics ---
        "traffic",
        "participants",
        "kept_members",
        "_warned",
    )
    nonfinite_origin = (
        "They were NaN/Inf as the backward pass made them (the sync every H steps exchanges no gradient; its outer "
        "step would have carried them into the global model)"
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
        replicas: ReplicaGroups | None = None,
        global_device: str = DEFAULT_SYNC_GLOBAL_DEVICE,
        communicator: Communicator | None = None,
        error_decay: float = DEFAULT_SYNC_ERROR_DECAY,
    ):
        if not fragments or any(not names for names in fragments):
            raise ValueError(f"{len(fragments)} fragments, some empty: use 1 to {every} non-empty fragments.")
        check_sync_settings(every, len(fragments), delay, mix, moments, outer_lr, outer_momentum, dtype, global_device,
                            error_decay)  # fmt: skip
        for name, spec in plan.items():
            if spec is not None and not code_for(spec).in_sync:
                raise ValueError(
                    f"{name}: the sync sends every entry of Δ in codes of one size (ternary, 2, 4, 8 or 16 bits, or "
                    f"fp32); got {spec}. Use grpo_compression='quantize' or 'none' and grpo_sync_bits 'ternary', 2, 4, "
                    "8, 16 or 32 (no top-k, nor the per-step 2-bit codes, whose size depends on the data: the sync's "
                    "'ternary' sends their levels)."
                )
        listed = [name for names in fragments for name in names]
        if len(listed) != len(set(listed)):
            raise ValueError("a parameter is in two fragments; build them with pack_fragments.")
        self.plan = dict(plan)
        self.fragment_names = [list(names) for names in fragments]
        self.every, self.outer_lr, self.outer_momentum = int(every), float(outer_lr), float(outer_momentum)
        self.ramp, self.dtype, self.exchange = bool(ramp), OUTER_DTYPES.get(dtype, dtype), bool(exchange)
        self.delay, self.mix, self.moments = int(delay), float(mix), moments
        self.error_decay = float(error_decay)
        self.replicas, self.global_device = replicas, global_device
        if communicator is not None and (process_group is not None or replicas is not None):
            raise ValueError(
                "give a communicator, a process_group or replicas, not two of them (between replica groups the sync "
                "runs over ReplicaGroups.replicate_communicator)."
            )
        if replicas is not None:
            communicator = replicas.replicate_communicator
        self.communicator = communicator if communicator is not None else ProcessGroupCommunicator(process_group)
        self.exchange_communicator: Communicator | None = None  # with delay > 0: the exchanges' own twin
        self.fsdp_units, self.share = [], None
        self.params: dict[str, nn.Parameter] = {}
        self.fragments: list[Fragment] = []
        self.world_size, self.rank = 1, 0
        self.kernels = None
        self.optimizer = None
        self.step = 0
        self.hook_calls = 0
        self.pending: dict | None = None  # a checkpoint's state, applied at bind (the Trainer loads its own first)
        self.stats = StepStats()
        self.swapped: list[torch.Tensor] | None = None
        # dense_steps and nonfinite_steps stay 0: the keys of the per-step hook's totals
        elastic = ELASTIC_COUNTERS if self.communicator.elastic else ()  # fault-tolerant replica groups
        self.traffic = TrafficStats(
            counters=("syncs", *elastic),
            run_counters=("nonfinite_syncs", "dense_steps", "nonfinite_steps"),
            peak=True,
            default_density=0.0,
        )
        self._warned: set[str] = set()
        self.participants: list[int] = []  # between fault-tolerant replica groups: the ranks of each sync kept
        # ... and the replica ids whose local steps the last sync kept (`()`: it was discarded; `None`: not known)
        self.kept_members: tuple[int, ...] | None = None

    # --- building ---
    @classmethod
    def from_settings(cls, settings: CommSettings) -> "OuterSyncState | None":
        """
        The sync every `grpo_sync_every` steps when it is above 1: the `Δ` codec from `settings.plan`, GRPO's groups
        packed into `grpo_sync_fragments` fragments. Under DDP the ranks exchange their `Δ` (unless
        `grpo_sync_outer_only`); on one process only the outer step is added (with a warning). Without an exchange the
        plan becomes dense and the compression `"none"` (in `settings`).

        Under FSDP2 the replicas are replica groups (`grpo_hf.replica_groups`): each FSDP2-sharded over its own ranks,
        syncing their local shards every H steps over their replicate groups; one replica has nothing to sync (a
        warning; the outer step only).

        Raises:
            [`~grpo_hf.errors.ConfigError`]: a layout the sync cannot run over (tensor parallelism, HSDP sharded at load
                time, several replicas in one fault-tolerant launch), too many fragments for the groups, or a group
                file's `bits` / `density` the sync cannot send (the settings' own rules were checked where they were
                made, [`~grpo_hf.compression.settings.transport_settings`]).
        """
        if not settings.syncing:
            return None
        args, engine, sync = settings.args, settings.engine, settings.transport.sync
        communicator, replicas = settings.communicator, settings.replicas  # the wire, built by the builder
        elastic = communicator is not None or (replicas is not None and replicas.replicate_communicator.elastic)
        exchange = (
            engine == "ddp" or (replicas is not None and replicas.replicas > 1) or elastic
        ) and not sync.outer_only
        if not exchange:  # the gradients are averaged every step (DDP) or there is one replica: no Δ codec
            settings.compression = "none"
            settings.plan = {name: None for name in settings.plan}
            if engine == "single" and process_rank(args)[0] == 0:
                logger.warning(
                    f"grpo_sync_every={sync.every} on one process: there is nothing to exchange, so only the outer step "
                    "is added every H steps (the outer-step-only control); no bytes are saved."
                )
        units = [(g.name, g.param_names, [p.numel() for p in g.params]) for g in settings.groups]
        try:
            return cls(
                settings.plan,
                pack_fragments(units, sync.fragments),
                every=sync.every,
                outer_lr=sync.outer_lr,
                outer_momentum=sync.outer_momentum,
                ramp=sync.ramp,
                dtype=OUTER_DTYPES[sync.dtype],
                exchange=exchange,
                delay=sync.delay,
                mix=sync.mix,
                moments=sync.moments,
                replicas=replicas,
                global_device=sync.global_device,
                communicator=communicator,
                error_decay=sync.error_decay,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None

    @property
    def mode(self) -> str:
        return OUTER_MODE

    @property
    def process_group(self):
        """The `torch.distributed` group of a [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`]
        (`None`: the default group, or a communicator of another kind)."""
        return getattr(self.communicator, "group", None)

    @property
    def apart(self) -> bool:
        """Whether the ranks send nothing to each other between syncs (replica groups, FSDP2 inside or fault-tolerant):
        their group norms are their own, and what they keep apart is averaged at each sync ([`share_at_sync`])."""
        return self.replicas is not None or self.communicator.elastic

    @property
    def numel(self) -> int:
        """Trainable entries (this rank's)."""
        return sum(fragment.numel for fragment in self.fragments)

    @property
    def step_world_size(self) -> int:
        """Ranks whose `Δ` differ and are exchanged: the world size, or 1 without an exchange."""
        return self.world_size if self.exchange else 1

    @property
    def last_sync(self) -> list[int]:
        """The step at which each fragment last restarted from `θ_global`."""
        return [fragment.last_sync for fragment in self.fragments]

    @property
    def in_flight(self) -> InFlight | None:
        """The fragment exchange under way or completed and not applied yet (`delay > 0`), if any."""
        return next((f.in_flight for f in self.fragments if f.in_flight is not None), None)

    @property
    def in_sync(self) -> bool:
        """Whether the parameters are `θ_global`: every fragment restarted from it at this step, none in flight."""
        return self.in_flight is None and all(last == self.step for last in self.last_sync)

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        """`θ_global` by parameter name (views of the fragments' rows, shaped as the parameters)."""
        return {name: view for fragment in self.fragments for name, view in fragment.state_by_name()["global"].items()}

    # --- setup ---
    def bind(self, model: nn.Module, optimizer=None) -> "OuterSyncState":
        """
        Follow the model's trainable parameters by name, read the world size, and start each fragment's `θ_global`
        from the parameters (identical on every rank: DDP broadcast rank 0's), or from the checkpoint given to
        [`load_state_dict`]: then the parameters and `optimizer`'s state become this rank's saved local ones.
        Pass the unwrapped model (a DDP wrapper is unwrapped) and the optimizer that steps.
        """
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        listed = {name for names in self.fragment_names for name in names}
        if listed != set(self.params):
            missing = sorted(set(self.params) - listed) or sorted(listed - set(self.params))
            raise ValueError(
                f"the fragments and the model's trainable parameters differ (e.g. {missing[0]}); build the fragments "
                "from this model's groups."
            )
        self.world_size, self.rank = self.communicator.world_size, self.communicator.rank
        self.kernels = compile_kernels(False)  # a sync every H steps: the eager kernels, the same on every rank
        self.optimizer = optimizer
        check_moments(optimizer, self.moments)
        self.fsdp_units = fsdp_modules(model)
        if self.delay > 0 and self.exchange and self.world_size > 1 and self.exchange_communicator is None:
            # The exchanges get a twin of their own (the same ranks, in order): NCCL runs the collectives of one group
            # in order, and the next steps' norm all-reduce must not queue behind an exchange under way. Collective:
            # every rank makes every twin, in the same order (each replicate group's, between replica groups).
            self.exchange_communicator = self.communicator.duplicate()
        if self.replicas is not None:
            self.replicas.check_sharded(self.params)  # FSDP2 over this rank's replica only
            if self.exchange and self.world_size > 1 and self.pending is None and not self.communicator.elastic:
                self.replicas.broadcast_first_replica(self.params.values())  # θ starts identical on every replica
                self.communicator.pop_comm_ms()  # setup, not a step's communication
        keep = self.outer_momentum > 0
        where = global_device(self.global_device, self._device())
        # a fresh θ_global each
        self.fragments = [Fragment(i, names, self.params, self.plan, self.dtype, keep, where, self.error_decay)
                          for i, names in enumerate(self.fragment_names)]  # fmt: skip
        if self.pending is not None:
            with torch.no_grad():
                apply_saved(self, self.pending)
            self.pending = None
        exchanged = "exchange" if self.exchange else "no exchange (the outer step only)"
        logger.info(
            f"GRPO sync every {self.every} steps: {exchanged}, world size {self.world_size}, {len(self.fragments)} "
            f"fragments of {'/'.join(str(f.numel) for f in self.fragments)} entries, outer lr {self.outer_lr:g} "
            f"momentum {self.outer_momentum:g}, ramp {'on' if self.ramp else 'off'}, delay {self.delay} (mix "
            f"{self.mix:g}), θ_global in {str(self.dtype).replace('torch.', '')} on {where}, optimizer moments "
            f"averaged: {self.moments}, residual decay {self.error_decay:g}"
            + (
                f"; replica groups: {self.replicas.replicas} × {self.replicas.shards} shards."
                if self.replicas
                else "."
            )
        )
        return self

    def attach(self, wrapped: nn.Module, model: nn.Module, optimizer) -> None:
        """[`bind`] `model` and `optimizer` (`θ_global`; a checkpoint's local parameters and optimizer state), and
        register [`local_gradient_hook`] on `wrapped` when it is the DDP model that exchanges (the inner steps: no
        collective)."""
        self.bind(model, optimizer)
        if isinstance(wrapped, nn.parallel.DistributedDataParallel) and self.exchange:
            wrapped.register_comm_hook(self, local_gradient_hook)

    # --- per step ---
    def _exchange(self, communicator: Communicator | None = None) -> Exchange:
        """The fragments' exchange over `communicator` (the state's when `None`): the eager kernels, decoding a few
        chunks at a time (work memory of a chunk); its bytes go into this step's statistics."""
        within = self.replicas.agree_within_replica if self.replicas is not None else None
        comm = self.communicator if communicator is None else communicator
        return Exchange(self.kernels, comm, self.stats, decode_chunk=ENCODE_CHUNK, agree_within=within)

    def _device(self) -> torch.device:
        return local_tensor(next(iter(self.params.values()))).device if self.params else torch.device("cpu")

    def agree_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """
        Per-group gradient norms every rank shares between syncs: the RMS over ranks of the local norms (one
        all-reduce of their squares in float64); a NaN or an Inf on any rank reaches every rank. As is without an
        exchange (DDP's all-reduce, or one process, made them identical), and between replica groups, whose replicate
        dimension sends nothing between syncs (each replica's own norms, FSDP2's shards summed).
        """
        if not self.exchange or self.world_size == 1 or self.apart:
            return norms
        return (self._all_reduce_mean(norms.double() ** 2)).sqrt().to(norms.dtype)

    def agree_mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of per-group `values` (float64; e.g. the importance coherence); as is without exchange
        or between replica groups."""
        if not self.exchange or self.world_size == 1 or self.apart:
            return values
        return self._all_reduce_mean(values.double()).to(values.dtype)

    def share_at_sync(self, get, put) -> None:
        """
        Between replica groups, at the end of every step that syncs: `put(mean over the replicas of get())` (one
        float64 all-reduce, counted), so that state the ranks keep apart between syncs (the importance state, whose
        norms are each replica's own) is the same on every rank after each sync. Nothing otherwise: DDP's ranks agree
        on the norms at every step.
        """
        self.share = (get, put)

    def _all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        summed = self.communicator.all_reduce(values.clone().to(self._device())).cpu()
        self.stats.bytes_sent += allreduce_bytes(8 * values.numel(), self.world_size)
        self.stats.hook_ms += (time.perf_counter() - start) * 1000
        return summed / self.world_size

    def end_step(self, finite: bool = True, last: bool = False) -> float:
        """
        Close an optimizer step (call it after `optimizer.step()`): sync the fragments due ([`fragments_due`]; every
        fragment when `last`), count the step. Returns the bytes this rank sent in the step. (`finite` is not used: a
        non-finite step took no inner step, and the sync carries on.)

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
            self.stats.bytes_sent += allreduce_bytes(4 * self.numel, self.world_size)
        in_flight = self.in_flight
        if in_flight is not None and (due or in_flight.due <= self.step):
            self._apply_in_flight()
        if len(due) == 1 and self.delay > 0 and not last and not self._in_ramp():
            self._start(self.fragments[due[0]])
        elif due:
            self._sync(due)
        if due and self.share is not None and self.apart and self.step_world_size > 1:
            get, put = self.share
            put(self._all_reduce_mean(get()))  # e.g. the importance state: the same on every rank after a sync
        self.stats.baseline(self.numel, self.world_size)
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
        self._sync([fragment.index for fragment in self.fragments if fragment.last_sync != self.step])
        self.stats.hook_ms += (time.perf_counter() - start) * 1000
        return self._close(count_step=False)

    def shutdown(self) -> None:
        """Leave the wire's membership (between fault-tolerant replica groups: the quorum; nothing otherwise)."""
        self.communicator.shutdown()

    def _in_ramp(self) -> bool:
        points = ramp_points(self.every) if self.ramp else []
        return bool(points) and self.step <= points[-1]

    def _close(self, count_step: bool) -> float:
        record, self.stats = self.stats, StepStats()
        for comm in (self.communicator, self.exchange_communicator):  # the time spent communicating in the step
            if comm is not None:
                record.comm_ms += comm.pop_comm_ms()
        self.traffic.close_step(record, optimizer_step=count_step)
        return record.bytes_sent

    def _count_sync(self, fragment: Fragment) -> None:
        self.stats.kept += fragment.numel
        self.traffic.count(syncs=1)

    def _warn_nonfinite(self, dropped: str) -> None:
        self.traffic.count(nonfinite_syncs=1)
        warn_once(
            logger,
            self._warned,
            "nonfinite",
            f"GRPO sync at step {self.step}: a rank's model moved to NaN/Inf (or beyond 2**60) since the last sync; "
            f"every rank restarts the fragment from θ_global ({dropped}).",
        )

    @torch.no_grad()
    def _sync(self, due: list[int]) -> None:
        """Steps 3-7 of the module docstring for the fragments `due`, one after the other (work memory: one)."""
        reshard(self.fsdp_units)  # the restart writes the shards: no unit may keep an unsharded copy
        for fragment in (self.fragments[f] for f in due):
            self._sync_fragment(fragment)
            self._count_sync(fragment)

    def _sync_fragment(self, fragment: Fragment) -> None:
        """
        Steps 3-7 for one fragment. The exchange is kept when the communicator commits it (always over
        `torch.distributed`); between fault-tolerant replica groups one that fails (a peer died) is tried again over
        the survivors, its error-feedback residuals restored first, and discarded when that fails too: `θ_global`,
        momentum and residuals stay as they were, and the parameters restart from `θ_global`.
        """
        comm = self.communicator
        for attempt in range(comm.attempts):
            if comm.elastic:  # the ranks of the current quorum
                self.world_size, self.rank = comm.world_size, comm.rank
            world_size = self.step_world_size
            exchange = self._exchange()
            keys = SYNC_MOMENTS[self.moments] if self.optimizer is not None and world_size > 1 else ()
            saved = fragment.save_error_feedback() if comm.attempts > 1 else None
            deltas = fragment.take_delta()
            # the moments to average join the NaN/Inf check (read in place): set, the flag leaves them alone
            moments = [t for key in keys for held in fragment.moments(self.optimizer, key) for t in held]
            unsafe = not all_safe([*deltas, *moments])
            del moments
            if world_size > 1:
                unsafe = bool(exchange.agree_flag(unsafe, self._device()).wait().item())
            if not unsafe and world_size > 1:
                fragment.exchange(exchange, deltas, owners=world_size >= OWNER_MIN_WORLD_SIZE)
            if comm.commit():
                break
            fragment.restore_error_feedback(saved)
            if attempt + 1 < comm.attempts:
                self.traffic.count(retried=1)
                comm.reconfigure(self.step, self.global_checksum)
                self._after_quorum()
        else:
            self.participants.append(0)  # nobody's exchange was kept
            self.kept_members = ()
            self.traffic.count(discarded=1)
            logger.warning(
                f"GRPO sync at step {self.step}: the exchange of fragment {fragment.index} failed {comm.attempts} "
                "times; it is discarded (θ_global, outer momentum and residuals unchanged), and every replica "
                "restarts the fragment from θ_global."
            )
            fragment.restart(self.step)
            return
        if comm.elastic:
            self.participants.append(world_size)
            self.kept_members = comm.members
        if unsafe:
            self._warn_nonfinite("its local steps are dropped")
        else:
            fragment.apply_outer_step(deltas, self.outer_lr, self.outer_momentum)
        del deltas
        fragment.restart(self.step)
        if keys and not unsafe:
            fragment.average_moments(exchange, self.optimizer, keys)

    def _after_quorum(self) -> None:
        """A new quorum of the communicator: its ranks, and owner residuals afresh when the membership changed (each
        rank's share of the blocks is another one)."""
        comm = self.communicator
        self.world_size, self.rank = comm.world_size, comm.rank
        if comm.membership_changed:
            for fragment in self.fragments:
                fragment.reset_owner_residuals()

    def next_sync(self, step: int, last_step: int) -> int:
        """The first step after `step` at which a fragment syncs ([`fragments_due`]), at most `last_step` (the last
        step of training syncs every fragment)."""
        for later in range(step + 1, last_step):
            if fragments_due(later, self.every, len(self.fragment_names), self.ramp):
                return later
        return max(step, last_step)

    def step_ended(self, step: int) -> None:
        """
        After the trainer closed optimizer step `step` (its scheduler stepped, its step counted): when a fragment
        synced in it, the communicator's next interval starts (between fault-tolerant replica groups: a quorum, at
        which restarted or new groups heal from this one).
        """
        if not self.fragments or not any(last == self.step for last in self.last_sync):
            return
        self.communicator.next_interval(step, self.global_checksum)  # the checksum is read only at a new membership
        self._after_quorum()

    def global_checksum(self) -> int:
        """An exact checksum of `θ_global` ([`~grpo_hf.compression.fragment.global_checksum`]), which fault-tolerant
        replica groups compare at every new membership."""
        return sum(fragment.checksum() for fragment in self.fragments)

    @torch.no_grad()
    def _start(self, fragment: Fragment) -> None:
        """Steps 3-4 for `fragment`, started (`delay > 0`, see "Overlap"); its bytes count in this step."""
        exchange = self._exchange(self.exchange_communicator) if self.step_world_size > 1 else None
        fragment.start(exchange, self.step, self.step + self.delay)
        self._count_sync(fragment)

    def _complete(self) -> None:
        """Wait for the exchange under way, if any (its waiting time counts in this step); nothing else changes."""
        for fragment in self.fragments:
            fragment.complete(self.stats)

    @torch.no_grad()
    def _apply_in_flight(self) -> None:
        """Steps 5 and 6 for the exchange under way: the outer step on `Δ̄` and the merge, or the restart."""
        self._complete()
        reshard(self.fsdp_units)
        fragment = self.fragments[self.in_flight.fragment]
        if fragment.apply_in_flight(self.step, self.outer_lr, self.outer_momentum, self.mix):
            self._warn_nonfinite("its local steps, those taken while the exchange ran included, are dropped")

    # --- the global model for evaluation and saving ---
    @contextlib.contextmanager
    def global_weights(self):
        """
        Within the block the parameters hold `θ_global` (evaluation, `save_model`, `predict`); this rank's local
        parameters come back after it. Nothing is copied when they are `θ_global` already, nor before [`bind`].
        """
        if not self.fragments or self.in_sync or self.swapped is not None:
            yield
            return
        params = [local_tensor(p.detach()) for p in self.params.values()]  # this rank's shards under FSDP2
        with torch.no_grad():
            reshard(self.fsdp_units)
            self.swapped = [p.clone() for p in params]
            for fragment in self.fragments:
                fragment.show_global()
        try:
            yield
        finally:
            with torch.no_grad():
                reshard(self.fsdp_units)  # an evaluation's forward may have left unsharded copies of θ_global
                torch._foreach_copy_(params, self.swapped)
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
        stats = self.traffic.pop_stats()
        if self.communicator.elastic and stats:
            for name in ELASTIC_COUNTERS:
                stats[f"grpo/sync/{name}"] = stats.pop(f"grpo/comm/{name}", 0.0)
            if self.participants:  # of the window's last sync (0: discarded)
                stats["grpo/sync/participants"] = float(self.participants[-1])
        return stats

    def totals(self) -> dict[str, float]:
        """
        Running totals of the whole run (checkpointed): `steps`, `syncs`, `nonfinite_syncs`, `bytes_sent`,
        `bytes_peak`, `bytes_dense_fp32` / `_fp16`, `ratio_fp32` / `_fp16`, `density`, `hook_ms`, `comm_ms`, `kept`,
        `numel` (`dense_steps` and `nonfinite_steps` are 0: the keys of the per-step hook's totals).
        """
        return self.traffic.totals()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this state holds: `global` (`θ_global`), `momentum` and `residuals`."""
        held = [fragment.nbytes() for fragment in self.fragments]
        return {key: sum(h[key] for h in held) for key in ("global", "momentum", "residuals")}

    # --- checkpointing ---
    def settings(self) -> dict:
        return {
            "every": self.every,
            "fragments": len(self.fragment_names),
            "ramp": self.ramp,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "dtype": str(self.dtype).replace("torch.", ""),
            "exchange": self.exchange,
            "delay": self.delay,
            "mix": self.mix,
            "moments": self.moments,
            "error_decay": self.error_decay,
        }

    def heal_state_dict(self) -> dict:
        """
        What a healing replica group receives of this rank (fault-tolerant replica groups, at the start of an
        interval): [`state_dict`] with `θ_global` and the momentum whatever the rank, and no error-feedback residuals
        (a peer's would apply its error twice: the healer's start at zero).
        """
        state = self.state_dict(shared=True)
        state["residuals"], state["owner_residuals"] = {}, {}
        return state

    def load_heal_state_dict(self, state: dict) -> None:
        """A live group's [`heal_state_dict`] into this healing one (before its first step; applied at [`bind`]),
        counted in `grpo/sync/heals`."""
        self.load_state_dict(state, state)
        self.traffic.count(heals=1)

    def state_dict(self, shared: bool | None = None) -> dict:
        """
        What a resumed run needs to continue bit for bit, on cpu, by parameter name: the step, each fragment's last
        sync, the settings and fragments; on rank 0 only `θ_global` and the momentum (the same on every rank); on every
        rank its own bf16 residuals (`residuals`; from 3 ranks also `owner_residuals`: per parameter name, the chunk of
        it this rank owns), its local parameters and its optimizer's state (the Trainer saves rank 0's only).

        With an exchange under way (`delay > 0`) it is waited for here, not applied: the state holds its agreed flag
        and mean `Δ̄` (`in_flight`), and the outer step and merge still happen at its due step, in the resumed run as
        in one that was not interrupted. No collective under way is saved, and saving does not change the training.
        """

        def cpu(tensors):
            return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}

        if shared is None:  # θ_global and the momentum: rank 0's; every fault-tolerant group's own (it resumes alone)
            shared = self.rank == 0 or self.communicator.elastic
        self._complete()  # before the residuals are read: the exchange's new ones are committed
        held = [fragment.state_by_name() for fragment in self.fragments]
        pending = self.pending or {"own": None, "last_sync": [0] * len(self.fragment_names)}
        own = pending["own"] or {}  # loaded and not bound yet: what the checkpoint held

        def merged(key):
            return {name: value for h in held for name, value in h[key].items()} if held else own.get(key, {})

        flight = self.in_flight
        return {
            "version": STATE_VERSION,
            "mode": OUTER_MODE,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "last_sync": self.last_sync if self.fragments else pending["last_sync"],
            "hook_calls": self.hook_calls,
            "settings": self.settings(),
            "fragments": [list(names) for names in self.fragment_names],
            "global": cpu(merged("global")) if shared else {},
            "momentum": cpu(merged("momentum")) if shared else {},
            "residuals": cpu(merged("residuals")),
            "owner_residuals": cpu(merged("owner_residuals")),
            "local": cpu({name: local_tensor(p) for name, p in self.params.items()}),  # local shards, never DTensors
            "optimizer": local_optimizer_state(self.optimizer) if self.optimizer is not None else None,
            "layout": self.replicas.layout() if self.replicas is not None else None,
            "totals": self.traffic.state_dict(),
            "in_flight": None if flight is None else {
                "fragment": flight.fragment,
                "started": flight.started,
                "due": flight.due,
                "unsafe": flight.unsafe,
                "delta": cpu(self.fragments[flight.fragment].by_name(flight.deltas)),
            },
        }  # fmt: skip

    def restore(self, saved: SavedComms) -> None:
        """
        This rank's own state and `θ_global` of replica 0 (rank 0 under DDP) when the checkpoint was written by as many
        ranks; see [`~grpo_hf.compression.sync_checkpoint.restore_sync_state`].
        """
        restore_sync_state(self, saved)

    def load_state_dict(self, state_dict: dict | None, shared: dict | None = None) -> None:
        """
        Restore [`state_dict`] at the next [`bind`] (at once when bound already); `shared` holds `θ_global` and the
        momentum (see [`~grpo_hf.compression.sync_checkpoint.load_sync_state`]).
        """
        load_sync_state(self, state_dict, shared)

    def __getstate__(self):
        """
        Pickle without the communicators, the parameters, the fragments, the optimizer and the kernels (the copy
        communicates over the default group: bind it again); an exchange under way is waited for first (as by
        [`state_dict`]).
        """
        if self.fragments:
            self._complete()
        dropped = ("communicator", "exchange_communicator", "params", "fragments", "kernels", "optimizer", "swapped",
                   "fsdp_units", "share")  # fmt: skip
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in dropped}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        self.exchange_communicator = self.kernels = self.optimizer = self.swapped = self.share = None
        self.communicator = ProcessGroupCommunicator()
        self.params, self.fragments, self.fsdp_units = {}, [], []

    def __repr__(self) -> str:
        return (
            f"OuterSyncState(every={self.every}, fragments={len(self.fragment_names)}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, ramp={self.ramp}, exchange={self.exchange}, delay={self.delay}, "
            f"mix={self.mix}, moments={self.moments!r}, error_decay={self.error_decay}, step={self.step}, "
            f"world_size={self.world_size})"
        )


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
    "OUTER_DTYPES",
    "OUTER_MODE",
    "OWNER_MIN_WORLD_SIZE",
    "SYNC_MOMENTS",
    "OuterSyncState",
    "fragment_offsets",
    "fragments_due",
    "local_gradient_hook",
    "merge_with_global",
    "outer_step",
    "pack_fragments",
    "ramp_points",
]
