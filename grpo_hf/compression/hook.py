"""`grpo_comm_hook`: the DDP communication hook that sends each bucket's gradients compressed, with error feedback.

It replaces DDP's dense all-reduce (register it on the DDP model, see [`GRPOCommState`]); [`compress_locally`] runs the
same steps in one process on a model's gradients. A bucket's path: this module (the DDP buckets) -> `layout.py` (its
runs of tensors) -> `state.py` (residuals) -> `exchange.py` ([`~grpo_hf.compression.exchange.Exchange`]:
encode with error feedback, exchange, decode; the one exchange of the three transports) -> `codes/` (the code of each
run: block codes, top-k) -> `codec.py` (the kernels and block messages).

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
   every bucket is all-reduced dense and raw, in its own dtype, as DDP would; nothing else changes.
2. Otherwise, per bucket and run of tensors sharing a spec ([`~grpo_hf.compression.layout`]): the encode kernel
   compresses `grad + residual`; the bf16 residual is replaced by what was not sent.
3. Exchange, by `state.mode`:
   - `allgather`: all-gather the bucket's messages (on gloo as a send and a receive per pair of ranks: the bytes of a
     ring all-gather, faster than gloo's own all-gather); every rank decodes the `W` messages in rank order, its own
     included, and writes the average into the bucket (one decode kernel per run). Two buckets
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
- Memory per compressed entry and rank: the bf16 residual (2 bytes); in `allreduce` mode also the bf16 residual of
  the owned blocks (`2 / W` bytes). Work buffers, kept from step to step, hold for each bucket under way (two at once
  in `allgather` mode) every rank's messages (`W * bits / 8` bytes per entry); new residuals pass through a scratch of
  [`~grpo_hf.compression.codes.base.ENCODE_CHUNK`] entries. Compiling the kernels costs a fixed amount of host memory for
  torch.compile itself.
- Sparse gradients (`nn.Embedding(sparse=True)`), FSDP and DeepSpeed are not supported.
"""

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .codec import all_safe
from .communicator import Communicator, SoloCommunicator
from .exchange import Exchange, Part
from .layout import BucketLayout
from .row_store import StoredRow


# Buckets whose all-gather may be under way at once (`allgather` mode): while one bucket's messages travel, the next
# bucket is encoded and the previous one decoded. Each holds its own work buffers until it is decoded.
_IN_FLIGHT = 2


@dataclass
class _Bucket:
    """What the step needs of a DDP bucket: its flat buffer, and per tensor its name, size and offset."""

    buffer: torch.Tensor
    names: list[str | None]
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


def grpo_comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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
    state.pending.append(_Bucket(buffer, names, numels, starts, future))
    state.hook_calls += 1
    if not bucket.is_last():
        state.stats.hook_ms += (time.perf_counter() - start) * 1000
        return future
    buckets, state.pending = state.pending, []
    dense, compressed = _run_step(state, state.communicator, buckets, state.world_size)
    for held in buckets:
        held.future.set_result(held.buffer)
    state.stats.hook_ms += (time.perf_counter() - start) * 1000
    state.commit_step(dense=dense, compressed=compressed)
    return future


def compress_locally(state, model: nn.Module) -> None:
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
    bucket = _Bucket(buffer, names, numels, starts)
    dense, compressed = _run_step(state, SoloCommunicator(), [bucket], state.simulated_world_size)
    if compressed:
        torch._foreach_copy_([p.grad.view(-1) for p in params], list(torch.split(buffer, numels)))
    state.hook_calls += 1
    state.stats.hook_ms += (time.perf_counter() - start) * 1000
    state.commit_step(dense=dense, compressed=compressed)


def _run_step(state, comm: Communicator, buckets: list[_Bucket], count_as: int) -> tuple[bool, bool]:
    """
    One optimizer step over its buckets (see the module docstring); `count_as`: the world size bytes count for.
    Returns `(dense, compressed)`: whether the step counts as dense (warm-up, or a NaN/Inf on some rank) and whether
    any gradient went through the codec.
    """
    stats = state.stats
    exchange = Exchange(state.kernels, comm, stats, count_as, workspace=state.buffer, count_kept=True)
    layouts = [state.layout(b.names, b.numels, b.starts) for b in buckets]
    plain = state.warming_up or not any(layout.runs for layout in layouts)  # nothing to compress: as DDP does
    unsafe = False
    if not plain:
        flag = exchange.agree_flag(not all_safe([b.buffer for b in buckets]), buckets[0].buffer.device)
        unsafe = bool(flag.wait().item())
    under_way = deque()  # the all-gathers under way and what finishes their buckets, oldest first
    for index, (bucket, layout) in enumerate(zip(buckets, layouts)):
        stats.baseline(bucket.buffer.numel(), count_as)
        if plain or unsafe:  # the bucket as it is, in its dtype
            exchange.start_mean(bucket.buffer).wait()
            continue
        lane = index % _IN_FLIGHT if state.mode == "allgather" else 0
        parts = _parts(state, comm, layout, bucket)
        dense = _DenseTensors(exchange, bucket.buffer, layout.dense)  # read before the decode writes the bucket
        if not parts:  # nothing in the bucket to compress: its tensors go dense alone
            dense.write()
            continue
        if state.mode == "allreduce":
            exchange.reduce_with_owners(parts)
            dense.write()
            continue
        under_way.append((exchange.start_all_gather(parts, tag=lane), dense))
        if len(under_way) == _IN_FLIGHT:  # its lane is the next bucket's
            gathered, dense = under_way.popleft()
            gathered.finish()
            dense.write()
    while under_way:
        gathered, dense = under_way.popleft()
        gathered.finish()
        dense.write()
    if plain and not all_safe([b.buffer for b in buckets]):  # the same answer on every rank: the buffers are averaged
        unsafe = True
    if unsafe:
        state.mark_nonfinite()
    return state.warming_up or unsafe, not (plain or unsafe)


def _parts(state, comm: Communicator, layout: BucketLayout, bucket: _Bucket) -> list[Part]:
    """
    The bucket's runs as parts of the exchange: the rows (a view of the bucket, or a padded copy), the bf16 residual
    and owner residual rows of the state.
    """
    parts, device = [], bucket.buffer.device
    for run in layout.runs:
        owner = None
        if state.mode == "allreduce":
            owned = run.owned_blocks(comm.world_size)[comm.rank].numel() * run.spec.block_size
            key = (run.key, comm.world_size, comm.rank)
            owner = StoredRow(state.owner_residuals, key, run.owned_slots(comm.world_size, comm.rank), owned, device)
        parts.append(
            Part(
                run,
                run.rows(bucket.buffer),
                StoredRow(state.residuals, run.key, run.slots, run.length, device),
                run.rows(bucket.buffer) if run.in_place else None,
                lambda values, run=run: run.write(bucket.buffer, values),
                owner,
            )  # fmt: skip
        )
    return parts


class _DenseTensors:
    """The tensors of a bucket sent dense (one fp32 all-reduce): read before the decode (which may write over them),
    written after it."""

    def __init__(self, exchange: Exchange, buffer: torch.Tensor, dense: tuple):
        self.pieces = [buffer[start : start + numel] for start, numel in dense]
        self.vector = torch.cat(self.pieces).float() if self.pieces else None  # (a copy: the pieces are views)
        if self.vector is not None:
            self.mean = exchange.start_mean(self.vector)

    def write(self) -> None:
        if self.vector is not None:
            self.mean.wait()
            torch._foreach_copy_(self.pieces, list(torch.split(self.vector, [p.numel() for p in self.pieces])))


__all__ = ["compress_locally", "grpo_comm_hook"]
