"""The two exchange algorithms (all-gather, all-reduce with owner-side error feedback) over segments of gradients.

Both the DDP hook ([`~grpo_hf.compression.hook.grpo_comm_hook`], real collectives) and the single-process preview
([`~grpo_hf.compression.local.compress_locally`], a world of one) run these functions; only the collectives and the
world size the bytes are counted for differ.

Per segment ([`~grpo_hf.compression.layout.Segment`]) and optimizer step, on every rank:

1. `acc = grad + residual` (fp32, this rank's error feedback).
2. Gradient scales (on by default): `x = acc / scale`, with `scale = sqrt(EMA of the squared averaged gradient)`, the
   same on every rank. The codec's blocks then hold entries of comparable size, so that small coordinates keep their
   precision (Adam moves every coordinate by about its learning rate whatever its gradient's size).
3. Exchange, by mode:
   - `allgather`: compress `x` ([`~grpo_hf.compression.codec.compress_rows`]), all-gather the messages (padded to
     the longest), decode the `W` messages in rank order and sum them from zero, so that every rank gets
     bit-identical sums.
   - `allreduce` (DeepSpeed's compressed all-reduce): compress the blocks each rank owns separately and send them to
     their owner (all-to-all); each owner decodes its `W` contributions in rank order, averages them, adds its own
     (owner-side) residual, compresses the mean again and keeps what it did not send; all-gather of the owners'
     messages. Two residuals, no gradient mass lost, per-rank bytes flat in `W`.
4. `residual = acc - decoded * scale` (what this rank's message did not carry), committed when the step ends.
5. The average, times the scale, goes back into the gradients; the scales' EMA takes it in.

A NaN or an Inf on any rank (a flag travels in the first collective of the exchange) sends the bucket dense and raw
and leaves residuals and scales unchanged for the whole step. Tensors sent dense (`spec is None`) go through one fp32
all-reduce.
"""

import time

import torch
import torch.distributed as dist

from .codec import chunk_slices, compress_rows, decode_whole_into, encode_whole, read_batch
from .layout import Segment
from .state import GRPOCommState, StepStats
from .store import RowScales, segment_slots
from .traffic import allgather_bytes, alltoall_bytes


_META_BYTES = 16  # two int64: [message bytes, non-finite flag]


class Collectives:
    """The collectives of one process group, timed; at world size 1 every call returns its input."""

    def __init__(self, state: GRPOCommState, world_size: int | None = None, rank: int | None = None):
        self.group = state.process_group
        self.world_size = state.world_size if world_size is None else world_size
        self.rank = state.rank if rank is None else rank
        self.stats = state._step

    def _timed(self, start: float) -> None:
        self.stats.comm_ms += (time.perf_counter() - start) * 1000

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.group)
            self._timed(start)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.world_size == 1:
            return [tensor]
        start = time.perf_counter()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        self._timed(start)
        return out

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """`all_to_all_single` with uneven splits: `send_splits[j]` elements go to rank `j`."""
        if self.world_size == 1:
            return send
        start = time.perf_counter()
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        self._timed(start)
        return recv


def accumulate(state: GRPOCommState, segment: Segment, grads: list[torch.Tensor]) -> torch.Tensor:
    """`grad + residual` of a segment's tensors as a `[length]` fp32 row, written into the residual's staged buffer."""
    slots = segment_slots(segment)
    device = grads[0].device
    residual = state.residuals.row(segment.key, slots, segment.length, device)
    acc = state.residuals.scratch(segment.key, segment.length, device)
    acc.copy_(residual)
    torch._foreach_add_(segment.views(acc), [g.reshape(-1) for g in grads])
    state.residuals.stage(segment.key, slots, acc)
    return acc


def _scaled(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return values if scale is None else values / scale


def _unscaled(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return values if scale is None else values * scale


def _write(segment: Segment, grads: list[torch.Tensor], averaged: torch.Tensor) -> None:
    """Copy each tensor's entries of an averaged `[length]` row into its gradient (casting to its dtype)."""
    torch._foreach_copy_([g.reshape(-1) for g in grads], segment.views(averaged))


def _gather_row(segment: Segment, grads: list[torch.Tensor]) -> torch.Tensor:
    """A segment's gradients as one `[length]` fp32 row (zero padding)."""
    row = torch.zeros(segment.length, dtype=torch.float32, device=grads[0].device)
    torch._foreach_copy_(segment.views(row), [g.reshape(-1) for g in grads])
    return row


def track_dense_scales(state: GRPOCommState, segments: list[Segment], grads: list[list[torch.Tensor]]) -> None:
    """Warm-up steps: the scales' EMA takes in the (already averaged) dense gradients."""
    if state.scale_gradients:
        for segment, seg_grads in zip(segments, grads):
            state.track_scale(segment, _gather_row(segment, seg_grads))


def dense_entries(comm: Collectives, stats: StepStats, grads: list[torch.Tensor], count_as: int) -> None:
    """Average the tensors sent dense with one fp32 all-reduce."""
    if not grads:
        return
    vector = comm.all_reduce(torch.cat([g.reshape(-1).float() for g in grads]))
    vector /= comm.world_size
    torch._foreach_copy_([g.reshape(-1) for g in grads], list(torch.split(vector, [g.numel() for g in grads])))
    stats.dense(vector.numel(), count_as)


def _encode(row: torch.Tensor, spec, own: torch.Tensor, scales: RowScales | None, num_values: int) -> list:
    """
    Compress `row` (grad + residual; it becomes the new residual in place) relative to `scales`; `own` receives the
    decoded values (divided by the scales). Rows of which every entry is sent go chunk by chunk.
    """
    if spec.density >= 1.0:
        return encode_whole(row, spec, own, scales, clip=None if scales is None else scales.clip)
    scale = None if scales is None else scales()
    values = _scaled(row, scale)
    if scales is not None and scales.clip is not None:
        values = values.clamp(-scales.clip, scales.clip)
    batch = compress_rows(values.view(1, -1), spec, num_values=num_values)
    decoded = batch.dense()[0]
    own.copy_(decoded)
    row.sub_(_unscaled(decoded, scale))
    return batch.messages()


def _decode_into(message, host, offset: int, total: torch.Tensor, spec, num_values: int) -> int:
    """Add the decoded values of the message at `offset` into `total`; returns the offset after it."""
    if spec.density >= 1.0:
        return decode_whole_into(message, host, offset, total, spec, add=True)
    positions, decoded, offset = read_batch(message, host, offset, 1, total.numel(), spec, num_values)
    if positions is None:
        total += decoded[0]
    else:
        total.index_add_(0, positions[0], decoded[0])
    return offset


def _finish(state: GRPOCommState, segment: Segment, grads, total: torch.Tensor, scales: RowScales | None, divide):
    """`averaged = total / divide * scale`, piece by piece, written into the gradients; the scales' EMA takes it in."""
    for piece in chunk_slices(total.numel(), total.device):
        values = total[piece]
        if divide != 1:
            values.div_(divide)
        if scales is not None:
            values.mul_(scales(piece))
    _write(segment, grads, total)
    state.track_scale(segment, total)


def allgather_segments(
    state: GRPOCommState,
    comm: Collectives,
    segments: list[Segment],
    grads: list[list[torch.Tensor]],
    count_as: int,
    finite: bool,
) -> bool:
    """
    The all-gather exchange of a bucket's segments (see the module docstring); `finite` tells whether this rank's
    gradients are free of NaN/Inf. Returns `False`, with nothing written, when a rank flagged a NaN/Inf (the caller
    then sends the bucket dense).
    """
    stats, world_size, rank = state._step, comm.world_size, comm.rank
    own, scales, pieces = [], [], []
    if finite:
        for segment, seg_grads in zip(segments, grads):
            acc = accumulate(state, segment, seg_grads)
            scales.append(state.scales_of(segment, acc.device))
            own.append(state.buffer("own", segment.key, segment.length, acc.device))
            pieces += _encode(acc, segment.spec, own[-1], scales[-1], segment.num_values())
            stats.kept += min(segment.num_values(), segment.numel)
    payload = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=grads[0][0].device)
    meta = torch.tensor([payload.numel(), int(not finite)], dtype=torch.int64, device=payload.device)
    metas = torch.stack(comm.all_gather(meta)).tolist()
    stats.bytes_sent += allgather_bytes(_META_BYTES, count_as)
    if any(flag for _, flag in metas):
        return False
    longest = max(size for size, _ in metas)
    if payload.numel() < longest:  # gloo gathers equal sizes only
        payload = torch.cat([payload, payload.new_zeros(longest - payload.numel())])
    messages = comm.all_gather(payload)
    stats.bytes_sent += allgather_bytes(longest, count_as)
    totals = [state.buffer("total", s.key, s.length, payload.device).zero_() for s in segments]
    for source, message in enumerate(messages):  # in rank order on every rank: bit-identical sums
        host = message.cpu().numpy() if source != rank else None
        offset = 0
        for segment, total, mine in zip(segments, totals, own):
            if source == rank:
                total += mine
            else:
                offset = _decode_into(message, host, offset, total, segment.spec, segment.num_values())
    for segment, seg_grads, total, scale in zip(segments, grads, totals, scales):
        _finish(state, segment, seg_grads, total, scale, world_size)
    return True


def allreduce_segments(
    state: GRPOCommState,
    comm: Collectives,
    segments: list[Segment],
    grads: list[list[torch.Tensor]],
    count_as: int,
    finite: bool,
) -> bool:
    """
    The all-reduce exchange of a bucket's segments with owner-side error feedback (see the module docstring);
    `finite` tells whether this rank's gradients are free of NaN/Inf. Returns `False`, with nothing written, when a
    rank flagged a NaN/Inf.
    """
    stats, world_size, rank = state._step, comm.world_size, comm.rank
    device = grads[0][0].device
    to_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    own, scales = [], []  # own: this rank's decoded contribution to the blocks it owns, per segment
    if finite:
        for segment, seg_grads in zip(segments, grads):
            acc = accumulate(state, segment, seg_grads)
            scale = state.scales_of(segment, device)
            blocks = acc.view(segment.num_blocks, -1)
            for owner, owned in enumerate(segment.owned_blocks(world_size)):
                owned = owned.to(device)
                row = blocks.index_select(0, owned).view(-1)
                part = state.buffer(("own", owner), segment.key, row.numel(), device)
                k = segment.num_values(row.numel(), segment.owned_numel(world_size, owner))
                owned_scales = None if scale is None else scale.owned(owned, segment.spec.block_size)
                to_rank[owner] += _encode(row, segment.spec, part, owned_scales, k)
                blocks.index_copy_(0, owned, row.view(-1, blocks.shape[1]))  # the residual of those blocks
                stats.kept += min(k, row.numel())
                if owner == rank:
                    own.append(part)
            scales.append(scale)
    sends = [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device) for parts in to_rank]
    # [bytes for rank r, non-finite flag, bytes in all] to every rank r: every rank learns every rank's total, so
    # that all ranks count the same (average) bytes.
    send_splits = [s.numel() for s in sends]
    meta = [[size, int(not finite), sum(send_splits)] for size in send_splits]
    meta = torch.tensor(meta, dtype=torch.int64, device=device).view(-1)
    received_meta = comm.all_to_all(meta, [3] * world_size, [3] * world_size).view(world_size, 3).tolist()
    stats.bytes_sent += alltoall_bytes(3 * 8 * world_size, count_as)
    if any(flag for _, flag, _ in received_meta):
        return False
    recv_splits = [size for size, _, _ in received_meta]
    received = comm.all_to_all(torch.cat(sends), send_splits, recv_splits)
    stats.bytes_sent += alltoall_bytes(sum(total for _, _, total in received_meta) / world_size, count_as)

    # Owner: average the W contributions to the blocks it owns, add its residual, compress the mean again.
    contributions = torch.split(received, recv_splits)
    hosts = [c.cpu().numpy() if source != rank else None for source, c in enumerate(contributions)]
    offsets = [0] * world_size
    out_pieces = []
    for index, segment in enumerate(segments):
        owned = segment.owned_blocks(world_size)[rank].to(device)
        length = owned.numel() * segment.spec.block_size
        owned_k = segment.num_values(length, segment.owned_numel(world_size, rank))
        total = state.buffer("owned_total", segment.key, length, device).zero_()
        for source in range(world_size):
            if source == rank:
                total += own[index]
            else:
                offsets[source] = _decode_into(
                    contributions[source], hosts[source], offsets[source], total, segment.spec, owned_k
                )
        owned_scales = None if scales[index] is None else scales[index].owned(owned, segment.spec.block_size)
        slots = segment.owned_slots(world_size, rank)
        key = (segment.key, world_size, rank)
        residual = state.owner_residuals.row(key, slots, length, device)
        acc = state.owner_residuals.scratch(key, length, device)
        for piece in chunk_slices(length, device):  # the owner's acc = its residual + the mean, in gradient units
            mean = total[piece].div_(world_size)
            torch.add(residual[piece], _unscaled(mean, None if owned_scales is None else owned_scales(piece)),
                      out=acc[piece])  # fmt: skip
        out_pieces += _encode(acc, segment.spec, own[index], owned_scales, owned_k)  # acc: the owner's residual
        state.owner_residuals.stage(key, slots, acc)

    # All-gather of the owners' messages (padded to the longest), decoded in owner order on every rank.
    mine = torch.cat(out_pieces) if out_pieces else torch.zeros(0, dtype=torch.uint8, device=device)
    sizes = torch.stack(comm.all_gather(torch.tensor([mine.numel()], device=device))).view(-1).tolist()
    stats.bytes_sent += allgather_bytes(8, count_as)
    longest = max(sizes)
    gathered = comm.all_gather(torch.cat([mine, mine.new_zeros(longest - mine.numel())]))
    stats.bytes_sent += (
        allgather_bytes(longest, count_as) if world_size > 1 else allgather_bytes(longest / count_as, count_as)
    )
    averaged = [state.buffer("total", segment.key, segment.length, device) for segment in segments]
    for owner, message in enumerate(gathered):
        host = message.cpu().numpy() if owner != rank else None
        offset = 0
        for index, segment in enumerate(segments):
            owned = segment.owned_blocks(world_size)[owner].to(device)
            length = owned.numel() * segment.spec.block_size
            owner_k = segment.num_values(length, segment.owned_numel(world_size, owner))
            if owner == rank:
                values = own[index]
            else:
                values = state.buffer(("owner", owner), segment.key, length, device).zero_()
                offset = _decode_into(message, host, offset, values, segment.spec, owner_k)
            averaged[index].view(segment.num_blocks, -1).index_copy_(
                0, owned, values.view(-1, segment.spec.block_size)
            )
    for segment, seg_grads, row, scale in zip(segments, grads, averaged, scales):
        _finish(state, segment, seg_grads, row, scale, 1)
    return True


__all__ = ["Collectives", "accumulate", "allgather_segments", "allreduce_segments", "dense_entries"]
