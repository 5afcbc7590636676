"""`Fragment`: one fragment of the sync every H steps, an object that owns its state (torchft's
`_StreamingDiLoCoFragment`), and the outer step's math.

A fragment is a set of whole parameters (GRPO's groups, packed by [`pack_fragments`]).
It holds its parameters' local views (under DDP the parameters themselves, the whole model being the one-shard case;
in a replica sharded by FSDP2 this rank's local shards, `DTensor.to_local()`) and, as flat rows, `θ_global`, the outer
momentum, its error-feedback residual and its owner residual; its last sync and its exchange in flight. Its methods
are the algorithm's steps (see the module docstring of `outer_sync.py`, which schedules them):

```python
>>> delta = fragment.take_delta()  # Δ = θ_global − θ_local, one fp32 row per row of the fragment
>>> fragment.exchange(exchange, delta, owners=False)  # Δ̄, the mean over the ranks, in place (blocking)
>>> fragment.apply_outer_step(delta, lr, mu)  # θ_global −= lr (Δ̄ + μ m)
>>> fragment.restart(step)  # θ_local ← θ_global

>>> fragment.start(exchange, step, due)  # the same exchange, started: Δ taken, flag and messages under way
>>> fragment.complete(stats)  # waited for: the agreed flag and Δ̄ (what a checkpoint saves of it)
>>> fragment.apply_in_flight(step, lr, mu, mix)  # the outer step, then θ_local ← (1 − α) θ_global + α θ_local
```

**Rows.** One row of the tensors sent dense (an fp32 all-reduce; norms, biases), then one row per setting of the
codec (its whole [`~grpo_hf.compression.spec.CodecSpec`], ordered by bits), each tensor block-aligned and zero-padded:
the row the [`~grpo_hf.compression.exchange.Exchange`] encodes as it is. Padding stays zero in every row (`Δ`,
`θ_global`, the momentum, the residuals), so that a row's math, one operation per row, is its tensors' math. A code
without a zero level (the sync's 2-bit code sends a 0 as `+a / 3`) decodes padding to non-zero values and leaves
their opposite in the residual: after every exchange the fragment zeroes the padding of `Δ̄` and of its residual
([`Fragment.clear_padding`]; a no-op for the codes that keep zeros). What is saved is keyed by parameter name
([`Fragment.state_by_name`]), so that a checkpoint resumes with other fragments.

**Where `θ_global` lives** (`grpo_sync_global_device`, [`global_device`]). `θ_global` and the momentum are kept on
the CPU (pinned when the parameters are on an accelerator) or beside the parameters. The math always runs on the
parameters' device: a kept row is copied there for `Δ`, the outer step, the restart and the merge, one row at a time,
and copied back after the outer step, so every choice gives the same bits and the accelerator holds one row of them at
a time (torchft's pinned CPU copies of `p.to_local()`, INTELLECT-1's flat fp32 CPU buffer).

## An exchange in flight (`delay = τ > 0`, Streaming DiLoCo)

Without delay the exchange (step 4 of `outer_sync.py`'s algorithm) blocks the step that syncs. With `τ > 0` (after the ramp, whose syncs stay
blocking) a due fragment's exchange is only started at its sync step: `Δ` is taken, the flag's all-reduce, the
messages' all-gathers and the dense all-reduce are started (`Fragment.start`), and the next `τ` inner steps
compute while they run. After step `s + τ` every rank waits for them, takes the outer step (step 5) on `Δ̄` exactly as
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
  exchange in flight), in `OuterSyncState.finish`, and in `OuterSyncState.state_dict`, which waits without
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
  `OuterSyncState.bind` on every rank): NCCL runs the collectives of one group in order, and the next steps' norm
  all-reduce must not queue behind the exchange under way.
"""

import itertools

import torch

from ..choices import SYNC_MOMENTS
from ..errors import ConfigError
from ..optim.moments import averaging_refusal, local_tensor, moment_numel, moment_tensors
from .codec import all_safe
from .codes import code_for
from .exchange import Exchange, Part
from .layout import Run
from .row_store import RESIDUAL_DTYPE
from .spec import CodecSpec


# ----------------------------------------------------------------------------------------------------------------
# The fragments of GRPO's groups, and the outer step (pure functions)
# ----------------------------------------------------------------------------------------------------------------


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


def global_checksum(tensors) -> int:
    """
    An exact checksum of a global model: every value's bits read as an integer and summed (int64), so that two copies
    agree on it exactly when their values agree, but for a permutation (an agreement check, not a hash); the same for
    a fragment's rows and for the tensors by name a healing group receives.
    """
    total = 0
    for tensor in tensors:
        bits = tensor.detach().reshape(-1).view(torch.int16 if tensor.element_size() == 2 else torch.int32)
        total += int(bits.sum(dtype=torch.int64))
    return total


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


def global_device(setting: str, device: torch.device) -> str:
    """
    Where a fragment keeps `θ_global` and the momentum for parameters on `device` (`grpo_sync_global_device`):
    `"cpu"` or `"parameters"`; `"auto"` is `"cpu"` on an accelerator and `"parameters"` on the CPU (where both are the
    same memory).
    """
    if setting == "auto":
        return "parameters" if torch.device(device).type == "cpu" else "cpu"
    return setting


def check_moments(optimizer, moments: str) -> None:
    """
    With `moments` other than `"none"` (`grpo_sync_moments`): refuse an optimizer that does not keep them as fp32
    tensors ([`~grpo_hf.optim.moments.averaging_refusal`]), which [`Fragment.average_moments`] could not average.
    """
    field = f"grpo_sync_moments={moments!r}"
    for which in SYNC_MOMENTS[moments]:
        if optimizer is None:
            raise ConfigError(f"{field} averages the optimizer's moments: bind the optimizer that steps.")
        refusal = averaging_refusal(optimizer, which)
        if refusal is not None:
            adam_key = "exp_avg" if which == "first" else "exp_avg_sq"
            fallback = "'second' (or 'none')" if which == "first" else "'none'"
            raise ConfigError(
                f"{field} averages the optimizer's {which} moment ({adam_key} in AdamW), and {refusal}. Use an "
                f"optimizer that keeps it in fp32 (torch's AdamW; a group file's state_bits: 32), or grpo_sync_moments="
                f"{fallback}."
            )


# ----------------------------------------------------------------------------------------------------------------
# A fragment
# ----------------------------------------------------------------------------------------------------------------


def _row_order(spec: CodecSpec) -> tuple:
    """The order of a fragment's codec rows: by bits, then the rest of the setting."""
    return spec.bits, spec.density, spec.block_size, spec.code or ""


class _Row:
    """
    The layout of one row: its spec (`None`: sent dense), its tensors one after the other (block-aligned and
    zero-padded under a spec) and, under a spec, the row as a layout `Run` (the owners of its blocks).
    """

    __slots__ = ("spec", "names", "numels", "offsets", "length", "pieces", "run")

    def __init__(self, spec: CodecSpec | None, names: list[str], numels: list[int]):
        block = 1 if spec is None else spec.block_size
        self.spec, self.names, self.numels = spec, list(names), list(numels)
        self.offsets, self.pieces, offset = [], [], 0
        for numel in numels:
            padded = -(-numel // block) * block
            self.offsets.append(offset)
            self.pieces += [numel, padded - numel]  # the tensor's entries, then its padding
            offset += padded
        self.length = offset
        self.run = None
        if spec is not None:  # each tensor in place in the row: its blocks cut into owners' chunks as a bucket's are
            offsets, sizes, positions = tuple(self.offsets), tuple(numels), tuple(range(len(names)))
            self.run = Run(spec, tuple(names), sizes, positions, offsets, offsets, offset, True,
                           tuple(zip(positions, offsets, sizes)))  # fmt: skip

    def split(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's entries in `row` (views), in order."""
        return list(row.split(self.pieces)[::2])

    def padding(self, row: torch.Tensor) -> list[torch.Tensor]:
        """The padding after each tensor in `row` (views; none where a tensor fills its last block)."""
        return [piece for piece in row.split(self.pieces)[1::2] if piece.numel()]

    def padded_blocks(self) -> list[tuple[int, int]]:
        """`(block, count)`: the last block of each tensor that does not fill it, and its entries of padding (the
        last `count`)."""
        block = self.spec.block_size
        return [((offset + numel) // block, -numel % block) for offset, numel in zip(self.offsets, self.numels)
                if numel % block]  # fmt: skip

    def owned_padding(self, values: torch.Tensor, world_size: int, rank: int) -> list[torch.Tensor]:
        """The padding in `values`, the blocks `rank` owns one after the other (an owner residual; views)."""
        padded, owned = self.padded_blocks(), self.run.owned_blocks(world_size)[rank]
        if not padded or not owned.numel():
            return []
        block = self.spec.block_size
        wanted = torch.tensor([b for b, _ in padded], dtype=owned.dtype)
        where = torch.searchsorted(owned, wanted).clamp_max(owned.numel() - 1)  # owned blocks are in row order
        found = (owned[where] == wanted).tolist()
        return [values[(i + 1) * block - count : (i + 1) * block]
                for (_, count), i, hit in zip(padded, where.tolist(), found) if hit]  # fmt: skip


def _decayed(residual: torch.Tensor, decay: float) -> torch.Tensor:
    """`decay * residual` as a new bf16 row (SparseLoCo's `e ← β e` before `Δ` is added); the row itself at 1."""
    if decay == 1:
        return residual
    return (residual.float() * decay).to(RESIDUAL_DTYPE)


class _RowResidual:
    """
    A fragment's residual of one row as the exchange reads and writes it: bf16 zeros until its first exchange, read
    times `decay` (a new row: the held one is replaced only when the exchange writes its new residual).
    """

    __slots__ = ("held", "index", "length", "device", "decay")

    def __init__(self, held: list, index: int, length: int, device, decay: float = 1.0):
        self.held, self.index, self.length, self.device, self.decay = held, index, length, device, decay

    def read(self, block_size: int) -> torch.Tensor:
        if self.held[self.index] is None:
            self.held[self.index] = torch.zeros(self.length, dtype=RESIDUAL_DTYPE, device=self.device)
        return _decayed(self.held[self.index], self.decay).view(-1, block_size)

    def write(self, row: torch.Tensor) -> None:
        self.held[self.index] = row.reshape(-1)


class _OwnerResidual:
    """The residual of the blocks of one row that this rank owns (owner reduction), at one world size: zeros at its
    first exchange, but for the chunks a checkpoint saved; read times the fragment's `error_decay`, as the sender's."""

    __slots__ = ("fragment", "index", "world_size", "rank")

    def __init__(self, fragment: "Fragment", index: int, world_size: int, rank: int):
        self.fragment, self.index, self.world_size, self.rank = fragment, index, world_size, rank

    def read(self, block_size: int) -> torch.Tensor:
        held = self.fragment.owner_residuals[self.index]
        if held is None or held[:2] != (self.world_size, self.rank):
            run = self.fragment.rows[self.index].run
            count = run.owned_blocks(self.world_size)[self.rank].numel()
            row = torch.zeros(count * block_size, dtype=RESIDUAL_DTYPE, device=self.fragment.device)
            saved = self.fragment.saved_owner
            for name, offset, size in run.owned_slots(self.world_size, self.rank):
                if name in saved:
                    row[offset : offset + size] = saved.pop(name).to(row.device).reshape(-1)[:size]
            held = self.fragment.owner_residuals[self.index] = (self.world_size, self.rank, row)
        return _decayed(held[2], self.fragment.error_decay).view(-1, block_size)

    def write(self, row: torch.Tensor) -> None:
        self.fragment.owner_residuals[self.index] = (self.world_size, self.rank, row.reshape(-1))


class InFlight:
    """
    One fragment's exchange under way (`delay > 0`): started after step `started`, applied after step `due`. Until
    [`Fragment.complete`] it holds the collectives in flight; after it, `unsafe` (the agreed NaN/Inf flag) and `deltas`
    (the rows of the mean `Δ̄`), which is what a checkpoint saves of it.
    """

    __slots__ = ("fragment", "started", "due", "exchange", "flag", "gathers", "mean", "deltas", "unsafe", "completed")

    def __init__(self, fragment: int, started: int, due: int):
        self.fragment, self.started, self.due = fragment, started, due
        self.exchange = self.flag = self.mean = None
        self.gathers, self.deltas = [], []
        self.unsafe, self.completed = False, False


class Fragment:
    r"""
    One fragment of the sync every H steps and its state (see the module docstring).

    Args:
        index (`int`): its place among the fragments.
        names (`list[str]`): its parameters' names.
        params (`dict[str, torch.nn.Parameter]`): the trainable parameters by name (this fragment's among them).
        plan (`dict[str, CodecSpec | None]`): how each parameter's `Δ` is sent (`None`: fp32 all-reduce).
        dtype (`torch.dtype`): of `θ_global` and the momentum.
        momentum (`bool`): whether the outer step keeps a momentum.
        global_device (`str`, *optional*, defaults to `"parameters"`): where `θ_global` and the momentum live
            ([`global_device`]): `"cpu"` (pinned when the parameters are on an accelerator) or `"parameters"`.
        error_decay (`float`, *optional*, defaults to `1.0`): `β`, what each sync keeps of the residuals before it adds
            `Δ` (`r ← β r + Δ`, then what is sent is subtracted); `1` keeps them whole.
    """

    def __init__(self, index: int, names: list[str], params: dict, plan: dict, dtype: torch.dtype, momentum: bool,
                 global_device: str = "parameters", error_decay: float = 1.0):  # fmt: skip
        self.index, self.names, self.error_decay = index, list(names), float(error_decay)
        self.params = {name: params[name] for name in names}
        self.numel = sum(local_tensor(p).numel() for p in self.params.values())
        self.device = local_tensor(next(iter(self.params.values()))).device
        # `"cpu"`: θ_global and the momentum kept apart from the parameters' device memory, streamed a row at a time
        # (for parameters on the CPU too: a copy, the same path, which the CPU tests exercise)
        self.streamed = global_device == "cpu"
        self.store = torch.device("cpu") if self.streamed else self.device
        self.pinned = self.streamed and self.device.type != "cpu"
        dense = [name for name in names if plan.get(name) is None]
        self.rows = [_Row(None, dense, self._numels(dense))]
        # one row per setting (the whole spec: two codes of the same bits never share a row), by bits first
        for spec in sorted({plan[name] for name in names if plan.get(name) is not None}, key=_row_order):
            members = [name for name in names if plan.get(name) == spec]
            self.rows.append(_Row(spec, members, self._numels(members)))
        with torch.no_grad():
            self.theta = [self._stored(self._gather(row, dtype)) for row in self.rows]  # θ_global, from the parameters
        self.momentum = None
        if momentum:
            self.momentum = [torch.zeros(t.shape, dtype=t.dtype, device=t.device, pin_memory=self.pinned)
                             for t in self.theta]  # fmt: skip
        self.residuals: list[torch.Tensor | None] = [None] * len(self.rows)  # bf16, from the row's first exchange
        self.owner_residuals: list[tuple | None] = [None] * len(self.rows)  # (world size, rank, row of owned blocks)
        self.saved_owner: dict[str, torch.Tensor] = {}  # a checkpoint's owner residuals, until their first use
        self.last_sync = 0  # the step at which the parameters last restarted from θ_global
        self.in_flight: InFlight | None = None

    def _numels(self, names: list[str]) -> list[int]:
        return [local_tensor(self.params[name]).numel() for name in names]

    def _locals(self, row: _Row) -> list[torch.Tensor]:
        """This rank's tensors of the row (flat views of the parameters' local parts)."""
        return [local_tensor(self.params[name]).detach().view(-1) for name in row.names]

    def _gather(self, row: _Row, dtype: torch.dtype) -> torch.Tensor:
        """The row's local tensors copied into one row of `dtype` (padding zero)."""
        out = torch.zeros(row.length, dtype=dtype, device=self.device)
        if row.names:
            torch._foreach_copy_(row.split(out), self._locals(row))
        return out

    def _scatter(self, row: _Row, values: torch.Tensor) -> None:
        """`values` (a row) copied into the row's local tensors."""
        if row.names:
            torch._foreach_copy_(self._locals(row), row.split(self._working(values)))

    # --- where θ_global lives: stored on `self.store`, worked on on the parameters' device ---
    def _stored(self, row: torch.Tensor) -> torch.Tensor:
        """A row made on the parameters' device, moved where `θ_global` is kept (pinned: copies can overlap)."""
        if not self.streamed:
            return row
        held = torch.empty(row.shape, dtype=row.dtype, device=self.store, pin_memory=self.pinned)
        return held.copy_(row)

    def _working(self, row: torch.Tensor | None) -> torch.Tensor | None:
        """A stored row on the parameters' device (the row itself when it is kept there): the outer step's math runs
        there whatever `global_device`, so that every choice gives the same bits."""
        if row is None or not self.streamed:
            return row
        return row.to(self.device, non_blocking=self.pinned, copy=True)

    def _put_back(self, stored: torch.Tensor | None, working: torch.Tensor | None) -> None:
        """A row worked on copied back where it is kept (nothing to do when it is kept on the parameters' device)."""
        if stored is not None and working is not stored:
            stored.copy_(working)

    @property
    def codec_rows(self) -> list[int]:
        """The indices of the rows sent in codes (but empty ones: a shard may hold no entry of a small tensor; the ranks
        of a replicate group hold the same shard index, so they all leave the same rows out)."""
        return [index for index, row in enumerate(self.rows) if row.spec is not None and row.length]

    # --- the algorithm ---
    def take_delta(self) -> list[torch.Tensor]:
        """`Δ = θ_global − θ_local`, one fp32 row per row of the fragment."""
        deltas = [self._gather(row, torch.float32) for row in self.rows]
        for theta, delta in zip(self.theta, deltas):
            torch.sub(self._working(theta), delta, out=delta)
        return deltas

    def _part(self, index: int, delta: torch.Tensor, world_size: int, rank: int) -> Part:
        """Row `index`'s `Δ` as a part of an exchange: its residuals, its mean decoded into it."""
        row = self.rows[index]
        rows = delta.view(-1, row.spec.block_size)
        residual = _RowResidual(self.residuals, index, row.length, self.device, self.error_decay)
        return Part(row.run, rows, residual, out=rows, owner_residual=_OwnerResidual(self, index, world_size, rank))

    def exchange(self, exchange: Exchange, deltas: list[torch.Tensor], owners: bool) -> None:
        """
        `Δ` becomes `Δ̄`, the mean over the ranks, in place (blocking): every codec row with its error feedback,
        all-gathered, or (`owners`) reduced by the owners of its blocks when its code allows it (the chunked top-k
        code is all-gathered whatever the world size); then the dense row, one fp32 all-reduce.
        """
        comm = exchange.comm
        for index in self.codec_rows:
            part = self._part(index, deltas[index], comm.world_size, comm.rank)
            if owners and code_for(part.run.spec).owner_reducible:
                exchange.reduce_with_owners([part])
            else:
                exchange.start_all_gather([part]).finish()
            self.clear_padding(index, deltas[index])
        if deltas[0].numel():
            exchange.start_mean(deltas[0]).wait()

    def clear_padding(self, index: int, delta: torch.Tensor) -> None:
        """
        Zero the padding of codec row `index` in `delta` (its `Δ̄`) and in its residuals (the owner residual included),
        after an exchange: what a code without a zero level decoded there, and its opposite it left in the residuals,
        never reach `θ_global` nor a checkpoint (which keeps the residuals by name, without padding). A no-op for the
        codes that send a 0 as 0.
        """
        row, residual, held = self.rows[index], self.residuals[index], self.owner_residuals[index]
        pieces = row.padding(delta) + ([] if residual is None else row.padding(residual))
        if pieces and held is not None:  # the owner residual of the blocks this rank owns
            pieces += row.owned_padding(held[2], held[0], held[1])
        if pieces:
            torch._foreach_zero_(pieces)

    def checksum(self) -> int:
        """[`global_checksum`] of this fragment's `θ_global` (its rows' zero padding adds nothing)."""
        return global_checksum(self.theta)

    def save_error_feedback(self) -> tuple:
        """A copy of the residuals and owner residuals, for an exchange that may not be kept
        ([`restore_error_feedback`])."""
        owners = [None if held is None else (*held[:2], held[2].clone()) for held in self.owner_residuals]
        return [None if r is None else r.clone() for r in self.residuals], owners, dict(self.saved_owner)

    def restore_error_feedback(self, saved: tuple) -> None:
        """The residuals as [`save_error_feedback`] copied them: an exchange that was not kept leaves no trace."""
        residuals, owners, saved_owner = saved
        self.residuals[:] = residuals  # in place: the exchange's parts hold this list
        self.owner_residuals[:] = owners
        self.saved_owner = saved_owner

    def reset_owner_residuals(self) -> None:
        """Owner residuals start afresh: the ranks changed, and with them each rank's share of the blocks."""
        self.owner_residuals[:] = [None] * len(self.rows)
        self.saved_owner = {}

    def apply_outer_step(self, deltas: list[torch.Tensor], lr: float, mu: float) -> None:
        """[`outer_step`] on every row: `θ_global −= lr (Δ̄ + μ m)`."""
        momentum = self.momentum or [None] * len(self.rows)
        for theta, delta, held in zip(self.theta, deltas, momentum):  # one row at a time on the parameters' device
            theta_row, momentum_row = self._working(theta), self._working(held)
            outer_step(theta_row, delta, momentum_row, lr, mu)
            self._put_back(theta, theta_row)
            self._put_back(held, momentum_row)

    def apply_outer_step_by_name(self, deltas: dict[str, torch.Tensor], lr: float, mu: float) -> None:
        """[`outer_step`] on the tensors of `deltas` (flat `Δ̄` by name, e.g. a checkpoint's of other fragments) only."""
        momentum = self.momentum or [None] * len(self.rows)
        for row, theta, held in zip(self.rows, self.theta, momentum):
            theta_row, momentum_row = self._working(theta), self._working(held)
            split = row.split(momentum_row) if momentum_row is not None else [None] * len(row.names)
            for name, view, moment in zip(row.names, row.split(theta_row), split):
                if name in deltas:
                    outer_step(view, deltas[name].to(view.device).reshape(-1), moment, lr, mu)
            self._put_back(theta, theta_row)
            self._put_back(held, momentum_row)

    def restart(self, step: int) -> None:
        """The parameters become `θ_global` (in place), as at step `step`."""
        self.show_global()
        self.last_sync = step

    def show_global(self) -> None:
        """`θ_global` copied into the parameters (in place), the fragment's schedule unchanged."""
        for row, theta in zip(self.rows, self.theta):
            self._scatter(row, theta)

    def merge(self, step: int, mix: float) -> None:
        """The parameters become `(1 − mix) θ_global + mix θ_local` ([`merge_with_global`]); `mix = 0` restarts."""
        if mix == 0:
            self.restart(step)
            return
        for row, theta in zip(self.rows, self.theta):
            self._scatter(row, merge_with_global(self._gather(row, torch.float32), self._working(theta), mix))

    def start(self, exchange: Exchange | None, step: int, due: int) -> InFlight:
        """
        The exchange of [`exchange`], started and not waited for: `Δ` taken, then the flag's all-reduce, the codec
        rows' all-gathers (a tag each: under way at once) and the dense row's all-reduce started; the new residuals
        are kept apart until [`complete`]. A `Δ` that is not safe here is sent as zeros (the agreed flag then discards
        the exchange). Without `exchange` (one rank) `Δ̄` is this rank's `Δ`.
        """
        flight = self.in_flight = InFlight(self.index, step, due)
        flight.deltas = self.take_delta()
        flight.unsafe = not all_safe(flight.deltas)  # this rank's; completed with the agreed one
        if exchange is None:
            return flight
        if flight.unsafe:
            for delta in flight.deltas:
                delta.zero_()
        comm = exchange.comm
        flight.exchange = exchange
        flight.flag = exchange.agree_flag(flight.unsafe, self.device)
        flight.gathers = [
            exchange.start_all_gather([self._part(index, flight.deltas[index], comm.world_size, comm.rank)], tag=tag,
                                      keep_residuals=True)
            for tag, index in enumerate(self.codec_rows)
        ]  # fmt: skip
        if flight.deltas[0].numel():
            flight.mean = exchange.start_mean(flight.deltas[0])
        return flight

    def complete(self, stats) -> None:
        """
        Wait for the exchange in flight (the time counts into `stats`, the step's that waits); keep the agreed flag
        and `Δ̄`, and, unless the flag is set, make the new residuals the fragment's. The outer step waits for
        [`apply_in_flight`].
        """
        flight = self.in_flight
        if flight is None or flight.completed:
            return
        if flight.exchange is not None:
            flight.exchange.stats = stats  # the waiting step's (the bytes were counted at the start)
            flight.unsafe = bool(flight.flag.wait().item())
            for gathered in flight.gathers:
                gathered.wait()
            if flight.mean is not None:
                flight.mean.wait()
            if not flight.unsafe:
                for gathered, index in zip(flight.gathers, self.codec_rows):
                    gathered.finish()
                    self.clear_padding(index, flight.deltas[index])
        flight.completed = True
        flight.exchange = flight.flag = flight.mean = None
        flight.gathers = []

    def apply_in_flight(self, step: int, lr: float, mu: float, mix: float) -> bool:
        """
        The completed exchange applied at step `step`: the outer step on `Δ̄`, then the merge; with the flag set, the
        restart from `θ_global` instead (returns `True`: its local steps are dropped).
        """
        flight, self.in_flight = self.in_flight, None
        if flight.unsafe:
            self.restart(step)
            return True
        self.apply_outer_step(flight.deltas, lr, mu)
        self.merge(step, mix)
        return False

    # --- the inner optimizer's moments ---
    def moments(self, optimizer, which: str) -> list[list[torch.Tensor]]:
        """
        The tensors that hold the optimizer's `which` moment of each parameter (`[]` for a parameter without state: it
        never had a gradient, on every rank under DDP, which agrees on the unused parameters).
        """
        return [moment_tensors(optimizer, self.params[name], which) for name in self.names]

    def average_moments(self, exchange: Exchange, optimizer, keys: tuple[str, ...]) -> None:
        """
        Average the optimizer's moments `keys` of the fragment's parameters over the ranks, in place: per moment, the
        tensors that hold it flat in one fp32 row (zeros for a parameter without state), one all-reduce, divided by
        `W`, copied back. Every rank then holds the same bits. Work memory: one row at a time.
        """
        for key in keys:
            sizes = [moment_numel(optimizer, self.params[name], key) for name in self.names]
            flat = torch.zeros(sum(sizes), device=self.device)
            views, moments = [], []
            for start, tensors in zip(itertools.accumulate([0, *sizes]), self.moments(optimizer, key)):
                for moment in tensors:  # a parameter's tensors one after the other in its stretch
                    views.append(flat[start : start + moment.numel()])
                    moments.append(moment)
                    start += moment.numel()
            if moments:
                torch._foreach_copy_(views, [moment.reshape(-1) for moment in moments])
            exchange.start_mean(flat).wait()
            if moments:
                torch._foreach_copy_(moments, [view.view_as(moment) for view, moment in zip(views, moments)])
            del flat, views

    # --- saved by name ---
    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """
        What a checkpoint keeps of the fragment, by parameter name (views): `global` and `momentum` (shaped as the
        parameters' local parts), `residuals` (flat, the rows exchanged so far), `owner_residuals` (flat, the chunks
        of the blocks this rank owns).
        """

        def shaped(rows: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
            if rows is None:
                return {}
            return {name: view.view(local_tensor(self.params[name]).shape) for row, held in zip(self.rows, rows)
                    for name, view in zip(row.names, row.split(held))}  # fmt: skip

        owners = dict(self.saved_owner)
        for index, held in enumerate(self.owner_residuals):
            if held is not None:
                world_size, rank, values = held
                for name, offset, size in self.rows[index].run.owned_slots(world_size, rank):
                    owners[name] = values[offset : offset + size]
        return {
            "global": shaped(self.theta),
            "momentum": shaped(self.momentum),
            "residuals": self.by_name(self.residuals),
            "owner_residuals": owners,
        }

    def by_name(self, rows: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Each parameter's flat entries in `rows` (one per row of the fragment; `None`: none), views."""
        return {name: view for row, held in zip(self.rows, rows) if held is not None
                for name, view in zip(row.names, row.split(held))}  # fmt: skip

    def rows_from(self, by_name: dict[str, torch.Tensor], dtype=torch.float32) -> list[torch.Tensor]:
        """Rows of the fragment filled from flat tensors by name (zeros for names left out)."""
        rows = [torch.zeros(row.length, dtype=dtype, device=self.device) for row in self.rows]
        for row, held in zip(self.rows, rows):
            for name, view in zip(row.names, row.split(held)):
                if name in by_name:
                    view.copy_(by_name[name].to(self.device).reshape(-1)[: view.numel()])
        return rows

    def load(self, values: dict, momentum: dict, residuals: dict, owner_residuals: dict) -> None:
        """Restore what [`state_by_name`] gave (the names of this fragment that are there)."""
        for rows, saved in ((self.theta, values), (self.momentum or [], momentum)):
            for row, held in zip(self.rows, rows):
                for name, view in zip(row.names, row.split(held)):
                    if name in saved:
                        view.copy_(saved[name].reshape(-1))
        self.residuals = [None] * len(self.rows)
        if any(name in residuals for index in self.codec_rows for name in self.rows[index].names):
            loaded = self.rows_from(residuals, RESIDUAL_DTYPE)
            for index in self.codec_rows:
                if any(name in residuals for name in self.rows[index].names):
                    self.residuals[index] = loaded[index]
        self.owner_residuals = [None] * len(self.rows)
        codec = {name for index in self.codec_rows for name in self.rows[index].names}
        self.saved_owner = {name: value for name, value in owner_residuals.items() if name in codec}

    def nbytes(self) -> dict[str, int]:
        """Bytes held: `global`, `momentum`, `residuals` (the owners' included)."""

        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        owners = [held[2] for held in self.owner_residuals if held is not None] + list(self.saved_owner.values())
        return {"global": size(self.theta), "momentum": size(self.momentum or []),
                "residuals": size(self.residuals) + size(owners)}  # fmt: skip


__all__ = [
    "Fragment",
    "InFlight",
    "check_moments",
    "global_device",
    "merge_with_global",
    "outer_step",
    "pack_fragments",
]
