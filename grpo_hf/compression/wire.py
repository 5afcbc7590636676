"""The one message format of grpo_hf: a 12-byte header, fp32 scales, values, indices; writers and readers per row.

| part    | bytes                                                                                                   |
|---------|---------------------------------------------------------------------------------------------------------|
| header  | 12: `u8 index_scheme, u8 bits, u8 flags (bit 0: nonfinite), u8 log2(block_size), i32 k, i32 index_bytes` |
| scales  | `4 * ceil(k / block_size)` below 32 bits (fp32, one per block of values), 0 at 32 bits                  |
| values  | 32 bit: `4k` (fp32); 16 bit: `2k` (fp16); 8 bit: `k` (code + 128); 4 bit: `ceil(k / 2)` (code + 8, low  |
|         | nibble first); 2 bit: `ceil(k / 8)` bitmap of the non-zero codes + `ceil(nnz / 8)` sign bits (set =    |
|         | negative), little-endian bit order: about 1.15 bits per value at 15% non-zero codes instead of 2       |
| indices | `index_bytes` ([`~grpo_hf.compression.indices.IndexScheme`]); 0 when every entry is sent                |

A message carries one *row*: a tensor's kept values, or the values of several tensors sent whole (their concatenation,
each padded to whole blocks, so that a block never mixes two tensors). Both exchange modes of the DDP hook send these
messages, concatenated in an order every rank knows; headers are read on the host (one sync per buffer).
"""

import struct

import numpy as np
import torch

from . import _cpu
from .quantize import dequantize_blocks, to_blocks
from .spec import num_blocks, scale_bytes, value_bytes


HEADER_NBYTES = 12
HEADER_FORMAT = "<BBBBii"
FLAG_NONFINITE = 1


def pack_header(scheme: int, bits: int, block_size: int, num_values: int, index_nbytes: int, flags: int = 0) -> bytes:
    """The 12 header bytes of one message."""
    return struct.pack(HEADER_FORMAT, scheme, bits, flags, block_size.bit_length() - 1, num_values, index_nbytes)


def unpack_header(host: np.ndarray | bytes, offset: int = 0) -> tuple[int, int, int, int, int, int]:
    """`(scheme, bits, flags, block_size, num_values, index_nbytes)` of the header at `offset`."""
    scheme, bits, flags, log2_block, num_values, index_nbytes = struct.unpack_from(HEADER_FORMAT, host, offset)
    return scheme, bits, flags, 1 << log2_block, num_values, index_nbytes


def ternary_nbytes(decoded: torch.Tensor) -> torch.Tensor:
    """
    Wire bytes of the 2-bit values of each row of `[T, k]` decoded values: `ceil(k / 8)` bitmap bytes plus
    `ceil(nnz / 8)` sign bytes. Returns `T` byte counts (`int64`).
    """
    decoded = decoded.reshape(-1, decoded.shape[-1])
    nonzero = (decoded != 0).sum(dim=1).to(torch.int64)
    return (decoded.shape[1] + 7) // 8 + (nonzero + 7) // 8


def ternary_to_wire(decoded: torch.Tensor) -> list[torch.Tensor]:
    """
    2-bit (ternary) values -> wire bytes, per row of their decoded values (`[T, k]` fp32): the bitmap of the non-zero
    codes, then their signs (bit set = negative). A code is non-zero exactly when its decoded value is (`code * scale`
    with `scale > 0`), and has its sign. numpy on CPU, torch elsewhere; both give the same bytes.
    """
    decoded = decoded.reshape(-1, decoded.shape[-1])
    if decoded.device.type == "cpu":
        return [torch.from_numpy(row) for row in _cpu.ternary_to_wire(decoded)]
    return _ternary_to_wire_torch(decoded)


def _ternary_to_wire_torch(decoded: torch.Tensor) -> list[torch.Tensor]:
    """[`ternary_to_wire`] in torch (every device)."""
    nonzero = decoded != 0
    bitmap = _pack_bits(nonzero)
    return [
        torch.cat([bits, _pack_bits((row[mask] < 0).view(1, -1))[0]])
        for bits, row, mask in zip(bitmap, decoded, nonzero)
    ]


def ternary_from_wire(wire: torch.Tensor, scales: torch.Tensor, k: int, block_size: int) -> tuple[torch.Tensor, int]:
    """
    Inverse of [`ternary_to_wire`] for one row read from the start of `wire`: its `k` decoded fp32 values (+-the
    block's scale where a code is non-zero) and the number of wire bytes consumed.
    """
    if wire.device.type == "cpu":
        decoded, used = _cpu.ternary_from_wire(wire.numpy(), scales.numpy(), k, block_size)
        return torch.from_numpy(decoded), used
    return _ternary_from_wire_torch(wire, scales, k, block_size)


def _ternary_from_wire_torch(wire: torch.Tensor, scales: torch.Tensor, k: int, block_size: int):
    """[`ternary_from_wire`] in torch (every device)."""
    bitmap_bytes = (k + 7) // 8
    nonzero = _unpack_bits(wire[:bitmap_bytes])[:k]
    count = int(nonzero.sum())
    used = bitmap_bytes + (count + 7) // 8
    negative = _unpack_bits(wire[bitmap_bytes:used])[:count]
    codes = torch.zeros(num_blocks(k, block_size) * block_size, dtype=torch.float32, device=wire.device)
    codes[:k][nonzero] = torch.where(negative, -1.0, 1.0)
    return (codes.view(-1, block_size) * scales.view(-1, 1)).view(-1)[:k], used


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """`[T, n]` bool -> `[T, ceil(n / 8)]` uint8, little-endian within a byte."""
    rows, n = mask.shape
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-n) % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits.view(rows, -1, 8) << shifts).sum(dim=2, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(payload: torch.Tensor) -> torch.Tensor:
    """Inverse of [`_pack_bits`] for one row: `[bytes]` uint8 -> `[8 * bytes]` bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    return ((payload.view(-1, 1) >> shifts) & 1).view(-1).bool()


def message_nbytes(bits: int, block_size: int, num_values: int, value_nbytes: int | None, index_nbytes: int) -> int:
    """Bytes of one message; `value_nbytes` is needed at 2 bits only (data-dependent size)."""
    values = value_bytes(num_values, bits) if bits != 2 else value_nbytes
    return HEADER_NBYTES + scale_bytes(num_values, bits, block_size) + values + index_nbytes


def write_rows(
    bits: int,
    block_size: int,
    codes: torch.Tensor | None,
    scales: torch.Tensor | None,
    decoded: torch.Tensor,
    schemes: list[int],
    indices: list[torch.Tensor],
    flags: int = 0,
) -> list[torch.Tensor]:
    """
    The messages of `T` rows compressed with one spec, as `uint8` pieces to concatenate in order (header, scales and
    values of each row, then its indices).

    Args:
        bits (`int`), block_size (`int`): the spec.
        codes (`torch.Tensor` or `None`): `[T, value bytes]` payload (unused at 2 bits, where the bitmap and signs are
            written from `decoded`).
        scales (`torch.Tensor` or `None`): `[T, blocks]` fp32 scales.
        decoded (`torch.Tensor`): `[T, k]` decoded values.
        schemes (`list[int]`), indices (`list[torch.Tensor]`): the index scheme and payload of each row.
        flags (`int`, *optional*): header flags.
    """
    rows, k = decoded.shape
    device = decoded.device
    header = np.frombuffer(
        b"".join(
            pack_header(scheme, bits, block_size, k, index.numel(), flags) for scheme, index in zip(schemes, indices)
        ),
        dtype=np.uint8,
    )
    parts = [torch.from_numpy(header.reshape(rows, HEADER_NBYTES).copy()).to(device)]
    if scales is not None:
        parts.append(scales.reshape(rows, -1).contiguous().view(torch.uint8))
    if bits == 2:
        values = ternary_to_wire(decoded)
    else:
        parts.append(codes.reshape(rows, -1).contiguous().view(torch.uint8))
        values = [None] * rows
    fixed = torch.cat(parts, dim=1)
    return [
        piece
        for row in range(rows)
        for piece in (fixed[row], values[row], indices[row])
        if piece is not None and piece.numel()
    ]


def read_rows(
    buffer: torch.Tensor, host: np.ndarray, offset: int, rows: int, num_values: int, bits: int, block_size: int
):
    """
    Read `rows` consecutive messages of `num_values` values at `bits` from `buffer` (`host` is its numpy copy, for the
    headers) starting at `offset`.

    Returns `(decoded [T, k], schemes, index payloads, offset after the last message)`; raises `ValueError` on a
    header that does not match what every rank knows of the layout (a corrupt or misordered message).
    """
    nscale = scale_bytes(num_values, bits, block_size)
    decoded, schemes, payloads = [], [], []
    for _ in range(rows):
        scheme, got_bits, _flags, got_block, got_k, index_nbytes = unpack_header(host, offset)
        if (got_bits, got_block, got_k) != (bits, block_size, num_values):
            raise ValueError(
                f"corrupt message: {got_bits} bits, block {got_block}, {got_k} values; expected {bits}, {block_size}, "
                f"{num_values}. Every rank must run the same model, settings and grpo_hf version."
            )
        start = offset + HEADER_NBYTES
        scales = None if bits == 32 else indices_view(buffer, start, nscale).view(torch.float32)
        start += nscale
        if bits == 2:
            values, used = ternary_from_wire(buffer[start:], scales, num_values, block_size)
        else:
            used = value_bytes(num_values, bits)
            raw = indices_view(buffer, start, used)
            if bits == 32:
                values = raw.view(torch.float32)
            else:
                blocks = num_blocks(num_values, block_size)
                if bits == 16:
                    raw = to_blocks(raw.view(torch.float16).view(1, -1), block_size)
                else:
                    raw = _pad_codes(raw, bits, blocks * block_size)
                values = dequantize_blocks(raw, scales.view(1, -1), bits, block_size).reshape(-1)[:num_values]
        start += used
        decoded.append(values)
        schemes.append(scheme)
        payloads.append(buffer[start : start + index_nbytes])
        offset = start + index_nbytes
    return torch.stack(decoded) if decoded else None, schemes, payloads, offset


def indices_view(buffer: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """`buffer[start:start + size]`, copied when it is not 4-byte aligned (so that it can be viewed as fp32)."""
    piece = buffer[start : start + size]
    return piece.clone() if piece.storage_offset() % 4 else piece


def _pad_codes(raw: torch.Tensor, bits: int, padded: int) -> torch.Tensor:
    """Packed codes of `k` values padded (with code 0) to `padded` values, shaped `[1, blocks, bytes per block]`."""
    per_byte = 8 // bits
    need = padded // per_byte
    if raw.numel() < need:
        bias = (1 << (bits - 1)) * sum(1 << (bits * i) for i in range(per_byte))
        raw = torch.nn.functional.pad(raw, (0, need - raw.numel()), value=bias)
    return raw.view(1, -1)


__all__ = [
    "FLAG_NONFINITE",
    "HEADER_FORMAT",
    "HEADER_NBYTES",
    "message_nbytes",
    "pack_header",
    "read_rows",
    "ternary_from_wire",
    "ternary_nbytes",
    "ternary_to_wire",
    "unpack_header",
    "write_rows",
]
