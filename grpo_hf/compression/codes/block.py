"""The block codes: every entry, 2, 4, 8 or 16 bits, one fp32 absmax per block of `B` entries (density 1): their
arithmetic (the two kernels `codec.py` compiles), their messages and [`BlockCode`], how the transports use them.

A row of gradient entries is viewed as `[n, B]` blocks (`B` = `CodecSpec.block_size`). Two functions do all the
arithmetic, each written once in plain torch and compiled by [`~grpo_hf.compression.codec.Kernels`] (or run eagerly):

1. [`encode_blocks`] (the sender): `acc = grad + residual`; block absmax; codes; the new residual `acc - code * step`
   (bf16). Returns the codes, the raw absmax per block (the step is derived from it on every rank) and the residual.
2. [`decode_blocks`] (every rank): the sum of the `W` ranks' `code * step`, in rank order from the first, divided by
   `divide`, written into the bucket's gradients (their dtype).

Every rank decodes every message, its own included, with the same kernel, so all ranks hold bit-identical averages.

| bits | code per entry                                    | step per block                 | message per block          |
|------|---------------------------------------------------|--------------------------------|----------------------------|
| 8    | `round(x * (1 / step))` in `[-127, 127]`, int8    | `absmax / 127`                 | 4 + 128 bytes              |
| 4    | `round(x * (1 / step))` in `[-7, 7]`, two per byte| `absmax / 7`                   | 4 + 64 bytes               |
| 2    | `sign(x)` where `|x| > absmax / 2`, else 0        | `absmax`                       | 4 + 16 + (non-zero) / 8    |
| 16   | `x / 2**e` in fp16, `e` from `absmax`'s exponent  | `2**e`                         | 4 + 256 bytes              |

A block whose step would lie below [`STEP_FLOOR`] (the smallest normal fp32; at 8 bits an absmax below
`127 * STEP_FLOOR`, about 1.5e-36) is sent as zeros with absmax 0 and keeps its entries in the residual, exactly:
`1 / step` would overflow to inf there and make NaN codes. Error feedback produces such blocks by itself: a block that
had one gradient and then none (the input-embedding row of a token absent from the next batches, an expert that is not
routed) shrinks its residual by up to `2 * 127` per step at 8 bits. Finite input below
[`~grpo_hf.compression.codec.SAFE_MAGNITUDE`] therefore always gives finite codes, absmax and residual.

A message ([`BlockMessages`]) is the fp32 absmax of its blocks followed by the codes (4 bits: low nibble first; 2 bits:
a bitmap of the non-zero codes, then one sign bit per non-zero code, set = negative, little-endian), padded to 16
bytes: `4 n + n B bits / 8` bytes for `n` blocks, fixed by `n` (written in place, no size announced), except at 2 bits,
where a 16-byte header (`int32` size) comes first and the size depends on the data (so the sync sends these ternary
levels in a code of its own, fixed in size: `ternary.py`). Owner reduction encodes a run in one kernel call and cuts
each owner's codes and absmax out of it; the owners' codes are put back in block order and decoded in one call. FSDP2's
rows: `ceil(S / B) (4 + B bits / 8)` bytes per row of `S` entries, unpadded (4, 8 and 16 bits).
"""

import math
from dataclasses import dataclass

import torch

from ..owned import put_owned, take_owned
from ..spec import CodecSpec, num_blocks
from .base import MESSAGE_ALIGN, Code, padded_nbytes, register


STEP_FLOOR = torch.finfo(torch.float32).tiny  # the smallest normal fp32: a block's step is this or more, or 0
_QMAX = {8: 127, 4: 7}
# The kernels' compile options by width: 16 bits rounds to fp16 and back inside the kernel, which inductor must keep.
COMPILE_OPTIONS = {16: {"emulate_precision_casts": True}}


# ----------------------------------------------------------------------------------------------------------------
# The kernels (plain torch; compiled or eager by `codec.Kernels`)
# ----------------------------------------------------------------------------------------------------------------


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact `2.0 ** exponent` in fp32 for int32 exponents in `[-126, 127]` (built from the bit pattern)."""
    return ((exponent + 127) << 23).view(torch.float32)


def _exponent16(absmax: torch.Tensor) -> torch.Tensor:
    """The 16-bit shift `e` of each block: `absmax / 2**e` lies in `[2**14, 2**15)` (0 for an all-zero block)."""
    biased = (absmax.view(torch.int32) >> 23) & 255  # absmax = m * 2**(biased - 126), m in [0.5, 1)
    return torch.where(absmax > 0, biased - 141, 0).clamp(-126, 126)


def _quantize(x: torch.Tensor, bits: int):
    """Codes (as fp32 integers, or fp16 values at 16 bits), absmax `[n, 1]` and the step `[n, 1]` of `[n, B]` blocks."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    if bits == 16:  # the step 2**e is normal for every absmax (e is clamped to [-126, 126])
        exponent = _exponent16(absmax)
        return (x * _pow2(-exponent)).to(torch.float16), absmax, _pow2(exponent)
    # A block whose step would be subnormal (or zero) is sent as zeros, with absmax 0: its `1 / step` would overflow
    # to inf and `0 * inf` is NaN. Its entries (all below qmax * STEP_FLOOR) stay in the residual, exactly.
    qmax = _QMAX.get(bits, 1)
    sent = absmax >= qmax * STEP_FLOOR
    absmax = torch.where(sent, absmax, 0.0)
    if bits == 2:
        return torch.where(sent & (x.abs() > absmax * 0.5), torch.sign(x), 0.0), absmax, absmax
    step = absmax / qmax
    q = torch.round(x * torch.where(sent, 1.0 / step, 0.0)).clamp(-qmax, qmax)
    return q, absmax, step


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes as stored: int8 (8 and 2 bits), two biased nibbles per uint8 (4 bits), fp16 (16 bits)."""
    if bits == 16:
        return q
    codes = q.to(torch.int8)
    if bits == 4:
        biased = (codes + 8).to(torch.uint8).view(q.shape[0], -1, 2)
        return biased[..., 0] | (biased[..., 1] << 4)
    return codes


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of [`_pack`]: `[n, B]` fp32 codes."""
    if bits == 4:
        low = (codes & 15).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        return torch.stack([low, high], dim=-1).view(codes.shape[0], -1).float()
    return codes.float()


def _step(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """The step of each block `[n, 1]` from its absmax `[n]`, as every rank derives it."""
    absmax = absmax.unsqueeze(1)
    if bits == 2:
        return absmax
    if bits == 16:
        return _pow2(_exponent16(absmax))
    return absmax / _QMAX[bits]


def encode_blocks(grad, residual, codes_out, bits: int, residual_out=None):
    """
    The sender's kernel on `[n, B]` blocks: `acc = grad + residual` (fp32), quantized at `bits`; the codes are written
    into `codes_out` (`[n, B]` int8 at 8 and 2 bits, `[n, B / 2]` uint8 at 4, `[n, B]` fp16 at 16).

    Returns `(absmax [n] fp32, new_residual)`: `new_residual = acc - decoded` in `residual`'s dtype, or `None` when
    `residual` is `None` or when `residual_out` is given (it is written there: a fresh multi-megabyte output costs more
    in page faults than the kernel's arithmetic). Inputs below [`SAFE_MAGNITUDE`] keep every output finite.
    """
    acc = grad.float()
    if residual is not None:
        acc = acc + residual.float()
    q, absmax, step = _quantize(acc, bits)
    codes_out.copy_(_pack(q, bits))
    new_residual = None
    if residual is not None:
        sent = q.float() * step
        new_residual = (acc - sent).to(residual.dtype)
        if residual_out is not None:
            residual_out.copy_(new_residual)
            new_residual = None
    return absmax.squeeze(1), new_residual


def decode_blocks(codes, absmax, out, bits: int, divide: float) -> None:
    """
    Every rank's kernel: `sum_r code_r * step_r` over the ranks' `[n, B]` codes and `[n]` absmax (in that order, from
    the first), divided by `divide`, written into `out` (`[n, B]`, any float dtype: the bucket's gradients).
    """
    total = None
    for rank_codes, rank_absmax in zip(codes, absmax):
        decoded = _unpack(rank_codes, bits) * _step(rank_absmax, bits)
        total = decoded if total is None else total + decoded
    if divide != 1:
        total = total / divide
    out.copy_(total)


# One entry point per bit width, so that each has its own compile cache (dynamo keeps one per code object).
def _encode8(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 8, residual_out)


def _encode4(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 4, residual_out)


def _encode2(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 2, residual_out)


def _encode16(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 16, residual_out)


def _decode8(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 8, divide)


def _decode4(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 4, divide)


def _decode2(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 2, divide)


def _decode16(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 16, divide)


ENCODERS = {8: _encode8, 4: _encode4, 2: _encode2, 16: _encode16}
DECODERS = {8: _decode8, 4: _decode4, 2: _decode2, 16: _decode16}
WIDTHS = tuple(sorted(ENCODERS))  # the block codes' bits per entry


def code_shape(nblocks: int, block: int, bits: int) -> tuple[tuple[int, int], torch.dtype]:
    """Shape and dtype of the codes of `nblocks` blocks of `block` entries as the kernels write them."""
    if bits == 4:
        return (nblocks, block // 2), torch.uint8
    return (nblocks, block), torch.float16 if bits == 16 else torch.int8


def block_size_of(codes: torch.Tensor, bits: int) -> int:
    """Entries per block of `[n, ...]` codes as [`code_shape`] gives them."""
    return codes.shape[1] * (2 if bits == 4 else 1)


# ----------------------------------------------------------------------------------------------------------------
# Messages of rows of which every entry is sent
# ----------------------------------------------------------------------------------------------------------------


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8, 8 per byte, little-endian (the length must be a multiple of 8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(payload: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of [`_pack_bits`]: the first `count` bits as bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    return ((payload.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


@dataclass(frozen=True)
class BlockMessages:
    """
    How [`Kernels`] output travels for one [`CodecSpec`] of density 1: [`pack`] turns codes and absmax into a `uint8`
    message, [`unpack`] reads them back. [`fixed_nbytes`] is the message size (`None` at 2 bits, where it depends on
    the data). [`pack_rows`] / [`unpack_rows`] do the same for equal-size messages held as the rows of one tensor.

    Args:
        spec (`CodecSpec`): bits (2, 4, 8 or 16) and block size.
        align (`int`, *optional*, defaults to `MESSAGE_ALIGN`): messages are padded to a multiple of this many bytes
            (`1`: not padded, FSDP2's messages, whose size the all-to-all fixes).
    """

    spec: CodecSpec
    align: int = MESSAGE_ALIGN

    @property
    def code_bytes(self) -> int:
        """Bytes of one block's codes as the kernels store them."""
        return {8: 1, 4: 0.5, 2: 1, 16: 2}[self.spec.bits] * self.spec.block_size

    def fixed_nbytes(self, nblocks: int) -> int | None:
        """Padded bytes of the message of `nblocks` blocks; `None` when data-dependent (2 bits)."""
        if self.spec.bits == 2:
            return None
        return padded_nbytes(4 * nblocks + int(self.code_bytes * nblocks), self.align)

    def pack(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """The padded message of `[n, ...]` codes and `[n]` absmax."""
        nblocks = absmax.numel()
        if self.spec.bits == 2:
            nonzero = codes.view(-1) != 0
            signs = codes.view(-1)[nonzero] < 0
            signs = torch.nn.functional.pad(signs, (0, -signs.numel() % 8))
            parts = [_as_bytes(absmax), _pack_bits(nonzero), _pack_bits(signs)]
            used = MESSAGE_ALIGN + sum(p.numel() for p in parts)
            header = torch.tensor([padded_nbytes(used), 0, 0, 0], dtype=torch.int32).view(torch.uint8)
            parts.insert(0, header.to(absmax.device))
        else:
            parts = [_as_bytes(absmax), _as_bytes(codes)]
        used = sum(p.numel() for p in parts)
        parts.append(torch.zeros(padded_nbytes(used, self.align) - used, dtype=torch.uint8, device=absmax.device))
        message = torch.cat(parts)
        assert self.spec.bits == 2 or message.numel() == self.fixed_nbytes(nblocks)
        return message

    def pack_rows(self, codes: torch.Tensor, absmax: torch.Tensor, count: int) -> torch.Tensor:
        """
        `[count, fixed_nbytes(n)]`: the codes and absmax of `count * n` blocks (one kernel call's output) as `count`
        messages of `n` blocks each, one per row, written in one concatenation (4, 8 and 16 bits).
        """
        nblocks = absmax.numel() // count
        parts = [absmax.reshape(count, -1).view(torch.uint8), codes.reshape(count, -1).view(torch.uint8)]
        used = 4 * nblocks + int(self.code_bytes * nblocks)
        if self.fixed_nbytes(nblocks) > used:
            padding = self.fixed_nbytes(nblocks) - used
            parts.append(torch.zeros(count, padding, dtype=torch.uint8, device=absmax.device))
        return torch.cat(parts, dim=1)

    def unpack_rows(self, messages: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of [`pack_rows`]: the `(codes, absmax)` of the `[count, nbytes]` messages' blocks, in order (copies)."""
        count, code_nbytes = messages.shape[0], int(self.code_bytes * nblocks)
        absmax = messages[:, : 4 * nblocks].contiguous().view(torch.float32).reshape(-1)
        shape, dtype = code_shape(count * nblocks, self.spec.block_size, self.spec.bits)
        codes = messages[:, 4 * nblocks : 4 * nblocks + code_nbytes].contiguous().view(dtype).reshape(shape)
        return codes, absmax

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        """Bytes of the message at the start of `buffer` (read from its 16-byte header at 2 bits)."""
        fixed = self.fixed_nbytes(nblocks)
        return fixed if fixed is not None else int(buffer[:4].view(torch.int32).item())

    def clear_padding(self, message: torch.Tensor, nblocks: int) -> None:
        """Zero the padding bytes of a fixed-size message written through the views of [`unpack`]."""
        message[4 * nblocks + int(self.code_bytes * nblocks) :].zero_()

    def unpack(self, message: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """
        `(codes, absmax)` of a message of `nblocks` blocks: views into it where the layout allows (always at 8, 4
        and 16 bits, so that the encode kernel can write a message in place through them).
        """
        block, bits = self.spec.block_size, self.spec.bits
        if bits == 2:
            message = message[MESSAGE_ALIGN:]
        absmax = message[: 4 * nblocks].view(torch.float32)
        body = message[4 * nblocks :]
        if bits == 8:
            return body[: nblocks * block].view(torch.int8).view(nblocks, block), absmax
        if bits == 4:
            return body[: nblocks * block // 2].view(nblocks, block // 2), absmax
        if bits == 16:
            return body[: 2 * nblocks * block].view(torch.float16).view(nblocks, block), absmax
        count = nblocks * block
        nonzero = _unpack_bits(body[: count // 8], count)
        total = int(nonzero.sum())
        negative = _unpack_bits(body[count // 8 : count // 8 + (total + 7) // 8], total)
        codes = torch.zeros(count, dtype=torch.int8, device=message.device)
        codes[nonzero] = torch.where(negative, -1, 1).to(torch.int8)
        return codes.view(nblocks, block), absmax


# ----------------------------------------------------------------------------------------------------------------
# The code
# ----------------------------------------------------------------------------------------------------------------


def _blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[n, S]` rows -> `[n * ceil(S / B), B]` blocks (zero-padded: a block never spans two rows)."""
    pad = -rows.shape[1] % block_size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(-1, block_size)


@register
class BlockCode(Code):
    """
    Block absmax codes of every entry at 2, 4, 8 or 16 bits (see the module docstring); chosen for a spec of density 1
    and those bits (`grpo_bits` 2 to 16). Fixed in size, and carried by the sync, at 4, 8 and 16 bits (`grpo_sync_bits`).
    """

    name = "block"
    selected_by = {
        "grpo_bits": {str(bits): bits for bits in WIDTHS},
        "grpo_sync_bits": {str(bits): bits for bits in WIDTHS if bits != 2},  # the sync's codes are of one size
    }

    def __init__(self, spec: CodecSpec):
        super().__init__(spec)
        self.messages = BlockMessages(spec)
        self.row_messages = BlockMessages(spec, align=1)  # FSDP2's: equal in size to the byte, not padded
        self.fixed_size = spec.bits != 2
        self.in_sync = self.fixed_size  # the sync sends codes of one size (4, 8 or 16 bits)

    @classmethod
    def accepts(cls, spec: CodecSpec) -> bool:
        return spec.code is None and spec.density >= 1.0 and spec.bits in WIDTHS

    # --- sizes ---
    def message_nbytes(self, nblocks: int) -> int | None:
        return self.messages.fixed_nbytes(nblocks)

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        return self.messages.read_nbytes(buffer, nblocks)

    # --- messages ---
    def encode(self, kernels, rows, residual, k: int | None = None, message=None, in_place: bool = False):
        bits, writer = self.spec.bits, self.messages
        if message is None:
            codes, absmax, new_residual = kernels.encode(rows, residual, bits, in_place=in_place)
            return writer.pack(codes, absmax), new_residual
        codes_view, absmax_view = writer.unpack(message, rows.shape[0])
        _, absmax, new_residual = kernels.encode(rows, residual, bits, codes_out=codes_view, in_place=in_place)
        absmax_view.copy_(absmax)
        writer.clear_padding(message, rows.shape[0])
        return message, new_residual

    def decode(self, kernels, messages, nblocks: int, divide: float = 1, out=None, max_blocks: int | None = None):
        codes, absmax = zip(*(self.messages.unpack(message, nblocks) for message in messages))
        return self._decode_codes(kernels, codes, absmax, divide, out, max_blocks)

    def _decode_codes(self, kernels, codes, absmax, divide, out, max_blocks):
        """`Kernels.decode`, in calls of at most `max_blocks` blocks into `out` when given."""
        bits = self.spec.bits
        if max_blocks is None:
            return kernels.decode(codes, absmax, bits, divide, out)
        nblocks = absmax[0].numel()
        for start in range(0, nblocks, max_blocks):
            end = min(start + max_blocks, nblocks)
            kernels.decode([c[start:end] for c in codes], [a[start:end] for a in absmax], bits, divide, out[start:end])
        return out

    # --- owner reduction: one kernel call for the whole run ---
    def encode_to_owners(self, kernels, rows, residual, owned: list[tuple], ks: list[int] | None = None,
                         messages=None):  # fmt: skip
        """The run encoded in one kernel call, each owner's codes and absmax cut out of it: into `messages[owner]`
        when given (fixed sizes), else packed (2 bits)."""
        empty = torch.zeros(0, dtype=torch.uint8, device=rows.device)
        codes, absmax, new_residual = kernels.encode(rows, residual, self.spec.bits, in_place=True)
        writer = self.messages
        if messages is None:
            messages = [writer.pack(take_owned(codes, r), take_owned(absmax, r)) if r[1].numel() else empty
                        for r in owned]  # fmt: skip
            return messages, new_residual
        for owner, ranges in enumerate(owned):
            count = ranges[1].numel()
            if count:
                codes_view, absmax_view = writer.unpack(messages[owner], count)
                take_owned(codes, ranges, out=codes_view)
                take_owned(absmax, ranges, out=absmax_view)
                writer.clear_padding(messages[owner], count)
        return messages, new_residual

    def decode_from_owners(self, kernels, messages, owned: list[tuple], nblocks: int, out=None,
                           max_blocks: int | None = None):  # fmt: skip
        """The owners' codes put back in block order and decoded at once."""
        device = messages[0].device if messages else None
        shape, dtype = code_shape(nblocks, self.spec.block_size, self.spec.bits)
        codes, absmax = torch.empty(shape, dtype=dtype, device=device), torch.empty(nblocks, device=device)
        for owner, ranges in enumerate(owned):
            count = ranges[1].numel()
            if count:
                owner_codes, owner_absmax = self.messages.unpack(messages[owner], count)
                put_owned(codes, ranges, owner_codes)
                put_owned(absmax, ranges, owner_absmax)
        return self._decode_codes(kernels, [codes], [absmax], 1, out, max_blocks)

    # --- rows (FSDP2) ---
    def row_nbytes(self, numel: int) -> int:
        """`ceil(numel / B) * (4 + B * bits / 8)` (4, 8 and 16 bits)."""
        return self.row_messages.fixed_nbytes(num_blocks(numel, self.spec.block_size))

    def encode_rows(self, kernels, rows: torch.Tensor, nonfinite: torch.Tensor | None = None):
        """The rows in one kernel call; the blocks of an entry in `nonfinite` decode to NaN ([`poison_rows`])."""
        n, numel = rows.shape
        if nonfinite is not None:
            rows = torch.where(nonfinite, 0.0, rows)
        bits, block = self.spec.bits, self.spec.block_size
        codes, absmax, _ = kernels.encode(_blocks(rows, block), None, bits)
        decoded = kernels.decode([codes], [absmax], bits, 1.0)
        messages = self.row_messages.pack_rows(codes, absmax, n)
        if nonfinite is not None:
            self.poison_rows(messages, nonfinite)
        return messages, decoded.reshape(n, -1)[:, :numel]

    def poison_rows(self, messages: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """
        Make the blocks of the rows given to [`encode_rows`] that held a NaN/Inf (`nonfinite`, bool `[n, S]`) decode to
        NaN: their scales in `messages` are set to NaN, in place, so that a non-finite input reaches the receivers as
        such.
        """
        writer, block = self.row_messages, self.spec.block_size
        codes, absmax = writer.unpack_rows(messages, num_blocks(nonfinite.shape[1], block))
        absmax[_blocks(nonfinite, block).any(dim=1)] = math.nan
        messages.copy_(writer.pack_rows(codes, absmax, messages.shape[0]))

    def decode_rows(self, kernels, messages: torch.Tensor, numel: int) -> torch.Tensor:
        """`code * step`, one multiply each."""
        n = messages.shape[0]
        codes, absmax = self.row_messages.unpack_rows(messages, num_blocks(numel, self.spec.block_size))
        decoded = kernels.decode([codes], [absmax], self.spec.bits, 1.0)
        return decoded.reshape(n, -1)[:, :numel]


__all__ = [
    "COMPILE_OPTIONS",
    "DECODERS",
    "ENCODERS",
    "STEP_FLOOR",
    "WIDTHS",
    "BlockCode",
    "BlockMessages",
    "block_size_of",
    "code_shape",
    "decode_blocks",
    "encode_blocks",
]
