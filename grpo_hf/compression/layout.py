"""How the gradients of a DDP bucket become rows of the codec: runs of tensors that share a spec, and block owners.

A bucket's buffer holds its gradients one after the other. A **run** is a stretch of consecutive tensors of the buffer
sent with one [`~grpo_hf.compression.spec.CodecSpec`] whose every tensor fills whole blocks (`numel % block_size ==
0`, as almost every weight matrix does): the run's row *is* that stretch of the buffer, viewed as `[blocks, B]`, so the
codec reads and writes the gradients in place. A tensor that does not fill whole blocks forms a run of its own, copied
into a zero-padded row. Either way a block never mixes two tensors: each tensor's blocks start at its first entry, so
codes and residuals do not depend on how DDP packed its buckets. Top-k selects within a run.

Tensors sent dense (`spec is None`: norms, biases) end a run, except a small one (at most `ABSORB_MAX_NUMEL` entries,
whole blocks) between two tensors of a run whose code sends every entry (density 1): the run then spans it, so that a model whose norms sit between
its weight matrices still makes one run (one kernel call) per bucket. Its blocks are encoded and sent with the run's
(codes that nobody uses: about one byte per entry) and its exact average, from the dense all-reduce, overwrites the
decoded values.

In the all-reduce mode each tensor's blocks are cut into `W` contiguous chunks; chunk `j` of a tensor is owned by rank
`(j + crc32(name)) mod W` (a stable hash, so that small tensors, which fill only the first chunks, spread over the
ranks). Ownership depends only on the tensor's name, size and `W`, never on how DDP packed its buckets.
"""

import zlib
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .codes import code_for
from .spec import CodecSpec, num_blocks


ABSORB_MAX_NUMEL = 4096  # dense tensors up to this size may sit inside a run (see the module docstring)


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of a bucket sent with one spec, as one row of `length` entries (a multiple of the block)."""

    spec: CodecSpec
    names: tuple[str, ...]
    numels: tuple[int, ...]
    positions: tuple[int, ...]  # index of each tensor in the bucket
    starts: tuple[int, ...]  # first entry of each tensor in the bucket's buffer
    offsets: tuple[int, ...]  # first entry of each tensor in the row (multiples of the block size)
    length: int
    in_place: bool  # the row is a view of the buffer (else a padded copy)
    covered: tuple[tuple[int, int, int], ...]  # (index in the bucket, offset in the row, numel) of every tensor in it
    _owned: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def key(self) -> tuple:
        """What identifies the run's rows in the state (its spec and tensors)."""
        return (self.spec, self.names)

    @property
    def numel(self) -> int:
        """Entries of the tensors, padding excluded."""
        return sum(self.numels)

    @property
    def num_blocks(self) -> int:
        return self.length // self.spec.block_size

    @cached_property
    def slots(self) -> list[tuple[str, int, int]]:
        """`(name, offset, numel)` of each tensor sent in the row (one list per run: the state recognizes it)."""
        return list(zip(self.names, self.offsets, self.numels))

    def num_values(self, length: int | None = None, numel: int | None = None) -> int:
        """
        Values a message of the row (or of a part of `length` entries, `numel` of them real) carries, as its code says:
        every entry (padding included) for the block codes, the top `ceil(density * numel)` (padding excluded) for
        top-k.
        """
        return code_for(self.spec).num_values(self.length if length is None else length,
                                              self.numel if numel is None else numel)  # fmt: skip

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """The run's `[blocks, B]` gradients in the buffer's dtype: a view of `buffer`, or a zero-padded copy."""
        block = self.spec.block_size
        if self.in_place:
            return buffer[self.starts[0] : self.starts[0] + self.length].view(-1, block)
        row = torch.zeros(self.length, dtype=buffer.dtype, device=buffer.device)
        for start, offset, numel in zip(self.starts, self.offsets, self.numels):
            row[offset : offset + numel] = buffer[start : start + numel]
        return row.view(-1, block)

    def write(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """Write `[blocks, B]` values (in the buffer's dtype) into the run's entries of `buffer`."""
        if self.in_place:
            view = buffer[self.starts[0] : self.starts[0] + self.length]
            if values.data_ptr() != view.data_ptr():
                view.copy_(values.view(-1))
            return
        flat = values.reshape(-1)
        for start, offset, numel in zip(self.starts, self.offsets, self.numels):
            buffer[start : start + numel] = flat[offset : offset + numel]

    def owned_blocks(self, world_size: int) -> list[torch.Tensor]:
        """For each rank, the `int64` indices of the blocks of this run it owns in the all-reduce mode."""
        return self._ownership(world_size)[0]

    def owned_ranges(self, world_size: int) -> list[list[tuple[int, int]]]:
        """For each rank, the blocks of [`owned_blocks`] as `[start, end)` ranges (adjacent ones merged)."""
        return self._ownership(world_size)[3]

    def owned_numel(self, world_size: int, rank: int) -> int:
        """Real entries (padding excluded) in the blocks `rank` owns."""
        return self._ownership(world_size)[1][rank]

    def owned_slots(self, world_size: int, rank: int) -> list[tuple[str, int, int]]:
        """`(name, offset, size)` of each tensor's chunk in the row of the blocks `rank` owns (in block order)."""
        return self._ownership(world_size)[2][rank]

    def _ownership(self, world_size: int):
        if world_size not in self._owned:
            block = self.spec.block_size
            owned = [[] for _ in range(world_size)]
            real = [0] * world_size
            slots = [[] for _ in range(world_size)]
            for name, offset, numel in zip(self.names, self.offsets, self.numels):
                first, count = offset // block, num_blocks(numel, block)
                shift = chunk_owner(name, world_size)
                for j, (start, end) in enumerate(chunk_bounds(count, world_size)):
                    rank = (j + shift) % world_size
                    slots[rank].append((name, len(owned[rank]) * block, (end - start) * block))
                    owned[rank].extend(range(first + start, first + end))
                    real[rank] += max(0, min(numel, end * block) - start * block)
            blocks = [torch.tensor(indices, dtype=torch.int64) for indices in owned]
            ranges = []
            for indices in owned:
                merged = []
                for index in indices:
                    if merged and merged[-1][1] == index:
                        merged[-1][1] += 1
                    else:
                        merged.append([index, index + 1])
                ranges.append([tuple(r) for r in merged])
            self._owned[world_size] = (blocks, real, slots, ranges)
        return self._owned[world_size]


@dataclass(frozen=True)
class BucketLayout:
    """A bucket's runs, and the `(start, numel)` of the tensors it sends dense."""

    runs: tuple[Run, ...]
    dense: tuple[tuple[int, int], ...]


def chunk_owner(name: str, world_size: int) -> int:
    """Rank that owns chunk 0 of a tensor in the all-reduce mode (chunk `j` goes to `(j + owner) % world_size`)."""
    return zlib.crc32(name.encode()) % world_size


def chunk_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """`world_size` contiguous `[start, end)` ranges that split `count` items as evenly as possible (some may be empty)."""
    starts = [j * count // world_size for j in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))


def bucket_layout(
    names: list[str | None], numels: list[int], starts: list[int], specs: list[CodecSpec | None]
) -> BucketLayout:
    """
    The runs and dense tensors of a bucket whose tensor `i` (name, entries, first entry in the buffer, spec) is
    given in bucket order; unnamed tensors and lossless specs are sent dense.
    """
    runs, dense = [], []
    current = None  # [spec, members, absorbable dense tensors after the last member], members: (index, name or None)

    def close():
        if current is None:
            return
        spec, members = current[0], current[1]
        block = spec.block_size
        if len(members) == 1 and numels[members[0][0]] % block:  # a padded run of its own
            index, name = members[0]
            length = num_blocks(numels[index], block) * block
            run = Run(spec, (name,), (numels[index],), (index,), (starts[index],), (0,), length, False,
                      ((index, 0, numels[index]),))  # fmt: skip
        else:
            first = starts[members[0][0]]
            covered = tuple((i, starts[i] - first, numels[i]) for i, _ in members)
            sent = [(i, name) for i, name in members if name is not None]
            run = Run(spec, tuple(n for _, n in sent), tuple(numels[i] for i, _ in sent), tuple(i for i, _ in sent),
                      tuple(starts[i] for i, _ in sent), tuple(starts[i] - first for i, _ in sent),
                      sum(numels[i] for i, _ in members), True, covered)  # fmt: skip
        runs.append(run)

    def follows(index: int) -> bool:
        last = (current[2] or current[1])[-1][0]
        return starts[last] + numels[last] == starts[index]

    for index, (name, numel, start, spec) in enumerate(zip(names, numels, starts, specs)):
        if numel == 0:
            continue
        if name is None or spec is None or spec.lossless:
            dense.append((start, numel))
            if (
                current is not None
                and code_for(current[0]).every_entry
                and numel <= ABSORB_MAX_NUMEL
                and numel % current[0].block_size == 0
                and follows(index)
            ):
                current[2].append((index, None))
            else:
                close()
                current = None
            continue
        whole = numel % spec.block_size == 0
        if current is not None and current[0] == spec and whole and follows(index):
            current[1].extend(current[2])
            current[2].clear()
            current[1].append((index, name))
            continue
        close()
        current = [spec, [(index, name)], []]
        if not whole:  # a tensor that does not fill whole blocks: a padded run of its own
            close()
            current = None
    close()
    return BucketLayout(tuple(runs), tuple(dense))


# ----------------------------------------------------------------------------------------------------------------
# The blocks each rank owns (owner reduction; `owned.py` takes them out of rows and puts them back)
# ----------------------------------------------------------------------------------------------------------------


def owned_blocks(run, world_size: int, device) -> list[tuple]:
    """
    Per rank, the blocks of a [`~grpo_hf.compression.layout.Run`] it owns, as `(ranges, index)` on `device`: the
    `owned` argument of [`~grpo_hf.compression.owned.take_owned`] and [`~grpo_hf.compression.owned.put_owned`].
    """
    return [(r, index.to(device)) for r, index in zip(run.owned_ranges(world_size), run.owned_blocks(world_size))]


__all__ = [
    "ABSORB_MAX_NUMEL",
    "BucketLayout",
    "Run",
    "bucket_layout",
    "chunk_bounds",
    "chunk_owner",
    "owned_blocks",
]
