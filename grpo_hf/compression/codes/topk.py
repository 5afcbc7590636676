"""The top-k code (density below 1): selection, compact index coding, its messages and [`TopKCode`].

At density `d < 1` a row sends its `k = ceil(d * numel)` entries of largest magnitude (after the gradient scales), the
kept values quantized in blocks by the block codes' kernels (`block.py`; or raw at 32 bits), and their
positions in the cheapest of these index schemes:

- `BITMAP`: `ceil(numel / 8)` bytes, bit `i % 8` of byte `i // 8` set for each kept position `i`.
- `DELTA4` / `DELTA8` / `DELTA16`: gaps `g = idx[j] - idx[j - 1]` (with `idx[-1] = -1`, so `g >= 1`) written as
  `w`-bit symbols, `M = 2**w - 1`: a symbol `s` in `[1, M]` means "advance `s` and keep", `0` means "advance `M`"
  (escape for long gaps). Cost: `w / 8 * (k + sum((g - 1) // M))` bytes.
- `INT32` / `INT64`: raw positions, `4k` / `8k` bytes (wins only when the mean gap exceeds about 2**17).

On random positions in a 1M-entry tensor the cheapest scheme is `DELTA4` at density 0.15 and `DELTA8` at 0.01
(`tests/test_codec.py` checks the bytes per index).

A top-k message: a 16-byte header (`int32` k, index scheme, index bytes, value bytes), the values (the fp32 absmax of
each block of kept values, then exactly `k` codes as the block codes write them (`block.py`); `4k` raw fp32 bytes
at 32 bits), the index payload, padded to 16 bytes. Its size depends on the data (the header says it). Owner reduction
sends each owner a top-k message of the blocks it owns, keeping the owner's share of `k` ([`TopKCode`] inherits the
interface's owner halves).
"""

import enum
import math
from dataclasses import dataclass

import torch

from ..spec import CodecSpec, num_blocks, num_kept
from .base import Code, padded_nbytes, register
from .block import code_shape


_INT32_MAX = 2**31 - 1
HEADER_NBYTES = 16


def view_as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret `uint8` bytes as `dtype`, copying first when the bytes are not aligned for it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if payload.storage_offset() % itemsize or not payload.is_contiguous():
        payload = payload.clone()
    return payload.view(dtype)


class IndexScheme(enum.IntEnum):
    """How the kept positions are stored on the wire (the first header byte)."""

    DENSE = 0
    BITMAP = 1
    DELTA4 = 2
    DELTA8 = 3
    DELTA16 = 4
    INT32 = 5
    INT64 = 6


_DELTA_WIDTH = {IndexScheme.DELTA4: 4, IndexScheme.DELTA8: 8, IndexScheme.DELTA16: 16}


def encode_positions(
    positions: torch.Tensor, numel: int, scheme: IndexScheme | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """
    Encode the sorted kept positions `[T, k]` of `T` rows of `numel` entries; by default each row gets the cheapest
    [`IndexScheme`] for it (ties go to the first of bitmap, delta4, delta8, delta16, raw).

    Returns the scheme of each row and its `uint8` payload. Raises `ValueError` if a row is not sorted, unique and
    in range.
    """
    rows, k = positions.shape
    device = positions.device
    gaps = torch.diff(positions, dim=1, prepend=positions.new_full((rows, 1), -1))
    if k and (bool((gaps < 1).any()) or int(positions[:, -1].max()) >= numel):
        raise ValueError(
            f"positions must be sorted, unique int64 positions in [0, {numel}). Sort them (`torch.sort`) and drop "
            "duplicates (`torch.unique`)."
        )
    # Escapes `floor((g - 1) / M)` per gap, in float64 (exact for g < 2**53; int64 division is slow on CPU).
    gm1 = (gaps - 1).to(torch.float64)
    escapes = {width: (gm1 / ((1 << width) - 1)).floor_() for width in (4, 8, 16)}
    raw, raw_bytes = (IndexScheme.INT32, 4) if numel <= _INT32_MAX else (IndexScheme.INT64, 8)
    costs = torch.stack(
        [
            torch.full((rows,), float((numel + 7) // 8), dtype=torch.float64, device=device),
            (k + escapes[4].sum(dim=1) + 1).div_(2).floor_(),
            k + escapes[8].sum(dim=1),
            2 * (k + escapes[16].sum(dim=1)),
            torch.full((rows,), float(raw_bytes * k), dtype=torch.float64, device=device),
        ]
    )
    # The first cheapest in the order bitmap, delta4, delta8, delta16, raw (as encode_indices breaks ties).
    order = [IndexScheme.BITMAP, IndexScheme.DELTA4, IndexScheme.DELTA8, IndexScheme.DELTA16, raw]
    if scheme is None:
        schemes = [int(order[i]) for i in torch.argmin(costs, dim=0).tolist()]  # one sync
    elif scheme == IndexScheme.DENSE:
        raise ValueError("`IndexScheme.DENSE` stores no indices; a dense tensor has no positions to encode.")
    elif scheme == IndexScheme.INT32 and numel > _INT32_MAX:
        raise ValueError(f"`IndexScheme.INT32` cannot address {numel} entries; use `IndexScheme.INT64`.")
    else:
        schemes = [int(scheme)] * rows
    out: list[torch.Tensor | None] = [None] * rows
    for scheme in set(schemes):
        selected = [row for row in range(rows) if schemes[row] == scheme]
        index = torch.tensor(selected, device=device)
        if scheme == IndexScheme.BITMAP:
            num_bytes = (numel + 7) // 8
            mask = torch.zeros(len(selected), num_bytes * 8, dtype=torch.uint8, device=device)
            mask.scatter_(1, positions[index], 1)
            shifts = torch.arange(8, dtype=torch.uint8, device=device)
            packed = (mask.view(len(selected), num_bytes, 8) << shifts).sum(dim=2, dtype=torch.int32).to(torch.uint8)
            pieces = list(packed.unbind(0))
        elif scheme in (IndexScheme.INT32, IndexScheme.INT64):
            dtype = torch.int32 if scheme == IndexScheme.INT32 else torch.int64
            pieces = list(positions[index].to(dtype).view(torch.uint8).unbind(0))
        else:
            width = _DELTA_WIDTH[IndexScheme(scheme)]
            limit = (1 << width) - 1
            esc_rows = escapes[width][index].to(torch.int64)
            symbols_per_row = k + esc_rows.sum(dim=1)
            padded = symbols_per_row + symbols_per_row % 2 if width == 4 else symbols_per_row
            starts = torch.cumsum(padded, dim=0) - padded
            ends = starts.view(-1, 1) + torch.arange(k, device=device) + torch.cumsum(esc_rows, dim=1)
            symbols = torch.zeros(int(padded.sum()), dtype=torch.int32, device=device)
            symbols[ends.reshape(-1)] = (gaps[index] - esc_rows * limit).reshape(-1).to(torch.int32)
            if width == 4:
                symbols = symbols.view(-1, 2)
                flat = (symbols[:, 0] | (symbols[:, 1] << 4)).to(torch.uint8)
                sizes = (padded // 2).tolist()
            elif width == 8:
                flat = symbols.to(torch.uint8)
                sizes = padded.tolist()
            else:
                flat = torch.where(symbols > 32767, symbols - 65536, symbols).to(torch.int16).view(torch.uint8)
                sizes = (2 * padded).tolist()
            pieces = list(torch.split(flat, sizes))
        for row, piece in zip(selected, pieces):
            out[row] = piece
    return schemes, out


def _symbols(payload: torch.Tensor, width: int) -> torch.Tensor:
    """The `int64` delta symbols of a `width`-bit payload (two per byte at 4 bits, low nibble first)."""
    if width == 4:
        return torch.stack((payload & 15, payload >> 4), dim=1).view(-1).to(torch.int64)
    if width == 8:
        return payload.to(torch.int64)
    return view_as(payload, torch.int16).to(torch.int64) & 0xFFFF


def decode_positions(schemes: list[int], payloads: list[torch.Tensor], numel: int, k: int) -> torch.Tensor:
    """Inverse of [`encode_positions`]: `[T, k]` sorted int64 positions (`ValueError` if a payload is corrupt)."""
    rows = len(schemes)
    device = payloads[0].device
    out = torch.empty(rows, k, dtype=torch.int64, device=device)
    for scheme in set(schemes):
        selected = [row for row in range(rows) if schemes[row] == scheme]
        index = torch.tensor(selected, device=device)
        parts = [payloads[row] for row in selected]
        if scheme == IndexScheme.BITMAP:
            packed = torch.stack(parts)
            shifts = torch.arange(8, dtype=torch.uint8, device=device)
            bits = ((packed.unsqueeze(2) >> shifts) & 1).view(len(selected), -1)[:, :numel]
            decoded = torch.nonzero(bits)[:, 1]
        elif scheme == IndexScheme.INT32:
            decoded = view_as(torch.cat(parts), torch.int32).to(torch.int64)
        elif scheme == IndexScheme.INT64:
            decoded = view_as(torch.cat(parts), torch.int64)
        else:
            width = _DELTA_WIDTH[IndexScheme(scheme)]
            limit = (1 << width) - 1
            symbols = _symbols(torch.cat(parts), width)
            counts = [p.numel() * 8 // width for p in parts]
            cumulative = torch.cumsum(torch.where(symbols == 0, limit, symbols), dim=0)
            ends = torch.tensor(counts, device=device).cumsum(dim=0)
            before = torch.cat([cumulative.new_zeros(1), cumulative[ends[:-1] - 1]])  # advance before each row
            counts_t = torch.tensor(counts, device=device)
            positions = cumulative - torch.repeat_interleave(before, counts_t) - 1
            decoded = positions[symbols != 0]
        if decoded.numel() != len(selected) * k:
            raise ValueError(f"corrupt index payload: {decoded.numel()} positions for {len(selected)} x {k} values.")
        out[index] = decoded.view(len(selected), k)
    return out


def encode_indices(
    indices: torch.Tensor, numel: int, scheme: IndexScheme | None = None
) -> tuple[IndexScheme, torch.Tensor]:
    """
    Encode one tensor's sorted kept positions (1-D); by default with the cheapest [`IndexScheme`].

    Args:
        indices (`torch.Tensor`): sorted, unique, non-negative integer positions below `numel`.
        numel (`int`): size of the dense tensor.
        scheme (`IndexScheme`, *optional*): force a scheme (tests, measurements) instead of the cheapest.

    Returns:
        `tuple[IndexScheme, torch.Tensor]`: the scheme and its `uint8` payload.
    """
    positions = indices.reshape(1, -1).to(torch.int64)
    if positions.numel() == 0:
        return IndexScheme.INT32, torch.zeros(0, dtype=torch.uint8, device=indices.device)
    schemes, payloads = encode_positions(positions, numel, scheme)
    return IndexScheme(schemes[0]), payloads[0]


def decode_indices(scheme: IndexScheme | int, payload: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of [`encode_indices`]: sorted `int64` positions."""
    scheme = IndexScheme(scheme)
    if scheme == IndexScheme.DENSE:
        raise ValueError(f"{scheme!r} has no index payload to decode.")
    payload = payload.reshape(-1)
    if scheme == IndexScheme.BITMAP:
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        return torch.nonzero(((payload.view(-1, 1) >> shifts) & 1).view(-1)[:numel]).view(-1)
    if scheme == IndexScheme.INT32:
        return view_as(payload, torch.int32).to(torch.int64)
    if scheme == IndexScheme.INT64:
        return view_as(payload, torch.int64).clone()
    k = int((_symbols(payload, _DELTA_WIDTH[scheme]) != 0).sum())
    return decode_positions([int(scheme)], [payload], numel, k)[0]


# ----------------------------------------------------------------------------------------------------------------
# Top-k selection
# ----------------------------------------------------------------------------------------------------------------

# A strided sample of this size chooses a threshold for rows of at least `_SAMPLED_TOPK_MIN_NUMEL` entries.
_SAMPLED_TOPK_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 15


def topk_positions(values: torch.Tensor, k: int) -> torch.Tensor:
    """
    Sorted `int64` positions of the `k` entries of largest magnitude of a flat tensor (ties broken arbitrarily).

    Large rows first keep the candidates above a threshold read from a strided sample (4 standard deviations of
    margin, a few % more than `k`), then select exactly among them: the same set as a full `torch.topk`, several times
    faster on CPU.
    """
    magnitudes = values.abs().view(-1)
    numel = magnitudes.numel()
    if k >= numel:
        return torch.arange(numel, device=values.device)
    if numel >= _SAMPLED_TOPK_MIN_NUMEL and 2 * k <= numel:
        sample = magnitudes[:: max(1, numel // _SAMPLE_SIZE)]
        size = sample.numel()
        fraction = k / numel
        target = fraction + 4.0 * (fraction * (1.0 - fraction) / size) ** 0.5 + 2.0 / size
        rank = min(size, math.ceil(target * size))
        threshold = torch.kthvalue(sample, size - rank + 1).values
        candidates = torch.nonzero(magnitudes >= threshold).view(-1)
        if candidates.numel() >= k:
            chosen = torch.topk(magnitudes[candidates], k, sorted=False).indices
            return torch.sort(candidates[chosen]).values
    return torch.sort(torch.topk(magnitudes, k, sorted=False).indices).values


# ----------------------------------------------------------------------------------------------------------------
# Top-k messages of `[n, B]` rows
# ----------------------------------------------------------------------------------------------------------------


def _bits_to_bytes(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8, 8 per byte, little-endian (zero-padded to whole bytes)."""
    mask = torch.nn.functional.pad(mask.to(torch.uint8), (0, -mask.numel() % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8) << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _bytes_to_bits(payload: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    return ((payload.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


@dataclass(frozen=True)
class TopKMessages:
    """Top-k encode / decode of rows for one [`CodecSpec`] of density below 1 (see the module docstring)."""

    spec: CodecSpec

    def _pack_values(self, codes: torch.Tensor, absmax: torch.Tensor, k: int) -> torch.Tensor:
        """The bytes of `k` kept values: block absmax, then exactly `k` codes (4 bits: two per byte; 2 bits: a bitmap
        of the non-zero codes and their signs)."""
        flat = codes.reshape(-1)
        bits = self.spec.bits
        if bits == 2:
            nonzero = flat[:k] != 0
            parts = [_bits_to_bytes(nonzero), _bits_to_bytes(flat[:k][nonzero] < 0)]
        elif bits == 4:
            parts = [flat[: (k + 1) // 2]]
        else:
            parts = [flat[:k].contiguous().view(torch.uint8)]
        return torch.cat([absmax.contiguous().view(torch.uint8), *parts])

    def _unpack_values(self, raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of [`_pack_values`]: `(codes [blocks, ...], absmax [blocks])`, the codes padded with zeros."""
        block, bits = self.spec.block_size, self.spec.bits
        nblocks = num_blocks(k, block)
        absmax = view_as(raw[: 4 * nblocks], torch.float32)
        body = raw[4 * nblocks :]
        shape, dtype = code_shape(nblocks, block, bits)
        if bits == 4:
            codes = torch.full(shape, 8 | 8 << 4, dtype=dtype, device=raw.device)
            codes.view(-1)[: (k + 1) // 2] = body[: (k + 1) // 2]
            if k % 2:  # the last byte's high nibble is padding: code 0
                codes.view(-1)[k // 2] = (codes.view(-1)[k // 2] & 15) | (8 << 4)
            return codes, absmax
        codes = torch.zeros(shape, dtype=dtype, device=raw.device)
        if bits == 2:
            nonzero = _bytes_to_bits(body[: (k + 7) // 8], k)
            count = int(nonzero.sum())
            negative = _bytes_to_bits(body[(k + 7) // 8 : (k + 7) // 8 + (count + 7) // 8], count)
            codes.view(-1)[:k][nonzero] = torch.where(negative, -1, 1).to(dtype)
        else:
            codes.view(-1)[:k] = view_as(body[: k * codes.element_size()], dtype)
        return codes, absmax

    def encode(self, kernels, grad, residual, k: int):
        """
        Compress `[n, B]` rows (`grad + residual`) keeping `k` entries. Returns `(message, decoded, new_residual)`:
        `decoded` the `[n, B]` fp32 values the receivers decode, `new_residual` in `residual`'s dtype (`None` without
        a residual).
        """
        acc = grad.float() if residual is None else grad.float() + residual.float()
        flat = acc.reshape(-1)
        positions = topk_positions(flat, k)
        kept = flat[positions]
        block = self.spec.block_size
        if self.spec.bits == 32:
            value_bytes, decoded_kept = kept.contiguous().view(torch.uint8), kept
        else:
            blocks = torch.nn.functional.pad(kept, (0, num_blocks(k, block) * block - k)).view(-1, block)
            codes, absmax, _ = kernels.encode(blocks, None, self.spec.bits)
            value_bytes = self._pack_values(codes, absmax, k)
            decoded_kept = kernels.decode([codes], [absmax], self.spec.bits, 1).view(-1)[:k]
        scheme, index = encode_indices(positions, flat.numel())
        header = torch.tensor([k, int(scheme), index.numel(), value_bytes.numel()], dtype=torch.int32)
        parts = [header.view(torch.uint8).to(flat.device), value_bytes, index]
        used = sum(p.numel() for p in parts)
        parts.append(torch.zeros(padded_nbytes(used) - used, dtype=torch.uint8, device=flat.device))
        decoded = torch.zeros_like(flat).index_put_((positions,), decoded_kept).view_as(acc)
        new_residual = None
        if residual is not None:
            new_residual = (acc - decoded).to(residual.dtype)
        return torch.cat(parts), decoded, new_residual

    def read_nbytes(self, buffer: torch.Tensor) -> int:
        """Bytes of the message at the start of `buffer` (from its header)."""
        _, _, index_nbytes, value_nbytes = view_as(buffer[:HEADER_NBYTES], torch.int32).tolist()
        return padded_nbytes(HEADER_NBYTES + value_nbytes + index_nbytes)

    def read(self, kernels, message: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions, decoded kept values fp32)` of a message of a row of `numel` entries."""
        k, scheme, index_nbytes, value_nbytes = view_as(message[:HEADER_NBYTES], torch.int32).tolist()
        start = HEADER_NBYTES
        raw = message[start : start + value_nbytes]
        if self.spec.bits == 32:
            decoded = view_as(raw, torch.float32)
        else:
            codes, absmax = self._unpack_values(raw, k)
            decoded = kernels.decode([codes], [absmax], self.spec.bits, 1).view(-1)[:k]
        start += value_nbytes
        positions = decode_indices(scheme, message[start : start + index_nbytes], numel)
        if positions.numel() != k:
            raise ValueError(f"corrupt message: {positions.numel()} positions for {k} values.")
        return positions, decoded

    def decode(self, kernels, messages, shape, divide: float) -> torch.Tensor:
        """The fp32 `[n, B]` sum of the messages' decoded rows (in order), divided by `divide`."""
        total = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=messages[0].device)
        for message in messages:
            positions, decoded = self.read(kernels, message, total.numel())
            total.index_add_(0, positions, decoded)
        total = total.view(shape)
        if divide != 1:
            total /= divide
        return total


# ----------------------------------------------------------------------------------------------------------------
# The code
# ----------------------------------------------------------------------------------------------------------------


@register
class TopKCode(Code):
    """Top-k of a row with error feedback (see the module docstring); chosen for a spec of density below 1."""

    name = "topk"
    every_entry = False

    def __init__(self, spec: CodecSpec):
        super().__init__(spec)
        self.messages = TopKMessages(spec)

    @classmethod
    def accepts(cls, spec: CodecSpec) -> bool:
        return spec.code is None and spec.density < 1.0

    def describe(self) -> str:
        return f"density {self.spec.density:g}, bits {self.spec.bits}"

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        return self.messages.read_nbytes(buffer)

    def num_values(self, length: int, numel: int) -> int:
        """`ceil(density * numel)`: the real entries only, not the padding."""
        return num_kept(numel, self.spec.density)

    def encode(self, kernels, rows, residual, k: int | None = None, message=None, in_place: bool = False):
        k = rows.numel() if k is None else k
        encoded, _, new_residual = self.messages.encode(kernels, rows, residual, k)
        if in_place and new_residual is not None:  # the top-k output is freed at once: only short-lived allocations
            residual.copy_(new_residual)
            new_residual = residual
        return encoded, new_residual

    def decode(self, kernels, messages, nblocks: int, divide: float = 1, out=None, max_blocks: int | None = None):
        values = self.messages.decode(kernels, messages, (nblocks, self.spec.block_size), divide)
        return self.finish(values, out)


__all__ = [
    "HEADER_NBYTES",
    "IndexScheme",
    "TopKCode",
    "TopKMessages",
    "decode_indices",
    "decode_positions",
    "encode_indices",
    "encode_positions",
    "topk_positions",
    "view_as",
]
