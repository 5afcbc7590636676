"""The gradient codec: top-k, block quantization and index coding of many rows at once, and its per-tensor facade.

[`compress_rows`] is the one implementation: it compresses the `T` rows of a `[T, n]` fp32 matrix with one
[`~grpo_hf.compression.spec.CodecSpec`] in a few vectorized calls (a model repeats its layers, so the tensors of a DDP
bucket come in few sizes; tensors sent whole are concatenated into one row). The per-tensor functions below
([`compress`], [`decompress`], [`compress_with_feedback`], [`serialize`], [`deserialize`]) treat a tensor as one row.

## Algorithm (per row)

1. Keep the `k = ceil(density * n)` entries of largest magnitude ([`~grpo_hf.compression.topk.topk_positions`]), or
   every entry at density 1, or the caller's positions.
2. Quantize the kept values in blocks ([`~grpo_hf.compression.quantize`]); decoding is one fp32 multiply.
3. Code the positions compactly ([`~grpo_hf.compression.indices`]) and lay the message out
   ([`~grpo_hf.compression.wire`]).

With error feedback (`acc = grad + residual`, `residual = acc - decoded`) the identity `decoded + residual == acc`
holds bit for bit. A tensor holding a NaN or an Inf is sent raw (dense, 32 bit) with the `nonfinite` flag and its
residual is left unchanged.

Example:

```python
>>> import torch
>>> from grpo_hf.compression.codec import CodecSpec, compress_with_feedback
>>> grad = torch.randn(1000)
>>> residual = torch.zeros(1000)
>>> ct, decoded, new_residual = compress_with_feedback(grad, residual, CodecSpec(density=0.1, bits=4))
>>> torch.equal(decoded + new_residual, grad + residual)
True
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import _cpu
from .indices import IndexScheme, decode_indices, decode_positions, encode_positions, view_as
from .quantize import dequantize, dequantize_blocks, pack_fields, quantize_blocks, to_blocks
from .spec import CodecSpec, dense_bytes, num_kept, scale_bytes, value_bytes
from .topk import topk_positions
from .wire import (
    FLAG_NONFINITE,
    HEADER_NBYTES,
    message_nbytes,
    pack_header,
    read_rows,
    ternary_from_wire,
    ternary_nbytes,
    ternary_to_wire,
    unpack_header,
    write_rows,
)


_INT32_MAX = 2**31 - 1


@dataclass
class RowBatch:
    """`T` rows of `numel` entries compressed with one spec: what every rank needs to send and to decode them."""

    spec: CodecSpec
    numel: int  # entries per row
    num_values: int  # k kept per row
    positions: torch.Tensor | None  # [T, k] sorted int64 positions; None when every entry is kept
    decoded: torch.Tensor  # [T, k] fp32 decoded kept values
    codes: torch.Tensor | None  # [T, value bytes] payload (None at 2 bits: the wire form comes from `decoded`)
    scales: torch.Tensor | None  # [T, blocks] fp32
    schemes: list[int]  # index scheme per row
    indices: list[torch.Tensor]  # index payload per row (empty when dense)

    @property
    def rows(self) -> int:
        return self.decoded.shape[0]

    def nbytes(self) -> list[int]:
        """Wire bytes of each row's message."""
        spec, k = self.spec, self.num_values
        values = ternary_nbytes(self.decoded).tolist() if spec.bits == 2 else [None] * self.rows
        return [message_nbytes(spec.bits, spec.block_size, k, v, i.numel()) for v, i in zip(values, self.indices)]

    def messages(self, flags: int = 0) -> list[torch.Tensor]:
        """The rows' messages as `uint8` pieces, in order."""
        spec = self.spec
        return write_rows(
            spec.bits, spec.block_size, self.codes, self.scales, self.decoded, self.schemes, self.indices, flags
        )

    def dense(self) -> torch.Tensor:
        """`[T, numel]` fp32: the decoded values at their positions, zeros elsewhere."""
        return scatter_rows(self.positions, self.decoded, self.numel)


def scatter_rows(positions: torch.Tensor | None, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The `[T, numel]` fp32 matrix holding `values` at `positions` in each row (all of them when `None`)."""
    if positions is None:
        return values
    dense = torch.zeros(values.shape[0], numel, dtype=torch.float32, device=values.device)
    return dense.scatter_(1, positions, values)


def compress_rows(
    values: torch.Tensor, spec: CodecSpec, positions: torch.Tensor | None = None, num_values: int | None = None
) -> RowBatch:
    """
    Compress each row of a finite `[T, n]` fp32 matrix with `spec`: the top `num_values` entries of each row (by
    default `num_kept(n, spec.density)`), or the caller's sorted `positions` `[T, k]` (validated).
    """
    rows, numel = values.shape
    if positions is None:
        k = num_kept(numel, spec.density) if num_values is None else num_values
        positions = topk_positions(values, k) if k < numel else None
    else:
        positions = positions.to(device=values.device, dtype=torch.int64).reshape(rows, -1)
        k = positions.shape[1]
    if positions is None:
        kept, schemes = values, [int(IndexScheme.DENSE)] * rows
        indices = [values.new_zeros(0, dtype=torch.uint8)] * rows
    else:
        schemes, indices = encode_positions(positions, numel)
        kept = torch.gather(values, 1, positions)
    codes, scales, decoded = quantize_blocks(to_blocks(kept, spec.block_size), spec.bits, with_codes=spec.bits != 2)
    decoded = decoded.reshape(rows, -1)[:, :k]
    if codes is not None:
        per_row = k if spec.bits >= 16 else value_bytes(k, spec.bits)
        codes = codes.reshape(rows, -1)[:, :per_row].contiguous().view(torch.uint8).reshape(rows, -1)
    if scales is not None:
        scales = scales.reshape(rows, -1)
    return RowBatch(spec, numel, k, positions, decoded, codes, scales, schemes, indices)


def read_batch(
    buffer: torch.Tensor, host: np.ndarray, offset: int, rows: int, numel: int, spec: CodecSpec, num_values: int
):
    """
    Read the `rows` messages of `numel`-entry rows with `num_values` values each that a [`RowBatch`] with `spec` wrote,
    from `offset` of a `uint8` buffer (`host`: its numpy copy). Returns `(positions [T, k] or None, decoded [T, k],
    offset after them)`.
    """
    k = num_values
    decoded, schemes, payloads, offset = read_rows(buffer, host, offset, rows, k, spec.bits, spec.block_size)
    positions = decode_positions(schemes, payloads, numel, k) if k < numel else None
    return positions, decoded, offset


# ----------------------------------------------------------------------------------------------------------------
# Rows of which every entry is sent (density 1), chunk by chunk
# ----------------------------------------------------------------------------------------------------------------


def chunk_slices(length: int, device: torch.device) -> list[slice]:
    """
    The pieces a long row is processed in: `_cpu.CHUNK` entries on CPU, where temporaries of that size stay in cache
    and are recycled by the allocator (full-size temporaries cost more in page faults than the arithmetic), the whole
    row elsewhere.
    """
    step = _cpu.CHUNK if device.type == "cpu" else max(1, length)
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


def encode_whole(
    acc: torch.Tensor,
    spec: CodecSpec,
    own: torch.Tensor,
    scale_of: Callable[[slice], torch.Tensor | None] | None = None,
    flags: int = 0,
    clip: float | None = None,
) -> list[torch.Tensor]:
    """
    Compress a finite `[length]` fp32 row of which every entry is sent (`length` a multiple of the block size), with
    error feedback, chunk by chunk: the values are divided by `scale_of(piece)` (per entry; `None` for 1) before they
    are quantized (and clamped to `[-clip, clip]` when `clip` is given), `own` receives the decoded (divided) values,
    and `acc` becomes what was not sent, `acc - own * scale`. Returns the message, as [`compress_rows`] would write it
    for this row.
    """
    block, bits = spec.block_size, spec.bits
    scales, codes = [], []
    for piece in chunk_slices(acc.numel(), acc.device):
        scale = scale_of(piece) if scale_of is not None else None
        values = acc[piece] if scale is None else acc[piece] / scale
        if clip is not None:  # at most `clip` of its scale per entry and step; the rest waits in the residual
            values = values.clamp(-clip, clip)
        code, block_scales, decoded = quantize_blocks(values.view(-1, block), bits, with_codes=bits != 2)
        decoded = decoded.view(-1)
        own[piece] = decoded
        acc[piece] -= decoded if scale is None else decoded * scale
        scales.append(block_scales)
        codes.append(code)
    header = torch.frombuffer(bytearray(pack_header(int(IndexScheme.DENSE), bits, block, acc.numel(), 0, flags)),
                              dtype=torch.uint8).to(acc.device)  # fmt: skip
    if not scales:  # an empty row (a rank that owns none of a segment's blocks): the header alone
        return [header]
    pieces = [header, torch.cat(scales).view(torch.uint8)]
    if bits == 2:
        pieces += ternary_to_wire(own.view(1, -1))
    else:
        pieces.append(torch.cat([c.reshape(-1) for c in codes]).view(torch.uint8))
    return pieces


def decode_whole_into(
    buffer: torch.Tensor, host: np.ndarray, offset: int, total: torch.Tensor, spec: CodecSpec, add: bool = True
) -> int:
    """
    Decode the message [`encode_whole`] wrote for a row of `total.numel()` entries, from `offset` of a `uint8` buffer
    (`host`: its numpy copy), into `total` (`+=` when `add`, else `=`), chunk by chunk. Returns the offset after it.
    """
    length, block, bits = total.numel(), spec.block_size, spec.bits
    scheme, got_bits, _flags, got_block, got_k, _ = unpack_header(host, offset)
    if (scheme, got_bits, got_block, got_k) != (IndexScheme.DENSE, bits, block, length):
        raise ValueError(
            f"corrupt message: scheme {scheme}, {got_bits} bits, block {got_block}, {got_k} values; expected a dense "
            f"row of {length} values at {bits} bits, block {block}. Every rank must run the same model, settings and "
            "grpo_hf version."
        )
    start = offset + HEADER_NBYTES
    nblocks = length // block
    scales = view_as(buffer[start : start + 4 * nblocks], torch.float32)
    start += 4 * nblocks
    if bits == 2 and total.device.type == "cpu":
        return start + _cpu.ternary_add_into(host[start:], scales.numpy(), total.numpy(), block, add)
    if bits == 2:
        decoded, used = ternary_from_wire(buffer[start:], scales, length, block)
        total.add_(decoded) if add else total.copy_(decoded)
        return start + used
    per_block = block * bits // 8
    for piece in chunk_slices(length, total.device):
        first, last = piece.start // block, piece.stop // block
        raw = buffer[start + first * per_block : start + last * per_block]
        if bits == 16:
            decoded = view_as(raw, torch.float16).view(-1, block).float() * scales[first:last, None]
        elif total.device.type == "cpu":
            codes = host[start + first * per_block : start + last * per_block].reshape(last - first, per_block)
            decoded = torch.from_numpy(_cpu.dequantize_blocks(codes, scales[first:last].numpy(), bits))
        else:
            decoded = dequantize_blocks(raw.view(last - first, per_block), scales[first:last], bits, block)
        decoded = decoded.reshape(-1)
        total[piece].add_(decoded) if add else total[piece].copy_(decoded)
    return start + nblocks * per_block


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """
    Whether every tensor is free of NaN/Inf: the one non-finite check of grpo_hf. One `aminmax` pass per tensor (NaN
    propagates; much faster than `isfinite().all()`) and one device sync in all.
    """
    extremes = [torch.stack(torch.aminmax(t.detach().reshape(-1))).float() for t in tensors if t.numel()]
    return not extremes or bool(torch.isfinite(torch.cat(extremes)).all())


def has_nonfinite(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN or an Inf (see [`all_finite`])."""
    return not all_finite([t])


# ----------------------------------------------------------------------------------------------------------------
# Per-tensor facade
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class CompressedTensor:
    """
    One compressed flat tensor, as produced by [`compress`] and read by [`decompress`] / [`serialize`].

    Args:
        numel (`int`): entries of the dense tensor.
        spec (`CodecSpec`): the spec it was compressed with (a non-finite fallback carries `CodecSpec(1.0, 32)`).
        indices (`torch.Tensor` or `None`): encoded kept positions (`uint8`, see [`IndexScheme`]); `None` when dense.
        values (`torch.Tensor`): `uint8` codes at 8, 4 and 2 bits (`8 // bits` per byte, low bits first), `float16`
            at 16 bits, `float32` at 32 bits.
        scales (`torch.Tensor` or `None`): `float32` per-block scales below 32 bits.
        num_values (`int`, *optional*): kept values `k`; inferred from `values` when not given (required below 8 bits).
        index_scheme (`IndexScheme`, *optional*, defaults to `IndexScheme.DENSE`): how `indices` is encoded.
        nonfinite (`bool`, *optional*, defaults to `False`): the input held NaN/Inf and was sent dense and raw.
    """

    numel: int
    spec: CodecSpec
    indices: torch.Tensor | None
    values: torch.Tensor
    scales: torch.Tensor | None
    num_values: int | None = None
    index_scheme: IndexScheme = IndexScheme.DENSE
    nonfinite: bool = False

    def __post_init__(self):
        if self.num_values is None:
            if self.indices is None:
                self.num_values = self.numel
            elif self.spec.bits < 8:
                raise ValueError(f"`num_values` is required for {self.spec.bits}-bit values (codes share bytes).")
            else:
                self.num_values = self.values.numel()
        if self.indices is None:
            self.index_scheme = IndexScheme.DENSE

    def decoded_values(self) -> torch.Tensor:
        """The `k` decoded kept values (fp32)."""
        return dequantize(self.values, self.scales, self.spec.bits, self.num_values, self.spec.block_size)

    def nbytes(self) -> int:
        """Exact number of bytes [`serialize`] produces (header + scales + values + indices)."""
        values = int(ternary_nbytes(self.decoded_values().view(1, -1))[0]) if self.spec.bits == 2 else None
        index_nbytes = 0 if self.indices is None else self.indices.numel()
        return message_nbytes(self.spec.bits, self.spec.block_size, self.num_values, values, index_nbytes)

    def positions(self) -> torch.Tensor | None:
        """The kept positions as sorted `int64`, or `None` when dense."""
        return None if self.indices is None else decode_indices(self.index_scheme, self.indices, self.numel)


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(torch.float32)


def _raw_dense(flat: torch.Tensor) -> CompressedTensor:
    return CompressedTensor(flat.numel(), CodecSpec(1.0, 32), None, flat.clone(), None, nonfinite=True)


def _ternary_codes(decoded: torch.Tensor) -> torch.Tensor:
    """The in-memory form of 2-bit values: biased codes (1, 2, 3 for -1, 0, +1), four per byte, low bits first."""
    biased = (torch.sign(decoded.reshape(-1)) + 2).to(torch.uint8)
    biased = torch.nn.functional.pad(biased, (0, (-biased.numel()) % 4), value=2)  # padding decodes to code 0
    return pack_fields(biased.view(-1, 4), 2)


def _as_tensor(batch: RowBatch) -> CompressedTensor:
    """Row 0 of a batch as a [`CompressedTensor`]."""
    spec = batch.spec
    if spec.bits == 2:
        values = _ternary_codes(batch.decoded[0])
    elif spec.bits in (16, 32):
        values = view_as(batch.codes[0], torch.float16 if spec.bits == 16 else torch.float32).clone()
    else:
        values = batch.codes[0].clone()
    return CompressedTensor(
        numel=batch.numel,
        spec=spec,
        indices=None if batch.positions is None else batch.indices[0],
        values=values,
        scales=None if batch.scales is None else batch.scales[0],
        num_values=batch.num_values,
        index_scheme=IndexScheme(batch.schemes[0]),
    )


def compress(tensor: torch.Tensor, spec: CodecSpec, indices: torch.Tensor | None = None) -> CompressedTensor:
    """
    Compress a tensor (flattened, computed in fp32 on its device): top-k by magnitude, then quantize. A tensor with a
    NaN or an Inf is returned dense and raw (32 bit) with `nonfinite=True`.

    Args:
        tensor (`torch.Tensor`): any float dtype and shape.
        spec (`CodecSpec`): density, bits and block size.
        indices (`torch.Tensor`, *optional*): sorted, unique positions to send instead of the top-k (`spec.density`
            is then ignored).
    """
    return _compress(_flat_fp32(tensor), spec, indices)[0]


def _compress(flat: torch.Tensor, spec: CodecSpec, indices: torch.Tensor | None):
    if has_nonfinite(flat):
        return _raw_dense(flat), None
    positions = None if indices is None else indices.reshape(1, -1)
    batch = compress_rows(flat.view(1, -1), spec, positions)
    return _as_tensor(batch), batch


def decompress(ct: CompressedTensor, out: torch.Tensor | None = None, *, accumulate: bool = False) -> torch.Tensor:
    """
    Decode to a dense flat fp32 tensor (zeros where nothing was kept).

    Args:
        ct (`CompressedTensor`): the compressed tensor.
        out (`torch.Tensor`, *optional*): contiguous tensor of `ct.numel` entries to write into (returned flat).
        accumulate (`bool`, *optional*, defaults to `False`): add into `out` instead of overwriting it.
    """
    decoded = ct.decoded_values()
    positions = ct.positions()
    dense = scatter_rows(None if positions is None else positions.view(1, -1), decoded.view(1, -1), ct.numel)[0]
    if out is None:
        return dense
    if out.numel() != ct.numel or not out.is_contiguous():
        raise ValueError(f"`out` must be a contiguous tensor of {ct.numel} entries, got shape {tuple(out.shape)}.")
    flat = out.view(-1)
    return flat.add_(dense) if accumulate else flat.copy_(dense)


def compress_with_feedback(
    grad: torch.Tensor, residual: torch.Tensor | None, spec: CodecSpec, indices: torch.Tensor | None = None
) -> tuple[CompressedTensor, torch.Tensor, torch.Tensor]:
    """
    Error-feedback compression: compress `grad + residual` and keep what was not sent, so that
    `decoded + new_residual == grad + residual` holds exactly (bit for bit, fp32).

    If `grad + residual` holds a NaN or an Inf, the raw `grad` is returned dense (32 bit, `ct.nonfinite = True`,
    `decoded` = `grad` in fp32) and the **old residual object** is returned unchanged, so that an overflow step never
    poisons the residual.

    Returns:
        `tuple[CompressedTensor, torch.Tensor, torch.Tensor]`: `(compressed, decoded, new_residual)`, the last two
        dense flat fp32 tensors on `grad.device`.
    """
    flat_grad = _flat_fp32(grad)
    if residual is None:
        residual = torch.zeros_like(flat_grad)
    if residual.numel() != flat_grad.numel():
        raise ValueError(
            f"`residual` has {residual.numel()} entries but `grad` has {flat_grad.numel()}; key residuals by "
            "parameter name and reset them when a parameter changes shape."
        )
    acc = flat_grad + residual.reshape(-1).to(torch.float32)
    if has_nonfinite(acc):
        return _raw_dense(flat_grad), flat_grad.clone(), residual
    ct, batch = _compress(acc, spec, indices)
    decoded = batch.dense()[0].clone()
    return ct, decoded, acc - decoded


def serialize(ct: CompressedTensor) -> torch.Tensor:
    """Lay out a [`CompressedTensor`] as one `uint8` tensor on its device; `serialize(ct).numel() == ct.nbytes()`."""
    if ct.numel > _INT32_MAX:
        raise ValueError(f"Tensors above {_INT32_MAX} entries cannot be serialized; split them first.")
    spec = ct.spec
    decoded = ct.decoded_values().view(1, -1)
    codes = None if spec.bits == 2 else ct.values.contiguous().view(torch.uint8).view(1, -1)
    scales = None if ct.scales is None else ct.scales.view(1, -1)
    index = ct.indices if ct.indices is not None else ct.values.new_zeros(0, dtype=torch.uint8)
    flags = FLAG_NONFINITE if ct.nonfinite else 0
    pieces = write_rows(spec.bits, spec.block_size, codes, scales, decoded, [int(ct.index_scheme)], [index], flags)
    return torch.cat(pieces)


def deserialize(buffer: torch.Tensor, numel: int) -> CompressedTensor:
    """
    Read a [`CompressedTensor`] from the start of a `uint8` buffer written by [`serialize`] (`ct.nbytes()` is the
    number of bytes consumed, so concatenated messages are read one after another).

    Args:
        buffer (`torch.Tensor`): `uint8` tensor starting with the header.
        numel (`int`): entries of the dense tensor (known to the receiver from the parameter layout).
    """
    buffer = buffer.reshape(-1)
    scheme, bits, flags, block_size, k, index_nbytes = unpack_header(buffer[:HEADER_NBYTES].cpu().numpy())
    start = HEADER_NBYTES + scale_bytes(k, bits, block_size)
    scales = None if bits == 32 else view_as(buffer[HEADER_NBYTES:start], torch.float32)
    if bits == 2:
        decoded, used = ternary_from_wire(buffer[start:], scales, k, block_size)
        values = _ternary_codes(decoded)
    else:
        used = value_bytes(k, bits)
        values = buffer[start : start + used]
        if bits >= 16:
            values = view_as(values, torch.float16 if bits == 16 else torch.float32)
    start += used
    return CompressedTensor(
        numel=numel,
        spec=CodecSpec(density=k / numel if numel else 1.0, bits=bits, block_size=block_size),
        indices=None if scheme == IndexScheme.DENSE else buffer[start : start + index_nbytes],
        values=values,
        scales=scales,
        num_values=k,
        index_scheme=IndexScheme(scheme),
        nonfinite=bool(flags & FLAG_NONFINITE),
    )


__all__ = [
    "CodecSpec",
    "CompressedTensor",
    "IndexScheme",
    "RowBatch",
    "all_finite",
    "compress",
    "compress_rows",
    "compress_with_feedback",
    "chunk_slices",
    "decode_whole_into",
    "decompress",
    "encode_whole",
    "dense_bytes",
    "deserialize",
    "has_nonfinite",
    "num_kept",
    "read_batch",
    "scatter_rows",
    "serialize",
]
