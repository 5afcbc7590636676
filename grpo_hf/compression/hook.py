"""`grpo_comm_hook`: the DDP communication hook that sends each bucket's gradients compressed, with error feedback.

It replaces DDP's dense all-reduce (register it on the DDP model, see [`GRPOCommState`]); [`compress_locally`] runs the
same steps in one process on a model's gradients. A bucket's path: this module (the DDP buckets) -> `layout.py` (its
runs of tensors) -> `state.py` (residuals, scales) -> `exchange.py` (encode, exchange, decode: the seam the three
transports share) -> `codec.py` (the kernels and messages; `sparse.py` for top-k).

Example:

```python
>>> from grpo_hf.compression import GRPOCommState, compression_plan, grpo_comm_hook

>>> state = GRPOCommState(compression_plan(model), mode="allgather").bind(model)  # the unwrapped model
>>> ddp_model.register_comm_hook(state, grpo_comm_hook)
>>> ...  # train; every logging step:
>>> state.pop_stats()["grpo/comm/ratio_fp32"]
```

## Algorithm, per optimizer step

DDP calls the hook once per bucket, in bucket order. The hook holds every bucket until the last one (its future
completes then; DDP waits for all of them at the end of the backward pass), then, on every rank:

1. One flag all-reduce: is any gradient of any rank NaN/Inf? If so, or during the first `dense_warmup_steps` steps,
   every bucket is all-reduced dense and raw, in its own dtype, as DDP would; nothing else changes (warm-up steps feed
   the gradient scales' EMA when the optimizer has no `exp_avg_sq`).
2. Otherwise, per bucket and run of tensors sharing a spec ([`~grpo_hf.compression.layout`]): the encode kernel
   compresses `grad + residual` relative to the gradient scales; the bf16 residual is replaced by what was not sent.
3. Exchange, by `state.mode`:
   - `allgather`: all-gather the bucket's messages (on gloo as a send and a receive per pair of ranks: the bytes of a
     ring all-gather, faster than gloo's own all-gather); every rank decodes the `W` messages in rank order, its own
     included, and writes the average, times the scale, into the bucket (one decode kernel per run). Two buckets
     are under way at once: while one bucket's messages travel, the next is encoded and the previous decoded.
   - `allreduce` (DeepSpeed's compressed all-reduce): the blocks each rank owns go to their owner (all-to-all); each
     owner decodes its `W` contributions in rank order, averages them, compresses the mean again with its own
     (owner-side) residual, and the owners' messages are all-gathered and decoded by every rank.
4. Tensors sent dense (`spec is None`: norms, biases, tensors below `grpo_min_compress_numel`) go through one fp32
   all-reduce per bucket.

## Bytes per rank and optimizer step (ring model, [`~grpo_hf.compression.traffic`]; `grpo/comm/bytes_sent`)

- Every compressed step: the 8-byte flag all-reduce, `2 (W - 1) / W * 8`.
- `allgather`: `(W - 1) * s` for the bucket's messages (`s` its padded message size; at 2 bits and with top-k, where
  sizes depend on the data, every rank's is padded to the longest and `(W - 1) * 8` bytes per run announce the sizes)
  plus `2 (W - 1) / W * 4 n_dense` for the dense tensors. Grows with `W`: for few workers.
- `allreduce`: `(W - 1) / W * S` for the all-to-all of this rank's messages (`S`) plus `(W - 1) * s_owner` for the
  all-gather of the owners' messages (about `S / W` each, padded to the longest) plus the dense tensors: about `2 S`
  whatever `W`.
- Warm-up and non-finite steps: `2 (W - 1) / W` times the bucket's bytes in its dtype.

The baselines `grpo/comm/bytes_dense_fp32` / `_fp16` are a plain all-reduce of every gradient at 4 / 2 bytes per
entry; `ratio_* = baseline / bytes_sent` (higher is better).

## Warnings

- Call [`GRPOCommState.bind`] with the model before the first backward, and `register_comm_hook` once per DDP
  object (a second call raises). Use one state per DDP model.
- The plan, `mode` and `dense_warmup_steps` must be identical on every rank: the collectives' sizes derive from them.
- Collectives start at the last bucket, from the hook's own thread, in the same order on every rank (torch's
  `powerSGD_hook`, which chains collectives in future callbacks, was seen to desynchronize at `W = 4` on gloo). The
  price: the communication does not overlap with the backward pass, only with the encoding and decoding of other
  buckets.
- Memory per compressed entry and rank: the bf16 residual (2 bytes); with gradient scales and an optimizer without
  `exp_avg_sq` (or none attached), the fp32 EMA of its square (4 bytes); in `allreduce` mode also the bf16 residual
  of the owned blocks (`2 / W` bytes). Work buffers, kept from step to step, hold for each bucket under way (two at
  once in `allgather` mode) its bf16 scales (2 bytes per entry, with gradient scales) and every rank's messages
  (`W * bits / 8` bytes per entry); new residuals pass through a scratch of
  [`~grpo_hf.compression.codec.ENCODE_CHUNK`] entries. Compiling the kernels costs a fixed amount of host memory for
  torch.compile itself.
- Sparse gradients (`nn.Embedding(sparse=True)`), FSDP and DeepSpeed are not supported.

## An emulated slow link (a benchmark tool)

With the environment variable `GRPO_HF_EMULATED_LINK_GBIT` set, the hook's collectives
([`~grpo_hf.compression.exchange.Collectives`]) wait for an emulated slow link: see `exchange.py`.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .codec import all_safe
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
    take_owned,
    walk_messages,
)
from .layout import BucketLayout, Run
from .state import GRPOCommState
from .traffic import FLAG_BYTES, SIZE_BYTES, allgather_bytes, allreduce_bytes, alltoall_bytes


# Buckets whose all-gather may be under way at once (`allgather` mode): while one bucket's messages travel, the next
# bucket is encoded and the previous one decoded. Each holds its own work buffers until it is decoded.
_IN_FLIGHT = 2


@dataclass
class _Bucket:
    """What the step needs of a DDP bucket: its flat buffer, and per tensor its name, parameter, size and offset."""

    buffer: torch.Tensor
    names: list[str | None]
    params: list[nn.Parameter]
    numels: list[int]
    starts: list[int]
    future: torch.futures.Future | None = None


def _offsets(buffer: torch.Tensor, grads: list[torch.Tensor]) -> list[int]:
    """First entry of each gradient in the buffer (they are views of it, one after the other)."""
    starts, start = [], 0
    for grad in grads:
        shares = grad.numel() and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        starts.append(grad.storage_offset() - buffer.storage_offset() if shares else start)
        start = starts[-1] + grad.numel()
    return starts


def grpo_comm_hook(state: GRPOCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""
    DDP communication hook: the bucket's gradients averaged over the ranks, compressed with error feedback as
    `state.plan` and `state.mode` say (see the module docstring).

    The module does not use `from __future__ import annotations`: DDP's `register_comm_hook` compares this
    function's annotations with `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` as objects.

    Args:
        state (`GRPOCommState`): plan, residuals and statistics; [`GRPOCommState.bind`] must have been called.
        bucket (`torch.distributed.GradBucket`): the bucket of flattened gradients DDP hands to the hook.

    Returns:
        A `torch.futures.Future` holding `bucket.buffer()`; it completes, with the averaged gradients in the buffer,
        when the step's last bucket has been handed over.
    """
    start = time.perf_counter()
    if not state.names or state.kernels is None:  # (an unpickled state has no kernels: bind it again)
        raise RuntimeError("grpo_comm_hook: call `state.bind(model)` before the first backward pass.")
    buffer = bucket.buffer()
    params = list(bucket.parameters())
    names = [state.names.get(id(p)) for p in params]
    if None in names:
        state.warn_once("unknown", "a DDP bucket holds a parameter that `bind` did not see; it is sent dense.")
    numels = [p.numel() for p in params]
    key = (tuple(names), tuple(numels))
    starts = state.bucket_starts.get(key)
    if starts is None:  # once per layout: where each gradient lies in the buffer
        starts = state.bucket_starts[key] = _offsets(buffer, [g.view(-1) for g in bucket.gradients()])
    future = torch.futures.Future(devices=[buffer.device]) if buffer.device.type != "cpu" else torch.futures.Future()
    state.pending.append(_Bucket(buffer, names, params, numels, starts, future))
    state.hook_calls += 1
    if not bucket.is_last():
        state.stats.hook_ms += (time.perf_counter() - start) * 1000
        return future
    buckets, state.pending = state.pending, []
    dense, compressed = _run_step(state, Collectives(state), buckets, state.world_size)
    for held in buckets:
        held.future.set_result(held.buffer)
    state.stats.hook_ms += (time.perf_counter() - start) * 1000
    state.commit_step(dense=dense, compressed=compressed)
    return future


def compress_locally(state: GRPOCommState, model: nn.Module) -> None:
    """
    The hook's compression in one process (the article's sparse updates): replace every `p.grad` by its compressed
    and decoded value, with error feedback. Call it after the backward of the last micro-batch, before clipping and
    `optimizer.step`. Warm-up steps and steps with NaN/Inf gradients leave the gradients untouched (the latter also
    the residuals).

    Nothing is sent, so the bytes are those one of `state.simulated_world_size` workers would send, from the sizes of
    this process's messages (the formulas of the module docstring). In `allreduce` mode the gradients are compressed
    twice (the worker's compression, then the owner's), as each worker's contribution would be.

    Args:
        state (`GRPOCommState`): the compression state (bound to `model` if it was not yet).
        model (`torch.nn.Module`): the model whose gradients to compress.
    """
    start = time.perf_counter()
    if not state.names or state.kernels is None:
        state.bind(model)
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    numels = [p.numel() for p in params]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    buffer = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
    names = [state.names.get(id(p)) for p in params]
    bucket = _Bucket(buffer, names, params, numels, starts)
    dense, compressed = _run_step(
        state, Collectives(state, world_size=1, rank=0), [bucket], state.simulated_world_size
    )
    if compressed:
        torch._foreach_copy_([p.grad.view(-1) for p in params], list(torch.split(buffer, numels)))
    state.hook_calls += 1
    state.stats.hook_ms += (time.perf_counter() - start) * 1000
    state.commit_step(dense=dense, compressed=compressed)


def _run_step(state: GRPOCommState, comm: Collectives, buckets: list[_Bucket], count_as: int) -> tuple[bool, bool]:
    """
    One optimizer step over its buckets (see the module docstring); `count_as`: the world size bytes count for.
    Returns `(dense, compressed)`: whether the step counts as dense (warm-up, or a NaN/Inf on some rank) and whether
    any gradient went through the codec.
    """
    stats = state.stats
    layouts = [state.layout(b.names, b.numels, b.starts) for b in buckets]
    plain = state.warming_up or not any(layout.runs for layout in layouts)  # nothing to compress: as DDP does
    unsafe = False
    if not plain:
        flag = torch.tensor([int(not all_safe([b.buffer for b in buckets]))], device=buckets[0].buffer.device)
        unsafe = bool(comm.all_reduce(flag, op=dist.ReduceOp.MAX).item())
        stats.bytes_sent += allreduce_bytes(FLAG_BYTES, count_as)
    under_way = deque()  # the finishing steps of the buckets whose all-gather is under way, oldest first
    for index, (bucket, layout) in enumerate(zip(buckets, layouts)):
        stats.baseline(bucket.buffer.numel(), count_as)
        if plain or unsafe:
            comm.all_reduce(bucket.buffer).div_(comm.world_size)
            stats.bytes_sent += allreduce_bytes(bucket.buffer.numel() * bucket.buffer.element_size(), count_as)
            stats.kept += bucket.buffer.numel()
            continue
        if state.mode == "allreduce":
            _allreduce(state, comm, layout, bucket, count_as)
            continue
        under_way.append(_allgather(state, comm, layout, bucket, count_as, lane=index % _IN_FLIGHT))
        if len(under_way) == _IN_FLIGHT:  # its lane is the next bucket's
            under_way.popleft()()
    while under_way:
        under_way.popleft()()
    if plain:
        if not all_safe([b.buffer for b in buckets]):  # the same answer on every rank: the buffers are averaged
            unsafe = True
        elif state.warming_up:
            _track_dense_scales(state, buckets)
    if unsafe:
        state.mark_nonfinite()
    return state.warming_up or unsafe, not (plain or unsafe)


class _DenseTensors:
    """The tensors of a bucket sent dense: read before the decode (which may write over them), written after it."""

    def __init__(self, comm: Collectives, stats, buffer: torch.Tensor, dense: tuple, count_as: int):
        self.pieces = [buffer[start : start + numel] for start, numel in dense]
        self.vector = torch.cat(self.pieces).float() if self.pieces else None  # (a copy: the pieces are views)
        self.world_size = comm.world_size
        if self.vector is not None:
            self.reduced = comm.start_all_reduce(self.vector)
            stats.dense(self.vector.numel(), count_as)

    def write(self) -> None:
        if self.vector is not None:
            self.reduced.wait().div_(self.world_size)
            torch._foreach_copy_(self.pieces, list(torch.split(self.vector, [p.numel() for p in self.pieces])))


def _track_dense_scales(state: GRPOCommState, buckets: list[_Bucket]) -> None:
    """
    Warm-up steps: the scales' EMA takes in the (already averaged) dense gradients, in place. Not while an optimizer
    is attached: its `exp_avg_sq` will be the scales (should it have none, the EMA starts with compression).
    """
    if not state.scale_gradients or state.optimizer is not None:
        return
    beta = state.scale_beta
    for bucket in buckets:
        for run in state.layout(bucket.names, bucket.numels, bucket.starts).runs:
            ema = state.squares.row(run.key, run.slots, run.length, bucket.buffer.device)
            averaged = run.rows(bucket.buffer).view(-1)
            averaged = averaged if averaged.dtype == torch.float32 else averaged.float()
            ema.mul_(beta).addcmul_(averaged, averaged, value=1.0 - beta)
            state.ema_updated = True


def _params(run: Run, bucket: _Bucket) -> list[nn.Parameter]:
    """The parameters of every tensor in the run's row (the dense ones it spans included)."""
    return [bucket.params[index] for index, _, _ in run.covered]


# ----------------------------------------------------------------------------------------------------------------
# The two exchanges
# ----------------------------------------------------------------------------------------------------------------


def _allgather(
    state: GRPOCommState, comm: Collectives, layout: BucketLayout, bucket: _Bucket, count_as: int, lane: int = 0
) -> Callable[[], None]:
    """
    Every rank's messages to every rank; each rank decodes them all in rank order, into the bucket. Encodes the bucket
    and starts its all-gather (into the work buffers of its `lane`, one per bucket under way); returns the function
    that waits for it and decodes.
    """
    stats, world_size, device = state.stats, comm.world_size, bucket.buffer.device
    fixed = [message_nbytes(run.spec, run.num_blocks) for run in layout.runs]
    payload, fixed_sizes = None, all(size is not None for size in fixed)
    if fixed_sizes:  # sizes known: encode straight into this rank's part of the gather
        total = sum(fixed)
        gathered = state.buffer(("gathered", lane), world_size * total, device, torch.uint8)
        payload = gathered[comm.rank * total : (comm.rank + 1) * total]
        slots = split_messages(payload, fixed)
    messages, scales, offset = [], [], 0
    for index, run in enumerate(layout.runs):
        rows = run.rows(bucket.buffer)
        scale, ema = state.scales_for(run, _params(run, bucket), device, offset, lane)
        offset += run.length
        residual = state.residuals.row(run.key, run.slots, run.length, device).view(rows.shape)
        slot = None if payload is None else slots[index]
        message, new_residual = encode(state.kernels, run.spec, rows, residual, scale, state.scale_clip,
                                       run.num_values(), slot, in_place=True)  # fmt: skip
        state.residuals.replace(run.key, run.slots, new_residual)
        messages.append(message)
        scales.append((scale, ema))
        stats.kept += min(run.num_values(), run.numel)
    dense = _DenseTensors(comm, stats, bucket.buffer, layout.dense, count_as)
    if fixed_sizes:  # in place: the input is this rank's part of the output
        exchange = comm.start_all_gather(payload, gathered, tag=lane)
        stats.bytes_sent += allgather_bytes(payload.numel(), count_as)
    else:  # sizes depend on the data: announce each rank's total, pad to the longest, read the messages' headers
        payload = torch.cat(messages)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        totals = comm.all_gather(size, tag=lane).view(-1).tolist()  # (the other lane's tag may be under way)
        stats.bytes_sent += allgather_bytes(SIZE_BYTES, count_as)
        longest = max(totals)
        exchange = comm.start_all_gather(torch.nn.functional.pad(payload, (0, longest - payload.numel())), tag=lane)
        stats.bytes_sent += allgather_bytes(longest, count_as)

    def finish() -> None:
        gathered = exchange.wait()
        if fixed_sizes:
            per_rank = [split_messages(gathered[r], fixed) for r in range(world_size)]
        else:
            runs = [(run.spec, run.num_blocks) for run in layout.runs]
            per_rank = [walk_messages(gathered[r], runs) for r in range(world_size)]
        for index, (run, (scale, ema)) in enumerate(zip(layout.runs, scales)):
            out = run.rows(bucket.buffer) if run.in_place else None
            values, new_ema = decode(state.kernels, run.spec, [per_rank[r][index] for r in range(world_size)],
                                     run.num_blocks, scale, world_size, out, ema, state.scale_beta)  # fmt: skip
            if out is None:
                run.write(bucket.buffer, values)
            if new_ema is not None:
                state.squares.replace(run.key, run.slots, new_ema)
                state.ema_updated = True
        dense.write()

    return finish


def _allreduce(state: GRPOCommState, comm: Collectives, layout: BucketLayout, bucket: _Bucket, count_as: int):
    """Owners average and re-compress the blocks they own (with their own residual); their messages are gathered."""
    stats, world_size, rank, device = state.stats, comm.world_size, comm.rank, bucket.buffer.device
    block_rows = [owned_blocks(run, world_size, device) for run in layout.runs]  # per run and rank: (ranges, index)
    counts = [[index.numel() for _, index in owned] for owned in block_rows]  # per run and rank: blocks owned
    fixed = [
        [message_nbytes(run.spec, count[r]) for run, count in zip(layout.runs, counts)] for r in range(world_size)
    ]
    known = all(size is not None for sizes in fixed for size in sizes)
    empty = torch.zeros(0, dtype=torch.uint8, device=device)
    to_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    if known:  # sizes known: every message is written in place into one send buffer
        send_sizes = [sum(sizes) for sizes in fixed]
        send = state.buffer("send", sum(send_sizes), device, torch.uint8)
        to_rank = [split_messages(piece, sizes) for piece, sizes in zip(split_messages(send, send_sizes), fixed)]
    scales, offset = [], 0
    for index, (run, owned) in enumerate(zip(layout.runs, block_rows)):
        rows = run.rows(bucket.buffer)
        scale, ema = state.scales_for(run, _params(run, bucket), device, offset)
        offset += run.length
        residual = state.residuals.row(run.key, run.slots, run.length, device).view(rows.shape)
        ks = None  # top-k: the values each owner's message keeps
        if run.spec.density < 1.0:
            block = run.spec.block_size
            ks = [run.num_values(n * block, run.owned_numel(world_size, r)) for r, n in enumerate(counts[index])]
        mine = [m[index] for m in to_rank] if known else None
        messages, new_residual = encode_to_owners(
            state.kernels, run.spec, rows, residual, owned, scale, state.scale_clip, ks, mine
        )
        if not known:
            for owner, message in enumerate(messages):
                to_rank[owner].append(message)
        if ks is None:
            stats.kept += min(run.num_values(), run.numel)
        else:
            for owner, k in enumerate(ks):
                if counts[index][owner]:
                    stats.kept += min(k, run.owned_numel(world_size, owner))
        state.residuals.replace(run.key, run.slots, new_residual)
        scales.append((scale, ema))
    dense = _DenseTensors(comm, stats, bucket.buffer, layout.dense, count_as)

    def reduce_into(contributions: list[torch.Tensor], message: torch.Tensor | None = None) -> list[torch.Tensor]:
        """
        The owner's half: per run, the `W` contributions (rank order, each this rank's messages of every run) to the
        blocks this rank owns averaged and compressed again with its owner residual; into `message` (the runs'
        messages one after the other) when sizes are known. Returns the message of each run.
        """
        if known:
            parts = [split_messages(c, fixed[rank]) for c in contributions]
            slots = split_messages(message, fixed[rank])
        else:
            mine_runs = [(run.spec, count[rank]) for run, count in zip(layout.runs, counts)]
            parts, slots = [walk_messages(c, mine_runs) for c in contributions], [None] * len(layout.runs)
        out_messages = []
        for index, (run, owned, (scale, _)) in enumerate(zip(layout.runs, block_rows, scales)):
            nblocks = counts[index][rank]
            if nblocks == 0:
                out_messages.append(empty)
                continue
            mine = None if scale is None else take_owned(scale, owned[rank])
            key, owner_slots = (run.key, world_size, rank), run.owned_slots(world_size, rank)
            residual = state.owner_residuals.row(key, owner_slots, nblocks * run.spec.block_size, device)
            k = run.num_values(nblocks * run.spec.block_size, run.owned_numel(world_size, rank))
            message, new_residual = reduce_owned(state.kernels, run.spec, [p[index] for p in parts],
                                                 residual.view(nblocks, -1), mine, state.scale_clip, k,
                                                 slots[index])  # fmt: skip
            state.owner_residuals.replace(key, owner_slots, new_residual)
            out_messages.append(message)
        return out_messages

    if known:  # the owner's message written in place into the all-gather's payload
        payload = state.buffer("owned", max(send_sizes), device, torch.uint8)
        owner_messages, nbytes = exchange_with_owners(comm, send, send_sizes, reduce_into, payload, count_as)
        stats.bytes_sent += nbytes
        per_owner = [split_messages(message, sizes) for message, sizes in zip(owner_messages, fixed)]
    else:  # sizes depend on the data: announce them (every rank learns every rank's total, to count the same bytes)
        sends = [torch.cat(parts) if parts else empty for parts in to_rank]
        send, send_splits = torch.cat(sends), [s.numel() for s in sends]
        meta = torch.tensor(send_splits, dtype=torch.int64, device=device)
        recv_totals = comm.all_to_all(meta, [1] * world_size, [1] * world_size).tolist()
        totals = comm.all_gather(meta.sum().view(1)).view(-1).tolist()
        stats.bytes_sent += alltoall_bytes(SIZE_BYTES * world_size, count_as) + allgather_bytes(SIZE_BYTES, count_as)
        stats.bytes_sent += alltoall_bytes(sum(totals) / world_size, count_as)
        received = comm.all_to_all(send, send_splits, recv_totals)
        payload = torch.cat(reduce_into(split_messages(received, recv_totals)))
        totals = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device)).view(-1).tolist()
        stats.bytes_sent += allgather_bytes(SIZE_BYTES, count_as)
        longest = max(totals)
        gathered = comm.all_gather(torch.nn.functional.pad(payload, (0, longest - payload.numel())))
        stats.bytes_sent += allgather_bytes(longest if world_size > 1 else longest / count_as, count_as)
        per_owner = [
            walk_messages(gathered[r], [(run.spec, count[r]) for run, count in zip(layout.runs, counts)])
            for r in range(world_size)
        ]

    # Every rank decodes the owners' messages, in owner order.
    for index, (run, owned, (scale, ema)) in enumerate(zip(layout.runs, block_rows, scales)):
        out = run.rows(bucket.buffer) if run.in_place else None
        parts = [per_owner[r][index] for r in range(world_size)]
        values, new_ema = decode_from_owners(state.kernels, run.spec, parts, owned, run.num_blocks, scale, out, ema,
                                             state.scale_beta)  # fmt: skip
        if new_ema is not None:
            state.squares.replace(run.key, run.slots, new_ema)
            state.ema_updated = True
        if out is None:
            run.write(bucket.buffer, values.to(bucket.buffer.dtype))
    dense.write()


__all__ = ["GRPOCommState", "compress_locally", "grpo_comm_hook"]
