"""The chunked top-k code of the sync every H steps (SparseLoCo): `k` entries of every chunk of `C`, 2-bit values.

A row of `[n, C]` chunks (a fragment's row of `Δ + r`, each tensor zero-padded to whole chunks) keeps, per chunk, its
`k = ceil(density * C)` entries of largest magnitude (SparseLoCo: 64 of every 4,096). What a message holds of a chunk:

- its two magnitude levels `(lo, hi)`, two bf16 numbers in 4 bytes (the chunk's scale word);
- `k` codes of 2 bits, sign and magnitude level: bit 0 set for a negative value, bit 1 for the level `hi`; a kept value
  decodes to `± lo` or `± hi`;
- `k` positions within the chunk, `log2 C` bits each (12 for a chunk of 4,096), bit-packed.

The levels are a two-level quantizer fitted to each chunk's kept magnitudes (one step of Lloyd's algorithm from their
mean): the magnitudes above their mean take `hi`, the mean of them, the others `lo`, the mean of theirs. Top-k
magnitudes crowd just above the chunk's threshold (a Gaussian chunk's top 64 of 4,096 lie within about 0.9 to 1.4
times their mean), so two levels fitted to them lose less than fixed fractions of one scale would. A chunk whose
kept entries include exact zeros (the padding of a tensor's last chunk when it holds fewer than `k` real entries, or
entries that did not move) sets `lo = 0`: those zeros decode to zero exactly, the padding stays zero in every row, and
the non-zero kept entries share `hi`. The last chunk of a tensor shorter than `C` is therefore sent exactly as a full
one, its padding never selected over a non-zero entry.

A message of `n` chunks: the `n` scale words, then the `n k` codes, then the `n k` positions, each bit-packed
(little-endian, first value in the lowest bits), padded to 16 bytes ([`chunk_topk_nbytes`]):

    4 n + ceil(2 n k / 8) + ceil(log2(C) n k / 8)  bytes, padded to 16         (116 bytes per chunk at 64 of 4,096)

Its size follows from `n` alone, so it is written in place into the sync's all-gather, as the block codes are. Owner
reduction does not carry it: a rank's chunks are all-gathered and every rank decodes the `W` messages in rank order (as
SparseLoCo does), so what one rank sends, `(W − 1) s`, grows with the world size (see `docs/compression.md`).
"""

import torch

from ..spec import CodecSpec, num_kept
from .base import Code, padded_nbytes, register
from .topk import view_as


CHUNK_TOPK = "chunk-topk"
CHUNK_TOPK_BITS = 2  # bits per kept value: sign and magnitude level
_PACK_VALUES = 1 << 18  # values bit-packed per slice (a multiple of 8: every slice ends on a byte)


def chunk_topk_nbytes(nchunks: int, k: int, chunk: int) -> int:
    """
    Bytes of the message of `nchunks` chunks of `chunk` entries keeping `k` each: the scale words (`4` bytes a chunk),
    the 2-bit codes and the `log2(chunk)`-bit positions, bit-packed, padded to 16 bytes.
    """
    values = nchunks * k
    index_bits = chunk.bit_length() - 1
    return padded_nbytes(4 * nchunks + -(-CHUNK_TOPK_BITS * values // 8) + -(-index_bits * values // 8))


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below `2**width` (flat) as `width`-bit fields, little-endian: `ceil(n width / 8)` uint8."""
    values = values.reshape(-1)
    device = values.device
    shifts = torch.arange(width, dtype=torch.int32, device=device)
    weights = torch.arange(8, dtype=torch.uint8, device=device)
    pieces = []
    for start in range(0, values.numel(), _PACK_VALUES):
        piece = values[start : start + _PACK_VALUES].to(torch.int32)
        bits = ((piece.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
        bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
        pieces.append((bits.view(-1, 8) << weights).sum(dim=1, dtype=torch.int32).to(torch.uint8))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def unpack_bits(payload: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of [`pack_bits`]: the first `count` `width`-bit fields of `payload`, as int64."""
    device = payload.device
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    weights = torch.arange(width, dtype=torch.int64, device=device)
    out = torch.empty(count, dtype=torch.int64, device=device)
    step = _PACK_VALUES * width // 8  # the bytes of one slice of values
    for index, start in enumerate(range(0, count, _PACK_VALUES)):
        size = min(_PACK_VALUES, count - start)
        raw = payload[index * step : index * step + -(-size * width // 8)]
        bits = ((raw.unsqueeze(1) >> shifts) & 1).reshape(-1)[: size * width].view(size, width).to(torch.int64)
        out[start : start + size] = (bits << weights).sum(dim=1)
    return out


@register
class ChunkTopKCode(Code):
    """
    The chunked top-k code (see the module docstring): chosen by `CodecSpec(code="chunk-topk", density=k / C, bits=2,
    block_size=C)`; fixed in size, carried by the sync every H steps (all-gathered), not by owner reduction.

    Raises:
        `ValueError`: bits other than 2, a chunk of fewer than 2 entries, or a density that keeps every entry of a
            chunk (use the block codes).
    """

    name = CHUNK_TOPK
    fixed_size = True
    every_entry = False
    in_sync = True
    owner_reducible = False

    def __init__(self, spec: CodecSpec):
        super().__init__(spec)
        chunk = spec.block_size
        self.k = num_kept(chunk, spec.density)
        if spec.bits != CHUNK_TOPK_BITS:
            raise ValueError(f"{CHUNK_TOPK} sends {CHUNK_TOPK_BITS}-bit values: use bits=2, got {spec.bits}.")
        if chunk < 2 or self.k >= chunk:
            raise ValueError(
                f"{CHUNK_TOPK} keeps {self.k} of every {chunk} entries: use a chunk of 2 entries or more and a "
                "density that keeps fewer than all of them (density 1 is the block codes' job)."
            )
        self.index_bits = chunk.bit_length() - 1  # log2 C: a position within the chunk

    @classmethod
    def sync_spec(cls, density: float, chunk: int) -> CodecSpec:
        """The spec of `grpo_sync_density` and `grpo_sync_chunk` (below density 1): `k = ceil(density C)` of every `C`."""
        return CodecSpec(density=density, bits=CHUNK_TOPK_BITS, block_size=chunk, code=cls.name)

    def describe(self) -> str:
        return f"top {self.k} of every {self.spec.block_size}, bits {CHUNK_TOPK_BITS}"

    # --- sizes ---
    def message_nbytes(self, nblocks: int) -> int:
        """[`chunk_topk_nbytes`] of `nblocks` chunks."""
        return chunk_topk_nbytes(nblocks, self.k, self.spec.block_size)

    def num_values(self, length: int, numel: int) -> int:
        """`k` per chunk of the `length` entries (padding included: a short last chunk keeps `k` slots too)."""
        return -(-length // self.spec.block_size) * self.k

    # --- the levels ---
    @staticmethod
    def levels(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """
        The chunks' `[n, 2]` bf16 levels `(lo, hi)` and the `[n, k]` uint8 codes of the kept values `[n, k]` (fp32):
        bit 0 the sign, bit 1 the level (see the module docstring).
        """
        magnitude = kept.abs()
        zero = magnitude == 0
        high = torch.where(zero.any(dim=1, keepdim=True), ~zero, magnitude > magnitude.mean(dim=1, keepdim=True))
        count_high = high.sum(dim=1)
        sum_high = torch.where(high, magnitude, 0.0).sum(dim=1)
        sum_low = torch.where(high, 0.0, magnitude).sum(dim=1)  # (zeros only, when the chunk kept a zero: lo = 0)
        lo = sum_low / (kept.shape[1] - count_high).clamp(min=1)
        hi = torch.where(count_high > 0, sum_high / count_high.clamp(min=1), lo)
        codes = (kept < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
        return torch.stack([lo, hi], dim=1).to(torch.bfloat16), codes

    @staticmethod
    def values(levels: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The fp32 values `[n, k]` of codes under their chunks' `[n, 2]` levels."""
        levels = levels.float()
        magnitude = torch.where((codes & 2).bool(), levels[:, 1:], levels[:, :1])
        return torch.where((codes & 1).bool(), -magnitude, magnitude)

    # --- messages ---
    def encode(self, kernels, rows, residual, k: int | None = None, message=None, in_place: bool = False):
        """`rows + residual` as one message of `k` entries per chunk (the spec's `k`; the argument is not read)."""
        x = rows.float() if residual is None else rows.float() + residual.float()
        nchunks = x.shape[0]
        positions = torch.topk(x.abs(), self.k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = x.gather(1, positions)
        levels, codes = self.levels(kept)
        body = [levels.view(torch.uint8).reshape(-1), pack_bits(codes, CHUNK_TOPK_BITS),
                pack_bits(positions, self.index_bits)]  # fmt: skip
        nbytes = self.message_nbytes(nchunks)
        if message is None:
            message = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        offset = 0
        for part in body:
            message[offset : offset + part.numel()] = part
            offset += part.numel()
        message[offset:nbytes].zero_()
        new_residual = None
        if residual is not None:
            sent = torch.zeros_like(x).scatter_(1, positions, self.values(levels, codes))
            new_residual = (x - sent).to(residual.dtype)
            if in_place:
                residual.copy_(new_residual)
                new_residual = residual
        return message, new_residual

    def read(self, message: torch.Tensor, nchunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions [n, k] int64, values [n, k] fp32)` of a message of `nchunks` chunks."""
        count = nchunks * self.k
        levels = view_as(message[: 4 * nchunks], torch.bfloat16).view(nchunks, 2)
        start = 4 * nchunks
        code_nbytes = -(-CHUNK_TOPK_BITS * count // 8)
        codes = unpack_bits(message[start : start + code_nbytes], count, CHUNK_TOPK_BITS).view(nchunks, self.k)
        start += code_nbytes
        positions = unpack_bits(message[start:], count, self.index_bits).view(nchunks, self.k)
        return positions, self.values(levels, codes)

    def decode(self, kernels, messages, nblocks: int, divide: float = 1, out=None, max_blocks: int | None = None):
        """The messages' chunks summed in order: each scattered (its positions are distinct) and added, so that every
        rank adds the same numbers in the same order."""
        device = messages[0].device
        total = torch.zeros(nblocks, self.spec.block_size, device=device)
        one = torch.empty_like(total)
        for message in messages:
            positions, values = self.read(message, nblocks)
            total += one.zero_().scatter_(1, positions, values)
        if divide != 1:
            total /= divide
        return self.finish(total, out)


__all__ = ["CHUNK_TOPK", "CHUNK_TOPK_BITS", "ChunkTopKCode", "chunk_topk_nbytes", "pack_bits", "unpack_bits"]
