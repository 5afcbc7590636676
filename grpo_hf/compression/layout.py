"""How the gradients of a DDP bucket become rows of the codec: one segment per spec, and who owns which blocks.

A **segment** holds the tensors of a bucket that share one [`~grpo_hf.compression.spec.CodecSpec`], in bucket order,
each padded to whole blocks, so that a block never mixes two tensors: the codec compresses a segment as one row (one
message), with the same per-block results as tensor by tensor. Top-k then selects within the segment (the article's
"top 15% within a group" rather than within each tensor).

In the all-reduce mode each tensor's blocks are cut into `W` contiguous chunks; chunk `j` of a tensor is owned by rank
`(j + crc32(name)) mod W` (a stable hash, so that small tensors, which fill only the first chunks, spread over the
ranks). Ownership depends only on the tensor's name, size and `W`, never on how DDP packed its buckets, so results do
not change when DDP rebuilds its buckets or a run resumes.
"""

import zlib
from dataclasses import dataclass, field

import torch

from .spec import CodecSpec, num_blocks, num_kept


@dataclass(frozen=True)
class Segment:
    """The tensors of a bucket sent with one spec, as one block-aligned row of `length` entries."""

    spec: CodecSpec
    names: tuple[str, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each tensor in the row (multiples of the block size)
    length: int  # padded length of the row
    _owned: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def key(self) -> tuple:
        return (self.spec, self.names)

    @property
    def numel(self) -> int:
        """Entries of the tensors, padding excluded."""
        return sum(self.numels)

    @property
    def num_blocks(self) -> int:
        return self.length // self.spec.block_size

    def num_values(self, length: int | None = None, numel: int | None = None) -> int:
        """
        Values a message of the whole row (or of a part of `length` entries, `numel` of them real) carries: every
        entry (padding included) at density 1, else the top `ceil(density * numel)` (padding excluded).
        """
        if self.spec.density >= 1.0:
            return self.length if length is None else length
        return num_kept(self.numel if numel is None else numel, self.spec.density)

    def views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's entries in a `[length]` row (views)."""
        return [row[offset : offset + numel] for offset, numel in zip(self.offsets, self.numels)]

    def owned_blocks(self, world_size: int) -> list[torch.Tensor]:
        """
        For each rank, the `int64` indices of the blocks of this segment it owns in the all-reduce mode (each
        tensor's blocks cut into `world_size` contiguous chunks, chunk `j` owned by rank `(j + chunk_owner(name)) % W`).
        """
        return self._ownership(world_size)[0]

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
            self._owned[world_size] = (blocks, real, slots)
        return self._owned[world_size]


def chunk_owner(name: str, world_size: int) -> int:
    """Rank that owns chunk 0 of a tensor in the all-reduce mode (chunk `j` goes to `(j + owner) % world_size`)."""
    return zlib.crc32(name.encode()) % world_size


def chunk_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """`world_size` contiguous `[start, end)` ranges that split `count` items as evenly as possible (some may be empty)."""
    starts = [j * count // world_size for j in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))


def padded(numel: int, block_size: int) -> int:
    return num_blocks(numel, block_size) * block_size


def plan_segments(entries: list[tuple[str, int, CodecSpec]]) -> list[Segment]:
    """The segments of `(name, numel, spec)` entries (compressed ones only): one per spec, in order of appearance."""
    grouped: dict[CodecSpec, list[tuple[str, int]]] = {}
    for name, numel, spec in entries:
        grouped.setdefault(spec, []).append((name, numel))
    segments = []
    for spec, members in grouped.items():
        offsets, length = [], 0
        for _, numel in members:
            offsets.append(length)
            length += padded(numel, spec.block_size)
        names, numels = zip(*members)
        segments.append(Segment(spec, tuple(names), tuple(numels), tuple(offsets), length))
    return segments


__all__ = ["Segment", "chunk_bounds", "chunk_owner", "plan_segments"]
