"""`Exchange`: the one encode / exchange / decode of the three transports, the DDP hook, FSDP2's reduce-scatter and the
sync every H steps.

An exchange moves compressed rows among the `W` ranks of the
[`~grpo_hf.compression.communicator.Communicator`] its transport was handed:

1. **Encode, with error feedback.** Each [`Part`] (a run of `[n, B]` rows sharing one
   [`~grpo_hf.compression.spec.CodecSpec`]: a DDP bucket's run, a fragment's row of `Δ`) is encoded with its residual
   added, and the residual is replaced by what the codes did not carry: read, encode, write, in one place
   ([`Exchange`]'s `_with_feedback`), whatever keeps the residual (a [`Residual`]).
2. **Exchange**, one of three:
   - [`Exchange.start_all_gather`]: every rank's messages to every rank, started ([`Gathered.finish`] waits and decodes,
     so that the caller computes while they travel);
   - [`Exchange.reduce_with_owners`] (DeepSpeed's compressed all-reduce): each owner's blocks go to it (one
     all-to-all); it averages the `W` contributions and compresses the mean again with its own residual; the owners'
     messages are all-gathered. About `2 (W - 1) / W` messages per rank, whatever `W`;
   - [`Exchange.reduce_scatter`] (FSDP2): each owner's chunk goes to it as a row message ([`encode_rows`], one
     all-to-all); it sums the `W` contributions, its own exact.
3. **Decode the mean**: every rank decodes the same messages in the same (rank) order, so every rank holds the same
   bits. ([`Exchange.start_mean`] averages the tensors sent dense in fp32, [`Exchange.agree_flag`] the NaN/Inf flag.)

Every byte is counted once, here ([`~grpo_hf.compression.traffic`]'s formulas), into the exchange's `stats` (the
transport's `StepStats` of the step; the communicator counts time, not bytes). What stays with each transport is its own: the DDP buckets and lanes (`hook.py`), FSDP2's units
and residual format (`fsdp.py`), the fragments, schedule and outer step (`outer_sync.py`, `fragment.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .codec import Kernels
from .codes import code_for
from .communicator import Communicator, Started
from .layout import Run, owned_blocks
from .spec import CodecSpec
from .traffic import FLAG_BYTES, SIZE_BYTES, allgather_bytes, allreduce_bytes, alltoall_bytes, owner_reduction_bytes


# ----------------------------------------------------------------------------------------------------------------
# Messages: their sizes, and cutting them out of a gathered buffer
# ----------------------------------------------------------------------------------------------------------------


def message_nbytes(spec: CodecSpec, nblocks: int) -> int | None:
    """Bytes of the message of `nblocks` blocks (the spec's code's); `None` when they depend on the data."""
    return code_for(spec).message_nbytes(nblocks)


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
        size = code_for(spec).read_nbytes(buffer[offset:], nblocks) if nblocks else 0
        out.append(buffer[offset : offset + size])
        offset += size
    return out


# ----------------------------------------------------------------------------------------------------------------
# Encoding and decoding: the spec's code
# ----------------------------------------------------------------------------------------------------------------


def encode(kernels: Kernels, spec: CodecSpec, rows, residual, k: int | None = None, message=None,
           in_place: bool = False):  # fmt: skip
    """
    Compress `[n, B]` rows with error feedback: [`~grpo_hf.compression.codes.Code.encode`] of the spec's code.
    Returns `(message, new_residual)`.
    """
    return code_for(spec).encode(kernels, rows, residual, k, message, in_place)


def decode(kernels: Kernels, spec: CodecSpec, messages, nblocks: int, divide: float = 1, out=None,
           max_blocks: int | None = None):  # fmt: skip
    """
    The messages' decoded rows summed in order, divided by `divide`: [`~grpo_hf.compression.codes.Code.decode`] of
    the spec's code. Returns `out`.
    """
    return code_for(spec).decode(kernels, messages, nblocks, divide, out, max_blocks)


def encode_rows(kernels: Kernels, spec: CodecSpec, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Encode `[n, S]` finite fp32 rows, each as its own message (blocks zero-padded at the row's end; the messages not
    aligned, so that they are equal in size to the byte: one all-to-all), in one kernel call. Without residual: a
    caller that keeps one adds it first and subtracts the decoded values.

    Args:
        kernels (`Kernels`): the codec's kernels of the transport.
        spec (`CodecSpec`): bits (4, 8 or 16; 32: the fp32 values as they are) and block size.
        rows (`torch.Tensor`): `[n, S]` fp32, finite.

    Returns:
        `(messages, decoded)`: `[n, nbytes]` uint8 messages and the `[n, S]` fp32 values the receivers decode.
    """
    return code_for(spec).encode_rows(kernels, rows)


def decode_rows(kernels: Kernels, spec: CodecSpec, messages: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of [`encode_rows`]: `[n, nbytes]` uint8 messages -> `[n, S]` fp32."""
    return code_for(spec).decode_rows(kernels, messages, numel)


# ----------------------------------------------------------------------------------------------------------------
# The owner's half of owner reduction (the sender's and every rank's last are the code's)
# ----------------------------------------------------------------------------------------------------------------


def _reduce_owned(kernels: Kernels, spec: CodecSpec, contributions: list, residual: torch.Tensor,
                  k: int | None = None, message=None):  # fmt: skip
    """
    The owner's half: decode the `W` contributions to the blocks it owns (`contributions`, in rank order), average
    them, and compress the mean again with the owner's own error feedback (`residual`, `[n, B]`, replaced in place).
    Returns `(message, new_residual)` as [`encode`] does (`k`: the values the message keeps).
    """
    code = code_for(spec)
    mean = code.decode(kernels, contributions, residual.shape[0], len(contributions))
    return code.encode(kernels, mean, residual, k, message, in_place=True)


def _encode_to_owners(kernels: Kernels, spec: CodecSpec, rows, residual, owned: list[tuple],
                      ks: list[int] | None = None, messages=None):  # fmt: skip
    """The sender's half, as `Exchange._with_feedback` calls an encoder: the code's `encode_to_owners`."""
    return code_for(spec).encode_to_owners(kernels, rows, residual, owned, ks, messages)


# ----------------------------------------------------------------------------------------------------------------
# The exchange
# ----------------------------------------------------------------------------------------------------------------


class Residual(Protocol):
    """Where a run's error feedback lives: `read` the `[n, B]` bf16 row (the encode may write it in place), `write`."""

    def read(self, block_size: int) -> torch.Tensor: ...

    def write(self, row: torch.Tensor) -> None: ...


@dataclass(eq=False)
class Part:
    """
    One run of an exchange: its layout, the rows it sends, where its error feedback lives and where its mean goes.

    Args:
        run (`~grpo_hf.compression.layout.Run`): spec, blocks, the values a message keeps and who owns which blocks.
        rows (`torch.Tensor`): `[n, B]`, any float dtype: what this rank sends (a gradient, a pseudo-gradient).
        residual (`Residual`): this rank's error feedback of the run.
        out (`torch.Tensor`, *optional*): `[n, B]` to decode the mean into (it may be `rows`); `None`: `write` is
            called with a fresh fp32 tensor.
        write (`Callable`, *optional*): takes the decoded mean when there is no `out`.
        owner_residual (`Residual`, *optional*): owner reduction: the error feedback of the blocks this rank owns.
    """

    run: Run
    rows: torch.Tensor
    residual: Residual
    out: torch.Tensor | None = None
    write: Callable[[torch.Tensor], None] | None = None
    owner_residual: Residual | None = None


class Exchange:
    r"""
    One transport's exchange of compressed rows among the ranks of `comm` (see the module docstring).

    Example (what the sync every H steps does with one run of `Δ`):

    ```python
    >>> exchange = Exchange(kernels, state.communicator, state.stats)
    >>> exchange.start_all_gather([Part(run, delta_rows, residual, out=delta_rows)]).finish()  # delta_rows: the mean
    ```

    Args:
        kernels (`~grpo_hf.compression.codec.Kernels`): the codec's kernels.
        comm ([`~grpo_hf.compression.communicator.Communicator`]): the way to the wire.
        stats (`~grpo_hf.compression.traffic.StepStats`): the step's statistics, which receive the bytes (an exchange
            waited for in a later step is given that step's: see `Fragment.complete`).
        count_as (`int`, *optional*): the world size the bytes are counted for, when one process stands for that many
            ranks (`compress_locally`); `comm.world_size` when `None`.
        workspace (`Callable`, *optional*): `workspace(kind, length, device, dtype)` gives a work buffer kept from step
            to step (the DDP hook's); fresh tensors when `None`.
        decode_chunk (`int`, *optional*): decode at most this many entries per kernel call (the eager kernel's
            temporaries stay a chunk's).
        count_kept (`bool`, *optional*, defaults to `False`): count the values sent into `stats.kept`.
        agree_within (`Callable`, *optional*): `(flag, device) -> bool`, the NaN/Inf flag agreed within this rank's
            replica before [`agree_flag`] sends it, so that every rank of the world takes the same decision.
    """

    def __init__(self, kernels: Kernels, comm: Communicator, stats, count_as: int | None = None,
                 workspace: Callable | None = None, decode_chunk: int | None = None, count_kept: bool = False,
                 agree_within: Callable | None = None):  # fmt: skip
        self.kernels, self.comm, self.stats = kernels, comm, stats
        self.count_as = comm.world_size if count_as is None else count_as
        self.workspace, self.decode_chunk, self.count_kept = workspace, decode_chunk, count_kept
        self.agree_within = agree_within

    def _max_blocks(self, spec: CodecSpec) -> int | None:
        return None if self.decode_chunk is None else max(1, self.decode_chunk // spec.block_size)

    def _buffer(self, kind, length: int, device, dtype) -> torch.Tensor:
        if self.workspace is None:
            return torch.empty(length, dtype=dtype, device=device)
        return self.workspace(kind, length, device, dtype)

    def _with_feedback(self, residual: Residual, spec: CodecSpec, encoder, rows, *args, keep: bool = False, **kwargs):
        """
        The error feedback of every encode: the residual row read, `encoder(kernels, spec, rows, residual_row, ...)`
        (which adds it and returns `(message, new_row)`), the new row written; with `keep` it is returned instead, for
        the caller to write once the exchange's outcome is known.
        """
        message, new_row = encoder(self.kernels, spec, rows, residual.read(spec.block_size), *args, **kwargs)
        if keep:
            return message, new_row
        residual.write(new_row)
        return message, None

    # --- small collectives: the NaN/Inf flag, the tensors sent dense ---
    def agree_flag(self, flag: bool, device) -> "Started":
        """Start the all-reduce (max) of this rank's NaN/Inf `flag`; `wait()` gives the agreed one as a 1-tensor."""
        if self.agree_within is not None:
            flag = self.agree_within(flag, device)
        started = self.comm.start_all_reduce(torch.tensor([int(flag)], device=device), op=dist.ReduceOp.MAX)
        self.stats.bytes_sent += allreduce_bytes(FLAG_BYTES, self.count_as)
        return started

    def start_mean(self, vector: torch.Tensor) -> "Mean":
        """Start the all-reduce of `vector` (sent as it is, e.g. fp32); `wait()` divides it by `W` in place."""
        started = self.comm.start_all_reduce(vector)
        self.stats.bytes_sent += allreduce_bytes(vector.numel() * vector.element_size(), self.count_as)
        if self.count_kept:
            self.stats.kept += vector.numel()
        return Mean(started, self.comm.world_size)

    # --- all-gather ---
    def start_all_gather(self, parts: list[Part], tag: int = 0, keep_residuals: bool = False) -> "Gathered":
        """
        Encode the parts with their residuals and start the all-gather of this rank's messages (one collective for all
        of them; `tag` tells apart the send/recv pairs of exchanges under way at once). With `keep_residuals` the new
        residuals are written only by [`Gathered.finish`] (an exchange whose outcome is not known yet). Sizes known
        (density 1, 4 to 16 bits): encoded straight into this rank's part of the gather; else each rank's total is
        announced and every rank's messages are padded to the longest.
        """
        comm, stats, device = self.comm, self.stats, parts[0].rows.device
        fixed = [message_nbytes(part.run.spec, part.run.num_blocks) for part in parts]
        fixed = fixed if all(size is not None for size in fixed) else None
        if fixed is not None:  # in place: this rank's part of the output
            total = sum(fixed)
            gathered = self._buffer(("gathered", tag), comm.world_size * total, device, torch.uint8)
            payload = gathered[comm.rank * total : (comm.rank + 1) * total]
            slots = split_messages(payload, fixed)
        messages, kept = [], []
        for index, part in enumerate(parts):
            slot = None if fixed is None else slots[index]
            message, new_residual = self._with_feedback(part.residual, part.run.spec, encode, part.rows,
                                                        part.run.num_values(), slot, in_place=not keep_residuals,
                                                        keep=keep_residuals)  # fmt: skip
            messages.append(message)
            kept.append(new_residual)
            if self.count_kept:
                stats.kept += min(part.run.num_values(), part.run.numel)
        if fixed is not None:
            started = comm.start_all_gather(payload, gathered, tag=tag)
            stats.bytes_sent += allgather_bytes(payload.numel(), self.count_as)
        else:
            payload = torch.cat(messages)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
            totals = comm.all_gather(size, tag=tag).view(-1).tolist()  # (another tag's may be under way)
            stats.bytes_sent += allgather_bytes(SIZE_BYTES, self.count_as)
            longest = max(totals)
            started = comm.start_all_gather(torch.nn.functional.pad(payload, (0, longest - payload.numel())), tag=tag)
            stats.bytes_sent += allgather_bytes(longest, self.count_as)
        return Gathered(self, parts, started, fixed, kept if keep_residuals else None)

    # --- owner reduction ---
    def reduce_with_owners(self, parts: list[Part]) -> None:
        """
        Owner reduction of the parts (blocking): this rank's blocks of every part go to their owners (one all-to-all),
        each owner averages the `W` contributions to its blocks and compresses the mean again with its own residual
        (the parts' `owner_residual`), the owners' messages are all-gathered and every rank decodes them in owner
        order.
        """
        for part in parts:
            if not code_for(part.run.spec).owner_reducible:
                raise ValueError(f"owner reduction cannot carry {code_for(part.run.spec)!r}: use the all-gather.")
        comm, stats, kernels = self.comm, self.stats, self.kernels
        world_size, rank, device = comm.world_size, comm.rank, parts[0].rows.device
        block_rows = [owned_blocks(part.run, world_size, device) for part in parts]  # per part and rank
        counts = [[index.numel() for _, index in owned] for owned in block_rows]  # per part and rank: blocks owned
        fixed = [[message_nbytes(part.run.spec, count[r]) for part, count in zip(parts, counts)]
                 for r in range(world_size)]  # fmt: skip
        known = all(size is not None for sizes in fixed for size in sizes)
        empty = torch.zeros(0, dtype=torch.uint8, device=device)
        to_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        if known:  # sizes known: every message is written in place into one send buffer
            send_sizes = [sum(sizes) for sizes in fixed]
            send = self._buffer("send", sum(send_sizes), device, torch.uint8)
            to_rank = [split_messages(piece, sizes) for piece, sizes in zip(split_messages(send, send_sizes), fixed)]
        for index, (part, owned) in enumerate(zip(parts, block_rows)):
            run, block = part.run, part.run.spec.block_size
            # the values each owner's message keeps
            ks = [run.num_values(n * block, run.owned_numel(world_size, r)) for r, n in enumerate(counts[index])]
            mine = [m[index] for m in to_rank] if known else None
            messages, _ = self._with_feedback(part.residual, run.spec, _encode_to_owners, part.rows, owned, ks, mine)
            if not known:
                for owner, message in enumerate(messages):
                    to_rank[owner].append(message)
            if self.count_kept:
                stats.kept += sum(min(k, run.owned_numel(world_size, o)) for o, k in enumerate(ks) if counts[index][o])

        def reduce_into(contributions: list[torch.Tensor], message: torch.Tensor | None = None) -> list[torch.Tensor]:
            """The owner's half of every part, into `message` (the parts' messages one after the other) when sizes are
            known; returns the message of each part."""
            if known:
                received = [split_messages(c, fixed[rank]) for c in contributions]
                slots = split_messages(message, fixed[rank])
            else:
                mine_runs = [(part.run.spec, count[rank]) for part, count in zip(parts, counts)]
                received, slots = [walk_messages(c, mine_runs) for c in contributions], [None] * len(parts)
            out = []
            for index, part in enumerate(parts):
                run, nblocks = part.run, counts[index][rank]
                if nblocks == 0:
                    out.append(empty)
                    continue
                k = run.num_values(nblocks * run.spec.block_size, run.owned_numel(world_size, rank))
                message, _ = self._with_feedback(part.owner_residual, run.spec, _reduce_owned,
                                                 [r[index] for r in received], k, slots[index])  # fmt: skip
                out.append(message)
            return out

        if known:  # the owner's message written in place into the all-gather's payload
            payload = None if self.workspace is None else self._buffer("owned", max(send_sizes), device, torch.uint8)
            owner_messages = self._with_owners(send, send_sizes, reduce_into, payload)
            per_owner = [split_messages(message, sizes) for message, sizes in zip(owner_messages, fixed)]
        else:
            per_owner = self._with_owners_announced(to_rank, reduce_into, parts, counts, empty)
        for index, (part, owned) in enumerate(zip(parts, block_rows)):
            messages = [per_owner[r][index] for r in range(world_size)]
            values = code_for(part.run.spec).decode_from_owners(kernels, messages, owned, part.run.num_blocks,
                                                                part.out, self._max_blocks(part.run.spec))  # fmt: skip
            if part.out is None:
                part.write(values)

    def _with_owners(self, send: torch.Tensor, sizes: list[int], reduce_into, payload=None) -> list[torch.Tensor]:
        """
        Owner reduction's collectives, sizes known (no top-k, no 2 bits): the all-to-all of this rank's part for each
        owner (`sizes[j]` bytes for owner `j`), the owner's half here (`reduce_into(contributions, message)`), the
        all-gather of the owners' messages padded to the longest. Returns the owners' messages (views).
        """
        comm = self.comm
        world_size, rank = comm.world_size, comm.rank
        received = comm.all_to_all(send, sizes, [sizes[rank]] * world_size)
        if payload is None:
            payload = torch.zeros(max(sizes), dtype=torch.uint8, device=send.device)
        else:
            payload[sizes[rank] :].zero_()  # the padding up to the longest owner's message
        reduce_into(split_messages(received, [sizes[rank]] * world_size), payload[: sizes[rank]])
        gathered = comm.all_gather(payload)
        self.stats.bytes_sent += owner_reduction_bytes(sizes, self.count_as)
        return [gathered[owner, : sizes[owner]] for owner in range(world_size)]

    def _with_owners_announced(self, to_rank, reduce_into, parts, counts, empty) -> list[list[torch.Tensor]]:
        """The collectives of owner reduction when sizes depend on the data: announced first (every rank learns every
        rank's total, to count the same bytes); returns the owners' messages of each part."""
        comm, stats, count_as = self.comm, self.stats, self.count_as
        world_size, device = comm.world_size, empty.device
        sends = [torch.cat(messages) if messages else empty for messages in to_rank]
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
        return [walk_messages(gathered[r], [(part.run.spec, count[r]) for part, count in zip(parts, counts)])
                for r in range(world_size)]  # fmt: skip

    # --- FSDP2's reduce-scatter ---
    def reduce_scatter(self, chunks: torch.Tensor, spec: CodecSpec, residual=None, average: bool = True):
        """
        Each rank's chunk `j` of `chunks` (`[W, S]`, chunk `j` what rank `j` owns) to its owner as one row message
        (the code's `encode_rows`: block codes, or fp32 as it is at 32 bits), in one all-to-all of equal-size messages; the owner sums
        the `W` contributions in rank order, its own chunk exact, and divides by `W` when `average`.

        A row holding a NaN/Inf reaches its owner as NaN (or as it is, in fp32). With a `residual` (`read()`: the fp32
        `[W - 1, S]` values to add, `None` at first; `write(values)`: what was not sent, for a finite step only), the
        rows sent carry error feedback.

        Returns:
            `(total, finite)`: this rank's `[S]` fp32 chunk of the result, and whether the rows it sent were finite.
        """
        comm, stats = self.comm, self.stats
        world_size, rank = comm.world_size, comm.rank
        numel = chunks.shape[1]
        others = [j for j in range(world_size) if j != rank]
        rows = chunks[others].float()  # [W - 1, S]: a copy
        stored = residual.read() if residual is not None else None
        if stored is not None:
            rows += stored
        finite = bool(torch.isfinite(rows).all())
        messages, decoded = code_for(spec).encode_rows(self.kernels, rows, None if finite else ~torch.isfinite(rows))
        if residual is not None and finite:
            residual.write(rows - decoded)
        size = messages.shape[1]
        send = torch.zeros(world_size, size, dtype=torch.uint8, device=chunks.device)
        send[others] = messages
        received = comm.all_to_all(send.view(-1), [size] * world_size, [size] * world_size).view(world_size, size)
        stats.bytes_sent += alltoall_bytes(world_size * size, self.count_as)  # a message to each other rank
        incoming = code_for(spec).decode_rows(self.kernels, received[others], numel)
        total = chunks[0].float() if rank == 0 else incoming[0].clone()
        for source in range(1, world_size):
            total += chunks[rank].float() if source == rank else incoming[source - (source > rank)]
        if average:
            total /= world_size
        return total, finite


class Gathered:
    """
    An all-gather of [`Exchange.start_all_gather`] under way: [`wait`] waits for it, [`finish`] also decodes every part
    (its mean into `out`, or handed to `write`), after writing the residuals kept for later.
    """

    def __init__(self, exchange: Exchange, parts: list[Part], started: Started, fixed, kept):
        self.exchange, self.parts, self.started, self.fixed, self.kept = exchange, parts, started, fixed, kept

    def wait(self) -> torch.Tensor:
        return self.started.wait()

    def finish(self) -> None:
        exchange, gathered = self.exchange, self.wait()
        world_size = gathered.shape[0]
        for part, new_residual in zip(self.parts, self.kept or ()):
            part.residual.write(new_residual)
        if self.fixed is not None:
            per_rank = [split_messages(gathered[r], self.fixed) for r in range(world_size)]
        else:
            runs = [(part.run.spec, part.run.num_blocks) for part in self.parts]
            per_rank = [walk_messages(gathered[r], runs) for r in range(world_size)]
        for index, part in enumerate(self.parts):
            messages = [per_rank[r][index] for r in range(world_size)]
            values = decode(exchange.kernels, part.run.spec, messages, part.run.num_blocks, world_size, part.out,
                            exchange._max_blocks(part.run.spec))  # fmt: skip
            if part.out is None:
                part.write(values)


class Mean:
    """The all-reduce of [`Exchange.start_mean`] under way: [`wait`] returns the vector, divided by `W` in place."""

    def __init__(self, started: Started, world_size: int):
        self.started, self.world_size = started, world_size

    def wait(self) -> torch.Tensor:
        return self.started.wait().div_(self.world_size)


__all__ = ["Exchange", "Gathered", "Mean", "Part", "Residual", "decode", "decode_rows", "encode", "encode_rows",
           "message_nbytes", "split_messages", "walk_messages"]  # fmt: skip
