"""The encode / exchange / decode seam of the three transports: the DDP hook, FSDP2's reduce-scatter, the outer sync.

Every transport encodes and decodes its gradients (or pseudo-gradients) only through this module, and the DDP hook
and the outer sync also exchange them through its collectives:

1. **Encode** ([`encode`]): `[n, B]` rows plus the error-feedback residual become one message (the codes and absmax
   of [`~grpo_hf.compression.codec.BlockMessages`], or a top-k message of [`~grpo_hf.compression.sparse`]), the new
   residual written in place. [`encode_rows`] is the same for equal-size messages, one per row (FSDP2's all-to-all).
2. **Exchange**, in the collectives of [`Collectives`] (timed, and slowed down by an [`EmulatedLink`] when a benchmark
   asks for one; FSDP2's one all-to-all is torch's own): an all-gather of the messages, cut back into messages by [`split_messages`] (sizes known,
   [`message_nbytes`]) or [`walk_messages`] (sizes in the messages' headers); or owner reduction, in three halves:
   [`encode_to_owners`] (each owner's blocks as its own message), [`reduce_owned`] (the owner averages the `W`
   contributions and compresses the mean again) and [`decode_from_owners`] (the owners' messages back into rows),
   with the collectives between them, and their bytes, in [`exchange_with_owners`] (sizes known in advance).
3. **Decode** ([`decode`], [`decode_rows`]): the messages, in rank order, summed and divided by the fused decode
   kernel; every rank decodes the same messages in the same order, so every rank holds the same bits. ([`poison_rows`]
   makes the blocks of a non-finite input decode to NaN.)

The bytes each collective sends are counted with the formulas of [`~grpo_hf.compression.traffic`], into the caller's
[`~grpo_hf.compression.traffic.StepStats`]. What stays with each transport is what is its own: the DDP buckets and
their runs (`hook.py`), FSDP2's shard layout (`fsdp.py`), the fragments, schedule and outer step (`outer_sync.py`).

## An emulated slow link (a benchmark tool)

With the environment variable `GRPO_HF_EMULATED_LINK_GBIT` set (e.g. `1`) when the process starts, every collective of
[`Collectives`] (the per-step hook's, and the sync every H steps') completes no earlier than the link would have
carried the bytes this rank sends in it ([`EmulatedLink`]); the wait is in `Started.wait()`, so that what runs between
the start and the wait overlaps with it. `benchmarks/bench_step_cost.py --link_gbit` sets it, and delays the
baselines' DDP hooks the same way (`benchmarks/emulated_link.py`). Not a training setting. FSDP2's compressed
reduce-scatter (`fsdp.py`) calls torch's collectives itself and is not emulated, nor are FSDP2's own.
"""

import math
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .codec import BlockMessages, Kernels, code_shape
from .sparse import TopKMessages
from .spec import CodecSpec, num_blocks
from .traffic import allgather_bytes, allreduce_bytes, alltoall_bytes, owner_reduction_bytes


LINK_ENV = "GRPO_HF_EMULATED_LINK_GBIT"


# ----------------------------------------------------------------------------------------------------------------
# Collectives (with an emulated slow link, for benchmarks)
# ----------------------------------------------------------------------------------------------------------------


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
    The collectives of one process group, timed; at world size 1 every call returns its input. Under an
    [`EmulatedLink`] (read from [`EMULATED_LINK`] when built) each one also waits for the link.

    Args:
        state: the transport's state: its `process_group`, `world_size`, `rank` and `stats` (the
            [`~grpo_hf.compression.traffic.StepStats`] the time spent communicating is added to).
        world_size (`int`, *optional*) and rank (`int`, *optional*): instead of the state's.
        group (`torch.distributed.ProcessGroup`, *optional*): instead of the state's (the same ranks in the same order).
    """

    def __init__(self, state, world_size: int | None = None, rank: int | None = None, group=None):
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


# ----------------------------------------------------------------------------------------------------------------
# Messages: their sizes, and cutting them out of a gathered buffer
# ----------------------------------------------------------------------------------------------------------------


def message_nbytes(spec: CodecSpec, nblocks: int) -> int | None:
    """
    Bytes of the message of `nblocks` blocks ([`~grpo_hf.compression.codec.BlockMessages`]); `None` when they depend
    on the data (2 bits, top-k).
    """
    return None if spec.density < 1.0 else BlockMessages(spec).fixed_nbytes(nblocks)


def split_messages(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """`buffer` cut into consecutive messages of `sizes` bytes (views)."""
    out, start = [], 0
    for size in sizes:
        out.append(buffer[start : start + size])
        start += size
    return out


def walk_messages(buffer: torch.Tensor, runs: list[tuple]) -> list[torch.Tensor]:
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


# ----------------------------------------------------------------------------------------------------------------
# Encoding and decoding
# ----------------------------------------------------------------------------------------------------------------


def encode(kernels: Kernels, spec: CodecSpec, rows, residual, scale=None, clip: float | None = None,
           k: int | None = None, message=None, in_place: bool = False):  # fmt: skip
    """
    Compress `[n, B]` rows with error feedback (`rows + residual`, relative to the per-entry `scale` when given; see
    [`~grpo_hf.compression.codec.encode_blocks`]; top-k below density 1).

    Args:
        kernels (`Kernels`): the codec's kernels of the transport.
        spec (`CodecSpec`): bits, block size and density.
        rows (`torch.Tensor`): `[n, B]`, any float dtype.
        residual (`torch.Tensor`): `[n, B]` error feedback (bf16), or `None`.
        scale (`torch.Tensor`, *optional*): `[n, B]` bf16 gradient scales.
        clip (`float`, *optional*): with `scale`, the most scales an entry sends per step.
        k (`int`, *optional*): the values a top-k message keeps (every value when `None`).
        message (`torch.Tensor`, *optional*): a fixed-size message to write into (density 1, 4, 8 or 16 bits).
        in_place (`bool`, *optional*, defaults to `False`): write the new residual into `residual` (a row a store keeps:
            no allocation per step, which would fragment the heap of a long run).

    Returns:
        `(message, new_residual)`: the `uint8` message and the new residual (`None` without a residual).
    """
    clip = clip if scale is not None else None
    if spec.density < 1.0:
        k = rows.numel() if k is None else k
        encoded, _, new_residual = TopKMessages(spec).encode(kernels, rows, residual, scale, clip, k)
        if in_place and new_residual is not None:  # the top-k output is freed at once: only short-lived allocations
            residual.copy_(new_residual)
            new_residual = residual
        return encoded, new_residual
    writer = BlockMessages(spec)
    if message is None:
        codes, absmax, new_residual = kernels.encode(rows, residual, scale, spec.bits, clip, in_place=in_place)
        return writer.pack(codes, absmax), new_residual
    codes_view, absmax_view = writer.unpack(message, rows.shape[0])
    _, absmax, new_residual = kernels.encode(
        rows, residual, scale, spec.bits, clip, codes_out=codes_view, in_place=in_place
    )
    absmax_view.copy_(absmax)
    writer.clear_padding(message, rows.shape[0])
    return message, new_residual


def decode(kernels: Kernels, spec: CodecSpec, messages, nblocks: int, scale=None, divide: float = 1, out=None,
           ema=None, beta: float = 0.0, max_blocks: int | None = None):  # fmt: skip
    """
    The messages' decoded rows summed in order (rank order: every rank adds them the same way), divided by `divide`,
    times the scales.

    Args:
        kernels (`Kernels`): the codec's kernels of the transport.
        spec (`CodecSpec`): the messages' spec.
        messages (`list[torch.Tensor]`): the `uint8` messages, of `nblocks` blocks each.
        nblocks (`int`): blocks of each message.
        scale (`torch.Tensor`, *optional*): `[n, B]` bf16 gradient scales.
        divide (`float`, *optional*, defaults to `1`): e.g. the world size, for the mean.
        out (`torch.Tensor`, *optional*): `[n, B]` to write into (any float dtype; a fresh fp32 tensor when `None`).
        ema (`torch.Tensor`, *optional*): `[n, B]` fp32 EMA of the squared result, to update.
        beta (`float`, *optional*, defaults to `0.0`): the EMA's factor (`beta * ema + (1 - beta) * result**2`).
        max_blocks (`int`, *optional*): at most this many blocks per kernel call into `out` (no `ema`): the eager
            decode's temporaries stay a few chunks.

    Returns:
        `(out, new_ema)`; `new_ema` is `None` without `ema`.
    """
    if spec.density < 1.0:
        values = TopKMessages(spec).decode(kernels, messages, (nblocks, spec.block_size), scale, divide)
        new_ema = None if ema is None else ema * beta + values * values * (1.0 - beta)
        if out is None:
            return values, new_ema
        out.copy_(values)
        return out, new_ema
    reader = BlockMessages(spec)
    codes, absmax = zip(*(reader.unpack(message, nblocks) for message in messages))
    beta = beta if ema is not None else 0.0  # (a state without gradient scales has no EMA factor)
    return _decode_codes(kernels, spec.bits, codes, absmax, scale, divide, out, ema, beta, max_blocks)


def _decode_codes(kernels: Kernels, bits: int, codes, absmax, scale, divide, out, ema, beta, max_blocks):
    """`Kernels.decode`, in calls of at most `max_blocks` blocks into `out` when given (no scales, no EMA)."""
    if max_blocks is None:
        return kernels.decode(codes, absmax, scale, bits, divide, out, ema, beta)
    nblocks = absmax[0].numel()
    for start in range(0, nblocks, max_blocks):
        end = min(start + max_blocks, nblocks)
        kernels.decode([c[start:end] for c in codes], [a[start:end] for a in absmax], None, bits, divide,
                       out=out[start:end])  # fmt: skip
    return out, None


def _blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[n, S]` rows -> `[n * ceil(S / B), B]` blocks (zero-padded: a block never spans two rows)."""
    pad = -rows.shape[1] % block_size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(-1, block_size)


def row_message_nbytes(spec: CodecSpec, numel: int) -> int:
    """Bytes of one message of [`encode_rows`], of a row of `numel` entries: `ceil(numel / B) * (4 + B * bits / 8)`."""
    return BlockMessages(spec, align=1).fixed_nbytes(num_blocks(numel, spec.block_size))


def encode_rows(kernels: Kernels, spec: CodecSpec, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Encode `[n, S]` finite fp32 rows, each as its own message (blocks zero-padded at the row's end; the messages not
    aligned, so that they are equal in size to the byte: one all-to-all), in one kernel call. Without residual: a
    caller that keeps one adds it first and subtracts the decoded values.

    Args:
        kernels (`Kernels`): the codec's kernels of the transport.
        spec (`CodecSpec`): bits (4, 8 or 16) and block size.
        rows (`torch.Tensor`): `[n, S]` fp32, finite.

    Returns:
        `(messages, decoded)`: `[n, nbytes]` uint8 messages and the `[n, S]` fp32 values the receivers decode.
    """
    n, numel = rows.shape
    codes, absmax, _ = kernels.encode(_blocks(rows, spec.block_size), None, None, spec.bits)
    decoded, _ = kernels.decode([codes], [absmax], None, spec.bits, 1.0)
    return BlockMessages(spec, align=1).pack_rows(codes, absmax, n), decoded.reshape(n, -1)[:, :numel]


def poison_rows(spec: CodecSpec, messages: torch.Tensor, nonfinite: torch.Tensor) -> None:
    """
    Make the blocks of the rows given to [`encode_rows`] that held a NaN/Inf (`nonfinite`, bool `[n, S]`) decode to
    NaN: their scales in `messages` are set to NaN, in place, so that a non-finite input reaches the receivers as such.
    """
    writer = BlockMessages(spec, align=1)
    codes, absmax = writer.unpack_rows(messages, num_blocks(nonfinite.shape[1], spec.block_size))
    absmax[_blocks(nonfinite, spec.block_size).any(dim=1)] = math.nan
    messages.copy_(writer.pack_rows(codes, absmax, messages.shape[0]))


def decode_rows(kernels: Kernels, spec: CodecSpec, messages: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of [`encode_rows`]: `[n, nbytes]` uint8 messages -> `[n, S]` fp32 (`code * step`, one multiply each)."""
    n = messages.shape[0]
    codes, absmax = BlockMessages(spec, align=1).unpack_rows(messages, num_blocks(numel, spec.block_size))
    decoded, _ = kernels.decode([codes], [absmax], None, spec.bits, 1.0)
    return decoded.reshape(n, -1)[:, :numel]


# ----------------------------------------------------------------------------------------------------------------
# Owner reduction (DeepSpeed's compressed all-reduce: the per-step hook's `allreduce` mode, the sync from 3 ranks)
# ----------------------------------------------------------------------------------------------------------------

_MAX_SLICES = 8  # owned blocks in more ranges than this are gathered with an index instead of slices


def owned_blocks(run, world_size: int, device) -> list[tuple]:
    """
    Per rank, the blocks of a [`~grpo_hf.compression.layout.Run`] it owns, as `(ranges, index)` on `device`: the
    `owned` argument of the functions below.
    """
    return [(r, index.to(device)) for r, index in zip(run.owned_ranges(world_size), run.owned_blocks(world_size))]


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


def take_owned(rows: torch.Tensor, owned: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
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


def put_owned(rows: torch.Tensor, owned: tuple, values: torch.Tensor) -> None:
    """Inverse of [`take_owned`]: write `values` into the rows of `owned`."""
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


def encode_to_owners(kernels: Kernels, spec: CodecSpec, rows, residual, owned: list[tuple], scale=None,
                     clip: float | None = None, ks: list[int] | None = None, messages=None):  # fmt: skip
    """
    The sender's half of owner reduction: this rank's `rows + residual` as one message per owner, of the blocks it
    owns (`owned[owner]`, `(ranges, index)` as [`owned_blocks`] gives them); the residual is replaced in place.

    At density 1 the rows are encoded in one kernel call and each owner's codes and absmax are cut out, into
    `messages[owner]` when given (fixed sizes) or packed (2 bits); below it each owner's blocks are a top-k message of
    their own, keeping `ks[owner]` values. An owner of no block gets an empty message.

    Returns:
        `(messages, new_residual)`.
    """
    empty = torch.zeros(0, dtype=torch.uint8, device=rows.device)
    if spec.density < 1.0:  # top-k within each owner's blocks (disjoint: each is read before it is written)
        messages = []
        for owner, ranges in enumerate(owned):
            if not _count(ranges):
                messages.append(empty)
                continue
            part = None if scale is None else take_owned(scale, ranges)
            message, kept = encode(
                kernels, spec, take_owned(rows, ranges), take_owned(residual, ranges), part, clip, ks[owner]
            )
            put_owned(residual, ranges, kept)
            messages.append(message)
        return messages, residual
    clip = clip if scale is not None else None
    codes, absmax, new_residual = kernels.encode(rows, residual, scale, spec.bits, clip, in_place=True)
    writer = BlockMessages(spec)
    if messages is None:
        messages = [writer.pack(take_owned(codes, r), take_owned(absmax, r)) if _count(r) else empty for r in owned]
        return messages, new_residual
    for owner, ranges in enumerate(owned):
        count = _count(ranges)
        if count:
            codes_view, absmax_view = writer.unpack(messages[owner], count)
            take_owned(codes, ranges, out=codes_view)
            take_owned(absmax, ranges, out=absmax_view)
            writer.clear_padding(messages[owner], count)
    return messages, new_residual


def reduce_owned(kernels: Kernels, spec: CodecSpec, contributions: list, residual: torch.Tensor, scale=None,
                 clip: float | None = None, k: int | None = None, message=None):  # fmt: skip
    """
    The owner's half: decode the `W` contributions to the blocks it owns (`contributions`, in rank order), average
    them, and compress the mean again with the owner's own error feedback (`residual`, `[n, B]`, replaced in place).
    Returns `(message, new_residual)` as [`encode`] does (`k`: the values a top-k message keeps; every value when
    `None`).
    """
    mean, _ = decode(kernels, spec, contributions, residual.shape[0], scale, len(contributions))
    return encode(kernels, spec, mean, residual, scale, clip, k, message, in_place=True)


def decode_from_owners(kernels: Kernels, spec: CodecSpec, messages: list, owned: list[tuple], nblocks: int,
                       scale=None, out=None, ema=None, beta: float = 0.0, max_blocks: int | None = None):  # fmt: skip
    """
    Every rank's last half: the owners' messages (`messages[owner]`, e.g. the all-gathered ones) decoded into the
    `[nblocks, B]` rows of the run, the same bits on every rank. At density 1 the owners' codes are put back in block
    order and decoded at once (`max_blocks` as in [`decode`]); below it each owner's message is decoded on its own.
    Returns `(out, new_ema)` as [`decode`] does.
    """
    device = messages[0].device if messages else None
    if spec.density < 1.0:
        values = torch.zeros(nblocks, spec.block_size, device=device)
        for owner, ranges in enumerate(owned):
            if _count(ranges):
                part = None if scale is None else take_owned(scale, ranges)
                decoded, _ = decode(kernels, spec, [messages[owner]], _count(ranges), part, 1)
                put_owned(values, ranges, decoded)
        new_ema = None if ema is None else ema * beta + values * values * (1 - beta)
        if out is None:
            return values, new_ema
        out.copy_(values)
        return out, new_ema
    shape, dtype = code_shape(nblocks, spec.block_size, spec.bits)
    codes, absmax = torch.empty(shape, dtype=dtype, device=device), torch.empty(nblocks, device=device)
    reader = BlockMessages(spec)
    for owner, ranges in enumerate(owned):
        if _count(ranges):
            owner_codes, owner_absmax = reader.unpack(messages[owner], _count(ranges))
            put_owned(codes, ranges, owner_codes)
            put_owned(absmax, ranges, owner_absmax)
    return _decode_codes(kernels, spec.bits, [codes], [absmax], scale, 1, out, ema, beta, max_blocks)


def exchange_with_owners(comm: Collectives, send: torch.Tensor, sizes: list[int],
                         reduce_into: Callable[[list[torch.Tensor], torch.Tensor], object],
                         payload: torch.Tensor | None = None,
                         count_as: int | None = None) -> tuple[list[torch.Tensor], float]:  # fmt: skip
    """
    The collectives of owner reduction when the messages' sizes are known in advance (no top-k, no 2 bits): the
    all-to-all of this rank's part for each owner, the owner's half on this rank, the all-gather of the owners'
    messages, padded to the longest.

    Args:
        comm (`Collectives`): the collectives of the `W` ranks.
        send (`torch.Tensor`): `uint8`, this rank's parts for the owners one after the other (`sizes[j]` bytes for
            owner `j`), e.g. written by [`encode_to_owners`].
        sizes (`list[int]`): the bytes of each owner's part, the same on every rank; an owner's message is as long as
            each part it receives (the same blocks, compressed again).
        reduce_into (`Callable`): the owner's half, called once as `reduce_into(contributions, message)` with the `W`
            parts this rank received (rank order) and its message of `sizes[rank]` bytes to write, e.g. with
            [`reduce_owned`].
        payload (`torch.Tensor`, *optional*): `max(sizes)` bytes to write the message into and gather from (a work
            buffer kept from step to step); fresh zeros when `None`.
        count_as (`int`, *optional*): the world size the bytes are counted for, when one process stands for that many
            ranks (`compress_locally`); `comm.world_size` when `None`.

    Returns:
        `(messages, nbytes)`: the owners' messages (owner order, `sizes[j]` bytes each, views of the gathered
        buffer: for [`decode_from_owners`]) and the bytes one rank sends
        ([`~grpo_hf.compression.traffic.owner_reduction_bytes`]).
    """
    world_size, rank = comm.world_size, comm.rank
    received = comm.all_to_all(send, sizes, [sizes[rank]] * world_size)
    if payload is None:
        payload = torch.zeros(max(sizes), dtype=torch.uint8, device=send.device)
    else:
        payload[sizes[rank] :].zero_()  # the padding up to the longest owner's message
    reduce_into(split_messages(received, [sizes[rank]] * world_size), payload[: sizes[rank]])
    gathered = comm.all_gather(payload)
    messages = [gathered[owner, : sizes[owner]] for owner in range(world_size)]
    return messages, owner_reduction_bytes(sizes, world_size if count_as is None else count_as)


__all__ = [
    "EMULATED_LINK",
    "LINK_ENV",
    "Collectives",
    "EmulatedLink",
    "Started",
    "decode",
    "decode_from_owners",
    "decode_rows",
    "encode",
    "encode_rows",
    "encode_to_owners",
    "exchange_with_owners",
    "message_nbytes",
    "owned_blocks",
    "poison_rows",
    "put_owned",
    "reduce_owned",
    "row_message_nbytes",
    "split_messages",
    "take_owned",
    "walk_messages",
]
