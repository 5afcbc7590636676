"""`grpo_comm_hook`: the DDP communication hook that sends each bucket's gradients compressed, with error feedback.

It replaces DDP's dense all-reduce (register it on the DDP model, see [`GRPOCommState`]); [`compress_locally`] runs the
same steps in one process on a model's gradients. A bucket's path: this module (the exchange) -> `layout.py` (its
runs of tensors) -> `state.py` (residuals, scales) -> `codec.py` (the kernels and messages; `sparse.py` for top-k).

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

With the environment variable `GRPO_HF_EMULATED_LINK_GBIT` set (e.g. `1`) when the process starts, every collective of
[`Collectives`] (this hook's, and the sync every H steps' in `outer_sync.py`) completes no earlier than the link
would have carried the bytes this rank sends in it ([`EmulatedLink`]); the wait is in `Started.wait()`, so that what
runs between the start and the wait overlaps with it. `benchmarks/bench_step_cost.py --link_gbit` sets it, and
delays the baselines' DDP hooks the same way (`benchmarks/emulated_link.py`). Not a training setting. FSDP2's
compressed reduce-scatter (`fsdp.py`) calls torch's collectives itself and is not emulated, nor are FSDP2's own.
"""

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .codec import BlockMessages, all_safe, code_shape
from .layout import BucketLayout, Run
from .sparse import TopKMessages
from .state import GRPOCommState
from .traffic import allgather_bytes, allreduce_bytes, alltoall_bytes


_FLAG_BYTES = 8  # the step's non-finite flag (int64)
_SIZE_BYTES = 8  # one message size (int64)
# Buckets whose all-gather may be under way at once (`allgather` mode): while one bucket's messages travel, the next
# bucket is encoded and the previous one decoded. Each holds its own work buffers until it is decoded.
_IN_FLIGHT = 2


LINK_ENV = "GRPO_HF_EMULATED_LINK_GBIT"


class EmulatedLink:
    r"""
    A slow link between the ranks, emulated on a fast one (loopback) so that a benchmark measures what the link costs,
    overlap included, instead of adding `bytes / speed` to a step measured without it.

    One transfer at a time, as one network interface sends: a collective started at `t` with `nbytes` to send (what
    this rank sends under the ring model of [`~grpo_hf.compression.traffic`], the same count as
    `grpo/comm/bytes_sent`) arrives at `max(t, end of the transfers already on the link) + nbytes / bytes_per_second`.
    Its handle's wait blocks until then, and until the real collective is done. Latency is not emulated, only
    bandwidth; so the emulated wire time of a step is its `bytes_sent` divided by the speed, the projection's figure.

    A benchmark tool, not a training setting: it is turned on by the environment variable `GRPO_HF_EMULATED_LINK_GBIT`
    (Gbit/s), read once when this module is imported, rather than by a `GRPOConfig` field. The variable reaches every
    rank of a `torchrun` launch and any training script unchanged, with no code in the workers; and a setting read
    once costs nothing per collective when it is off ([`EMULATED_LINK`] is then `None`). `benchmarks/` delays the
    collectives that do not go through [`Collectives`] (DDP's own all-reduce, torch's hooks) on the same object.

    Args:
        gbit (`float`): the link's speed in Gbit/s (10^9 bits per second), above 0.
    """

    def __init__(self, gbit: float):
        if not gbit > 0:
            raise ValueError(f"the emulated link's speed must be above 0 Gbit/s, got {gbit}.")
        self.gbit = gbit
        self.bytes_per_second = gbit * 1e9 / 8
        self.free_at = 0.0  # `time.perf_counter()` at which the transfers already on the link are done
        self._lock = threading.Lock()  # DDP may call a hook on the autograd engine's threads

    @classmethod
    def from_environment(cls) -> "EmulatedLink | None":
        """The link `GRPO_HF_EMULATED_LINK_GBIT` asks for; `None` when it is unset or empty."""
        value = os.environ.get(LINK_ENV, "").strip()
        if not value:
            return None
        try:
            return cls(float(value))
        except ValueError as err:
            raise ValueError(f"{LINK_ENV}={value!r}: use a speed in Gbit/s above 0, e.g. 1 or 10 ({err}).") from None

    def reserve(self, nbytes: float) -> float:
        """Put `nbytes` on the link now; returns the `time.perf_counter()` time at which they have arrived."""
        with self._lock:
            self.free_at = max(time.perf_counter(), self.free_at) + nbytes / self.bytes_per_second
            return self.free_at

    @staticmethod
    def wait_until(deadline: float) -> None:
        """Sleep until `time.perf_counter()` reaches `deadline` (at once if it has)."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


EMULATED_LINK: EmulatedLink | None = EmulatedLink.from_environment()


class Collectives:
    """
    The collectives of one process group (`state.process_group`, or `group` when given: the same ranks in the same
    order), timed; at world size 1 every call returns its input. Under an [`EmulatedLink`] (read from
    [`EMULATED_LINK`] when built) each one also waits for the link.
    """

    def __init__(self, state: GRPOCommState, world_size: int | None = None, rank: int | None = None, group=None):
        self.group = state.process_group if group is None else group
        self.world_size = state.world_size if world_size is None else world_size
        self.rank = state.rank if rank is None else rank
        self.stats = state.stats
        self.link = EMULATED_LINK
        # gloo's all-gather moves large tensors several times slower than its send/recv (benchmarks/LOG.md)
        self.point_to_point = self.world_size > 1 and dist.get_backend(self.group) == "gloo"

    def _timed(self, start: float) -> None:
        self.stats.comm_ms += (time.perf_counter() - start) * 1000

    def _on_link(self, nbytes: float) -> float | None:
        """When `nbytes` sent now arrive over the emulated link; `None` without one."""
        return None if self.link is None else self.link.reserve(nbytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return self.start_all_reduce(tensor, op).wait()

    def start_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> "Started":
        """An in-place all-reduce of `tensor`, under way; `wait()` returns `tensor`."""
        if self.world_size == 1:
            return Started(self, [], tensor)
        start = time.perf_counter()
        not_before = self._on_link(allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size))
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        self._timed(start)
        return Started(self, [work], tensor, not_before)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, tag: int = 0) -> torch.Tensor:
        """
        `[W, *tensor.shape]`: every rank's `tensor`, in rank order (equal sizes on every rank), written into `out`
        (`W * tensor.numel()` entries) when given; `tensor` may be this rank's part of `out` (gathered in place).
        """
        return self.start_all_gather(tensor, out, tag).wait()

    def start_all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, tag: int = 0) -> "Started":
        """[`all_gather`], under way; `wait()` returns its result. `tag` tells apart send/recv pairs under way at once."""
        if self.world_size == 1:
            return Started(self, [], tensor.unsqueeze(0) if out is None else out.view(1, *tensor.shape))
        start = time.perf_counter()
        if out is None:
            out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        mine = tensor.contiguous().view(-1)
        not_before = self._on_link(allgather_bytes(mine.numel() * mine.element_size(), self.world_size))
        if self.point_to_point and mine.device.type == "cpu":  # each rank's part to every other: a ring's bytes
            parts = out.view(self.world_size, -1)
            if mine.data_ptr() != parts[self.rank].data_ptr():
                parts[self.rank].copy_(mine)
            works = []
            for peer in range(self.world_size):
                if peer != self.rank:
                    works.append(dist.isend(mine, group=self.group, group_dst=peer, tag=tag))
                    works.append(dist.irecv(parts[peer], group=self.group, group_src=peer, tag=tag))
        else:
            works = [dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)]
        self._timed(start)
        return Started(self, works, out.view(self.world_size, *tensor.shape), not_before)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """`all_to_all_single` with uneven splits: `send_splits[j]` elements go to rank `j`."""
        if self.world_size == 1:
            return send
        start = time.perf_counter()
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        not_before = self._on_link(alltoall_bytes(send.numel() * send.element_size(), self.world_size))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        if not_before is not None:
            EmulatedLink.wait_until(not_before)
        self._timed(start)
        return recv


class Started:
    """
    A collective under way: [`wait`] returns its result; the time spent waiting counts as communication. Under an
    [`EmulatedLink`], `not_before` is when its bytes have crossed the link: [`wait`] returns no earlier.
    """

    def __init__(self, collectives: Collectives, works: list, result: torch.Tensor, not_before: float | None = None):
        self.collectives, self.works, self.result, self.not_before = collectives, works, result, not_before

    def wait(self) -> torch.Tensor:
        if self.works or self.not_before is not None:
            start = time.perf_counter()
            for work in self.works:
                work.wait()
            if self.not_before is not None:
                EmulatedLink.wait_until(self.not_before)
            self.works, self.not_before = [], None
            self.collectives._timed(start)
        return self.result


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
        stats.bytes_sent += allreduce_bytes(_FLAG_BYTES, count_as)
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


_MAX_SLICES = 8  # owned blocks in more ranges than this are gathered with an index instead of slices


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Two `[n, m]` tensors of narrow entries (codes, bf16) seen as int64 words when the bytes of both allow, else as
    they are: the same memory, and `index_select` / `index_copy_` move 8 bytes per element instead of 1 or 2 (several
    times faster on CPU).
    """

    def fits(t: torch.Tensor) -> bool:
        nbytes = t.shape[-1] * t.element_size() if t.dim() == 2 else 0
        return t.element_size() < 8 and nbytes > 0 and nbytes % 8 == 0 and t.is_contiguous() and t.data_ptr() % 8 == 0

    if fits(a) and fits(b):
        return a.view(torch.int64), b.view(torch.int64)
    return a, b


def _take(rows: torch.Tensor, owned: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `owned` (`(ranges, index)`), one after the other (a view when there is one range and no `out`)."""
    ranges, index = owned
    if len(ranges) > _MAX_SLICES:
        if out is None:
            out = torch.empty(index.numel(), *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        rows_words, out_words = _as_words(rows, out)
        torch.index_select(rows_words, 0, index, out=out_words)
        return out
    if out is None and len(ranges) == 1:
        return rows[ranges[0][0] : ranges[0][1]]
    pieces = [rows[start:end] for start, end in ranges]
    if out is None:
        return torch.cat(pieces) if pieces else rows[:0]
    return torch.cat(pieces, out=out) if pieces else out


def _put(rows: torch.Tensor, owned: tuple, values: torch.Tensor) -> None:
    """Inverse of [`_take`]: write `values` into the rows of `owned`."""
    ranges, index = owned
    if len(ranges) > _MAX_SLICES:
        rows_words, values_words = _as_words(rows, values.contiguous())
        rows_words.index_copy_(0, index, values_words)
        return
    offset = 0
    for start, end in ranges:
        rows[start:end].copy_(values[offset : offset + end - start])
        offset += end - start


def _count(owned: tuple) -> int:
    return owned[1].numel()


def _split(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for size in sizes:
        out.append(buffer[start : start + size])
        start += size
    return out


# ----------------------------------------------------------------------------------------------------------------
# Encoding and decoding one run (or the blocks of it one rank owns)
# ----------------------------------------------------------------------------------------------------------------


def _message_size(spec, nblocks: int) -> int | None:
    """Bytes of the message of `nblocks` blocks; `None` when data-dependent (2 bits, top-k)."""
    return None if spec.density < 1.0 else BlockMessages(spec).fixed_nbytes(nblocks)


def _walk(buffer: torch.Tensor, runs: list[tuple]) -> list[torch.Tensor]:
    """Cut a rank's messages (one per `(spec, blocks)` in `runs`, in order; none for no blocks) out of `buffer`."""
    out, offset = [], 0
    for spec, nblocks in runs:
        if nblocks == 0:
            size = 0
        elif spec.density < 1.0:
            size = TopKMessages(spec).read_nbytes(buffer[offset:])
        else:
            size = BlockMessages(spec).read_nbytes(buffer[offset:], nblocks)
        out.append(buffer[offset : offset + size])
        offset += size
    return out


def _encode(state: GRPOCommState, spec, rows, residual, scale, k: int, message=None, in_place: bool = False):
    """
    Compress `[n, B]` rows with error feedback (see `encode_blocks`; top-k below density 1). Returns `(message,
    new_residual)`; a fixed-size message is written into `message` when given, and with `in_place` the new residual
    into `residual` (a row the store keeps: no allocation per step, which would fragment the heap of a long run).
    """
    clip = state.scale_clip if scale is not None else None
    if spec.density < 1.0:
        encoded, _, new_residual = TopKMessages(spec).encode(state.kernels, rows, residual, scale, clip, k)
        if in_place and new_residual is not None:  # the top-k output is freed at once: only short-lived allocations
            residual.copy_(new_residual)
            new_residual = residual
        return encoded, new_residual
    writer = BlockMessages(spec)
    if message is None:
        codes, absmax, new_residual = state.kernels.encode(rows, residual, scale, spec.bits, clip, in_place=in_place)
        return writer.pack(codes, absmax), new_residual
    codes_view, absmax_view = writer.unpack(message, rows.shape[0])
    _, absmax, new_residual = state.kernels.encode(
        rows, residual, scale, spec.bits, clip, codes_out=codes_view, in_place=in_place
    )
    absmax_view.copy_(absmax)
    writer.clear_padding(message, rows.shape[0])
    return message, new_residual


def _decode(state: GRPOCommState, spec, messages, nblocks: int, scale, divide, out=None, ema=None):
    """
    The messages' decoded rows summed in order, divided by `divide`, times the scales, written into `out` (`[n, B]`;
    a fresh fp32 tensor when `None`). Returns `(out, new_ema)`.
    """
    if spec.density < 1.0:
        values = TopKMessages(spec).decode(state.kernels, messages, (nblocks, spec.block_size), scale, divide)
        new_ema = None if ema is None else ema * state.scale_beta + values * values * (1.0 - state.scale_beta)
        if out is None:
            return values, new_ema
        out.copy_(values)
        return out, new_ema
    reader = BlockMessages(spec)
    codes, absmax = zip(*(reader.unpack(message, nblocks) for message in messages))
    beta = state.scale_beta if ema is not None else 0.0  # (a state without gradient scales has no EMA factor)
    return state.kernels.decode(codes, absmax, scale, spec.bits, divide, out, ema, beta)


def to_owners(spec, codes: torch.Tensor, absmax: torch.Tensor, owned: list[tuple], messages: list[torch.Tensor]):
    """
    The owner side's first half, shared by the `allreduce` mode and the sync every H steps: write each owner's blocks
    of a run's `codes` / `absmax` (one kernel call's output, in block order) into its fixed-size message
    (`messages[owner]`, [`BlockMessages.fixed_nbytes`] of its block count; `owned[owner]` is `(ranges, index)`).
    """
    writer = BlockMessages(spec)
    for owner, ranges in enumerate(owned):
        count = _count(ranges)
        if count:
            codes_view, absmax_view = writer.unpack(messages[owner], count)
            _take(codes, ranges, out=codes_view)
            _take(absmax, ranges, out=absmax_view)
            writer.clear_padding(messages[owner], count)


def reduce_owned(state, spec, contributions: list, residual: torch.Tensor, scale=None, k: int | None = None,
                 message=None, in_place: bool = True):  # fmt: skip
    """
    The owner's step, shared by the `allreduce` mode and the sync every H steps: decode the `W` contributions to the
    blocks it owns (`contributions`, in rank order), average them, and compress the mean again with the owner's own
    error feedback (`residual`, `[n, B]`). Returns `(message, new_residual)` as [`_encode`] does (`k`: the values a
    top-k message keeps; every value at density 1).
    """
    nblocks = residual.shape[0]
    mean, _ = _decode(state, spec, contributions, nblocks, scale, len(contributions))
    k = nblocks * spec.block_size if k is None else k
    return _encode(state, spec, mean, residual, scale, k, message, in_place=in_place)


def from_owners(spec, messages: list[torch.Tensor], owned: list[tuple], nblocks: int, device):
    """
    Inverse of [`to_owners`] for the owners' messages (`messages[owner]`, e.g. the all-gathered ones): the codes and
    absmax of the run's `nblocks` blocks back in block order, for one decode.
    """
    shape, dtype = code_shape(nblocks, spec.block_size, spec.bits)
    codes, absmax = torch.empty(shape, dtype=dtype, device=device), torch.empty(nblocks, device=device)
    reader = BlockMessages(spec)
    for owner, ranges in enumerate(owned):
        if _count(ranges):
            owner_codes, owner_absmax = reader.unpack(messages[owner], _count(ranges))
            _put(codes, ranges, owner_codes)
            _put(absmax, ranges, owner_absmax)
    return codes, absmax


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
    fixed = [_message_size(run.spec, run.num_blocks) for run in layout.runs]
    payload, fixed_sizes = None, all(size is not None for size in fixed)
    if fixed_sizes:  # sizes known: encode straight into this rank's part of the gather
        total = sum(fixed)
        gathered = state.buffer(("gathered", lane), world_size * total, device, torch.uint8)
        payload = gathered[comm.rank * total : (comm.rank + 1) * total]
        slots = _split(payload, fixed)
    messages, scales, offset = [], [], 0
    for index, run in enumerate(layout.runs):
        rows = run.rows(bucket.buffer)
        scale, ema = state.scales_for(run, _params(run, bucket), device, offset, lane)
        offset += run.length
        residual = state.residuals.row(run.key, run.slots, run.length, device).view(rows.shape)
        message, new_residual = _encode(state, run.spec, rows, residual, scale, run.num_values(),
                                        None if payload is None else slots[index], in_place=True)  # fmt: skip
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
        stats.bytes_sent += allgather_bytes(_SIZE_BYTES, count_as)
        longest = max(totals)
        exchange = comm.start_all_gather(torch.nn.functional.pad(payload, (0, longest - payload.numel())), tag=lane)
        stats.bytes_sent += allgather_bytes(longest, count_as)

    def finish() -> None:
        gathered = exchange.wait()
        if fixed_sizes:
            per_rank = [_split(gathered[r], fixed) for r in range(world_size)]
        else:
            runs = [(run.spec, run.num_blocks) for run in layout.runs]
            per_rank = [_walk(gathered[r], runs) for r in range(world_size)]
        for index, (run, (scale, ema)) in enumerate(zip(layout.runs, scales)):
            out = run.rows(bucket.buffer) if run.in_place else None
            values, new_ema = _decode(state, run.spec, [per_rank[r][index] for r in range(world_size)],
                                      run.num_blocks, scale, world_size, out, ema)  # fmt: skip
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
    block_rows = [  # per run and rank: its blocks as [start, end) ranges and as an index
        [
            (ranges, index.to(device))
            for ranges, index in zip(run.owned_ranges(world_size), run.owned_blocks(world_size))
        ]
        for run in layout.runs
    ]
    fixed = [
        [_message_size(run.spec, _count(owned[r])) for run, owned in zip(layout.runs, block_rows)]
        for r in range(world_size)
    ]
    known = all(size is not None for sizes in fixed for size in sizes)
    empty = torch.zeros(0, dtype=torch.uint8, device=device)
    to_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    if known:  # sizes known: every message is written in place into one send buffer
        send_sizes = [sum(sizes) for sizes in fixed]
        send = state.buffer("send", sum(send_sizes), device, torch.uint8)
        to_rank = [_split(piece, sizes) for piece, sizes in zip(_split(send, send_sizes), fixed)]
    scales, offset = [], 0
    for index, (run, owned) in enumerate(zip(layout.runs, block_rows)):
        rows = run.rows(bucket.buffer)
        scale, ema = state.scales_for(run, _params(run, bucket), device, offset)
        offset += run.length
        residual = state.residuals.row(run.key, run.slots, run.length, device).view(rows.shape)
        if run.spec.density >= 1.0:  # one kernel call for the whole run, then each owner's blocks
            clip = state.scale_clip if scale is not None else None
            codes, absmax, new_residual = state.kernels.encode(rows, residual, scale, run.spec.bits, clip,
                                                               in_place=True)  # fmt: skip
            if known:
                to_owners(run.spec, codes, absmax, owned, [messages[index] for messages in to_rank])
            else:
                writer = BlockMessages(run.spec)
                for owner, ranges in enumerate(owned):
                    message = writer.pack(_take(codes, ranges), _take(absmax, ranges))
                    to_rank[owner].append(message if _count(ranges) else empty)
            stats.kept += min(run.num_values(), run.numel)
        else:  # top-k within each owner's blocks (disjoint: each is read before it is written)
            new_residual = residual
            for owner, ranges in enumerate(owned):
                count = _count(ranges)
                if not count:
                    to_rank[owner].append(empty)
                    continue
                k = run.num_values(count * run.spec.block_size, run.owned_numel(world_size, owner))
                part = None if scale is None else _take(scale, ranges)
                message, kept = _encode(state, run.spec, _take(rows, ranges), _take(residual, ranges), part, k)
                _put(new_residual, ranges, kept)
                to_rank[owner].append(message)
                stats.kept += min(k, run.owned_numel(world_size, owner))
        state.residuals.replace(run.key, run.slots, new_residual)
        scales.append((scale, ema))
    dense = _DenseTensors(comm, stats, bucket.buffer, layout.dense, count_as)

    # All-to-all: each owner receives every rank's messages for its blocks.
    if known:
        send_splits, recv_totals = send_sizes, [send_sizes[rank]] * world_size
        stats.bytes_sent += alltoall_bytes(send.numel(), count_as)
    else:  # sizes depend on the data: announce them (every rank learns every rank's total, to count the same bytes)
        sends = [torch.cat(parts) if parts else empty for parts in to_rank]
        send, send_splits = torch.cat(sends), [s.numel() for s in sends]
        meta = torch.tensor(send_splits, dtype=torch.int64, device=device)
        recv_totals = comm.all_to_all(meta, [1] * world_size, [1] * world_size).tolist()
        totals = comm.all_gather(meta.sum().view(1)).view(-1).tolist()
        stats.bytes_sent += alltoall_bytes(_SIZE_BYTES * world_size, count_as) + allgather_bytes(_SIZE_BYTES, count_as)
        stats.bytes_sent += alltoall_bytes(sum(totals) / world_size, count_as)
    received = comm.all_to_all(send, send_splits, recv_totals)
    mine_runs = [(run.spec, _count(owned[rank])) for run, owned in zip(layout.runs, block_rows)]
    contributions = [_split(c, fixed[rank]) if known else _walk(c, mine_runs) for c in _split(received, recv_totals)]

    # Owner: average the W contributions to the blocks it owns, add its residual, compress the mean again.
    out_messages = []
    if known:  # written in place into the payload of the all-gather, padded to the longest owner's
        longest = max(sum(sizes) for sizes in fixed)
        payload = state.buffer("owned", longest, device, torch.uint8)
        payload[sum(fixed[rank]) :].zero_()
        slots = _split(payload, fixed[rank])
    for index, (run, owned, (scale, _)) in enumerate(zip(layout.runs, block_rows, scales)):
        nblocks = _count(owned[rank])
        if nblocks == 0:
            out_messages.append(empty)
            continue
        mine = None if scale is None else _take(scale, owned[rank])
        key, owner_slots = (run.key, world_size, rank), run.owned_slots(world_size, rank)
        residual = state.owner_residuals.row(key, owner_slots, nblocks * run.spec.block_size, device)
        k = run.num_values(nblocks * run.spec.block_size, run.owned_numel(world_size, rank))
        message, new_residual = reduce_owned(state, run.spec, [contributions[s][index] for s in range(world_size)],
                                             residual.view(nblocks, -1), mine, k, slots[index] if known else None)  # fmt: skip
        state.owner_residuals.replace(key, owner_slots, new_residual)
        out_messages.append(message)

    # All-gather of the owners' messages (padded to the longest), decoded in owner order on every rank.
    if not known:
        payload = torch.cat(out_messages)
        totals = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device)).view(-1).tolist()
        stats.bytes_sent += allgather_bytes(_SIZE_BYTES, count_as)
        longest = max(totals)
        payload = torch.nn.functional.pad(payload, (0, longest - payload.numel()))
    gathered = comm.all_gather(payload)
    stats.bytes_sent += (
        allgather_bytes(longest, count_as) if world_size > 1 else allgather_bytes(longest / count_as, count_as)
    )
    per_owner = [
        _split(gathered[r], fixed[r])
        if known
        else _walk(gathered[r], [(run.spec, _count(owned[r])) for run, owned in zip(layout.runs, block_rows)])
        for r in range(world_size)
    ]
    for index, (run, owned, (scale, ema)) in enumerate(zip(layout.runs, block_rows, scales)):
        if run.spec.density >= 1.0:  # the owners' codes back in block order, then one decode into the bucket
            codes, absmax = from_owners(run.spec, [per_owner[r][index] for r in range(world_size)], owned,
                                        run.num_blocks, device)  # fmt: skip
            out = run.rows(bucket.buffer) if run.in_place else None
            values, new_ema = state.kernels.decode([codes], [absmax], scale, run.spec.bits, 1, out, ema,
                                                   state.scale_beta)  # fmt: skip
        else:
            values = torch.zeros(run.num_blocks, run.spec.block_size, device=device)
            for owner, ranges in enumerate(owned):
                if _count(ranges):
                    part = None if scale is None else _take(scale, ranges)
                    decoded, _ = _decode(state, run.spec, [per_owner[owner][index]], _count(ranges), part, 1)
                    _put(values, ranges, decoded)
            new_ema = None if ema is None else ema * state.scale_beta + values * values * (1 - state.scale_beta)
            out = None
        if new_ema is not None:
            state.squares.replace(run.key, run.slots, new_ema)
            state.ema_updated = True
        if out is None:
            run.write(bucket.buffer, values.to(bucket.buffer.dtype))
    dense.write()


__all__ = ["GRPOCommState", "compress_locally", "grpo_comm_hook"]
