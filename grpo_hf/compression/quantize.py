"""Block quantization of fp32 values at 32, 16, 8, 4 and 2 bits, with decoded values that make error feedback exact.

Values are cut into blocks of `block_size` (the last one padded with zeros); every block has its own fp32 scale:

- 32 bits: the values as they are, no scale.
- 16 bits: fp16 after a power-of-two shift per block (`scale = 2**(e - 15)` with `absmax = m * 2**e`,
  `m` in `[0.5, 1)`), so that gradients of any magnitude use the full fp16 mantissa.
- 8 and 4 bits: symmetric round-to-nearest (ties to even) codes in `[-127, 127]` and `[-7, 7]`, `scale = absmax / qmax`.
- 2 bits: ternary codes -1/0/+1 with `scale = absmax`: a value is sent as +-absmax when its magnitude is above half of
  it, as 0 otherwise (about 85% of a Gaussian block of 128).

Decoding is one fp32 multiply, `code * scale`, so sender and receivers decode bit-identical values on any device. Any
entry for which `decoded + (value - decoded) != value` in fp32 is re-coded as 0, so the error-feedback identity
`decoded + residual == value` holds bit for bit, also near fp32's overflow and among denormals. With round-to-nearest
and absmax scales that essentially never triggers (Sterbenz: a non-zero decoded value lies within a factor 2 of its
input).

Codes are stored biased (`code + 2**(bits - 1)`) as `uint8`, `8 // bits` per byte with the low bits first.
"""

import torch
import torch.nn.functional as F

from . import _cpu
from .spec import DEFAULT_BLOCK_SIZE, SUPPORTED_BITS, num_blocks


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {bits!r}.")


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact `2.0 ** exponent` in fp32 for integer exponents in `[-126, 127]` (built from the bit pattern)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def pack_fields(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[..., 8 // bits]` uint8 fields -> `[...]` bytes, field `i` in bits `[i * bits, (i + 1) * bits)`."""
    packed = codes[..., 0].clone()
    for i in range(1, codes.shape[-1]):
        packed |= codes[..., i] << (bits * i)
    return packed


def unpack_fields(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of [`pack_fields`]: `[...]` bytes -> `[..., 8 // bits]` fields."""
    mask = (1 << bits) - 1
    return torch.stack([(payload >> (bits * i)) & mask for i in range(8 // bits)], dim=-1)


def to_blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[..., k]` values -> `[..., ceil(k / block_size), block_size]` fp32 blocks, zero-padded (a view when aligned)."""
    k = values.shape[-1]
    pad = num_blocks(k, block_size) * block_size - k
    if pad:
        values = F.pad(values, (0, pad))
    return values.reshape(*values.shape[:-1], -1, block_size)


def quantize_blocks(blocks: torch.Tensor, bits: int, with_codes: bool = True):
    """
    Quantize `[..., block_size]` fp32 blocks (finite values).

    Returns `(codes, scales, decoded)`: `codes` the payload (biased uint8 codes packed along the last dimension at 8,
    4 and 2 bits, fp16 values at 16, the fp32 values at 32; `None` when `with_codes=False`), `scales` one fp32 per
    block (`None` at 32 bits) and `decoded` the values the receivers decode, shaped like `blocks`.
    """
    _check_bits(bits)
    if bits == 32:
        return (blocks if with_codes else None), None, blocks
    if blocks.device.type == "cpu" and bits in (2, 4, 8):
        return _cpu.quantize_blocks(blocks, bits, with_codes)
    return _quantize_blocks_torch(blocks, bits, with_codes)


def _quantize_blocks_torch(blocks: torch.Tensor, bits: int, with_codes: bool):
    """[`quantize_blocks`] in torch (every device; the numpy twin in `_cpu.py` runs on CPU at 2, 4 and 8 bits)."""
    absmax = blocks.abs().amax(dim=-1)
    if bits == 2:
        # Ternary: +-absmax where |x| > absmax / 2, else 0. Exact error feedback without a check: a non-zero decoded
        # value is within a factor 2 of its input (Sterbenz), a zero one leaves the input whole.
        scales = absmax
        keep = blocks.abs() > (absmax * 0.5).unsqueeze(-1)
        codes = torch.where(keep, torch.where(blocks < 0, -1.0, 1.0), 0.0)
        decoded = torch.where(keep, torch.copysign(absmax.unsqueeze(-1).expand_as(blocks), blocks), 0.0)
    elif bits == 16:
        # absmax = m * 2**x with m in [0.5, 1): after dividing by 2**(x - 15) the largest value lies in [2**14, 2**15).
        exponent = torch.frexp(absmax).exponent.to(torch.int32) - 15
        exponent = torch.where(absmax > 0, exponent, torch.zeros_like(exponent)).clamp(-126, 126)
        scales = _pow2(exponent)
        codes = (blocks * _pow2(-exponent).unsqueeze(-1)).to(torch.float16)
        decoded = codes.to(torch.float32) * scales.unsqueeze(-1)
    else:
        qmax = (1 << (bits - 1)) - 1
        scales = absmax / qmax
        # A zero (or underflowed) scale means every value of the block rounds to code 0: divide by 1 instead of 0.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        codes = torch.round(blocks / divisor).clamp_(-qmax, qmax).add_(0.0)  # -0.0 -> +0.0, as receivers decode
        decoded = codes * scales.unsqueeze(-1)
    bad = (decoded + (blocks - decoded)) != blocks
    if bits != 2 and bool(bad.any()):  # essentially never (see the module docstring)
        codes = codes.masked_fill(bad, 0.0)
        decoded = decoded.masked_fill(bad, 0.0)
    if not with_codes:
        return None, scales, decoded
    if bits == 16:
        return codes, scales, decoded
    biased = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if bits < 8:
        biased = pack_fields(biased.reshape(*biased.shape[:-1], -1, 8 // bits), bits)
    return biased, scales, decoded


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor | None, bits: int, block_size: int) -> torch.Tensor:
    """Inverse of [`quantize_blocks`]: `[..., block_size]` fp32 decoded values (`code * scale`, one multiply each)."""
    _check_bits(bits)
    if bits == 32:
        return codes.to(torch.float32)
    if bits == 16:
        return codes.reshape(*scales.shape, block_size).to(torch.float32) * scales.unsqueeze(-1)
    if bits < 8:
        codes = unpack_fields(codes, bits)
    q = codes.reshape(*scales.shape, block_size).to(torch.int16) - (1 << (bits - 1))
    return q.to(torch.float32) * scales.unsqueeze(-1)


def quantize(
    values: torch.Tensor, bits: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """
    Quantize a flat tensor of (kept) values.

    Round-to-nearest (ties to even), symmetric, deterministic; a value whose residual would not be exact in fp32 is
    coded as 0 (see the module docstring), so `decoded + (values - decoded) == values` always holds.

    Args:
        values (`torch.Tensor`):
            Finite values, any float dtype and shape (flattened, computed in fp32).
        bits (`int`):
            `32`, `16`, `8`, `4` or `2`.
        block_size (`int`, *optional*, defaults to `128`):
            Values per fp32 scale below 32 bits.

    Returns:
        `tuple[torch.Tensor, torch.Tensor | None]`: `(payload, scales)`: at 8/4/2 bits `uint8` codes biased by
        `2**(bits - 1)` (`8 // bits` per byte, low bits first), at 16 bits fp16 values, at 32 bits a copy of the fp32
        values; `ceil(k / block_size)` fp32 scales (`None` at 32 bits).
    """
    _check_bits(bits)
    flat = values.detach().reshape(-1).to(torch.float32)
    k = flat.numel()
    if bits == 32:
        return flat.clone(), None
    codes, scales, _ = quantize_blocks(to_blocks(flat, block_size), bits)
    return codes.reshape(-1)[: (k * bits + 7) // 8 if bits < 16 else k], scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor | None, bits: int, numel: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    """
    Inverse of [`quantize`]: `numel` fp32 values, `code * scale` with one fp32 multiply per value, so that sender and
    receiver decode bit-identical values on any device.

    Args:
        codes (`torch.Tensor`): the payload returned by [`quantize`].
        scales (`torch.Tensor` or `None`): the scales returned by [`quantize`].
        bits (`int`): `32`, `16`, `8`, `4` or `2`.
        numel (`int`): number of values (codes may be padded).
        block_size (`int`, *optional*, defaults to `128`): must match [`quantize`].
    """
    _check_bits(bits)
    if bits == 32:
        return codes.to(torch.float32, copy=True).reshape(-1)[:numel]
    padded = scales.numel() * block_size
    per_byte = 1 if bits >= 8 else 8 // bits
    fill = 0.0 if bits == 16 else (1 << (bits - 1)) * sum(1 << (bits * i) for i in range(per_byte))
    codes = codes.reshape(-1)
    need = padded if bits == 16 else padded // per_byte
    if codes.numel() < need:
        codes = F.pad(codes, (0, need - codes.numel()), value=fill)  # padding decodes to 0
    rows = codes[:need].reshape(scales.numel(), need // max(1, scales.numel()))
    return dequantize_blocks(rows, scales.reshape(-1), bits, block_size).reshape(-1)[:numel]


__all__ = [
    "dequantize",
    "dequantize_blocks",
    "pack_fields",
    "quantize",
    "quantize_blocks",
    "to_blocks",
    "unpack_fields",
]
