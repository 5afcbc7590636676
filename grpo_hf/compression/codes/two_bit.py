"""The 2-bit code of the sync every H steps (`grpo_sync_bits="2"`): four levels per entry, 4 entries per byte.

Not the per-step code of `grpo_bits=2`, whose codes are ternary (`-1`, `0`, `+1` times the block's absmax; the sync
sends those levels as `grpo_sync_bits="ternary"`, `ternary.py`): that spends 2 bits on three levels. This code uses the
four: per block of `B` entries with absmax `a`, the uniform levels of `[-a, a]` without a zero,

    -a, -a / 3, +a / 3, +a          (an entry goes to the nearest: +-a where |x| > 2 a / 3, else +-a / 3)

so an entry is off by at most `a / 3` (the ternary code: `a / 2`). An entry of exactly 0 in a block that is not all
zero is sent as `+a / 3`; error feedback carries the difference to the next sync, as it does every rounding. A block
whose absmax lies below `STEP_FLOOR` is sent as zeros (absmax 0) and kept in the residual, exactly, as the codec does.

Each code is `2 * negative + large` (2 bits), packed 4 per byte, lowest first:

    per block: 4 (fp32 absmax) + ceil(B / 4) bytes; B = 128: 4 + 32 = 36 bytes, 2.25 bits per entry

and a message of `n` blocks is `36 n` bytes padded to 16 (`packed.py`). Plain torch, run eagerly as the sync's kernels
are; the new residual is `acc - sent` (bf16), added to the next sync's `Δ`.
"""

import torch

from .base import register
from .block import STEP_FLOOR
from .packed import PackedBlockCode


CODES_PER_BYTE = 4
_SHIFTS = (0, 2, 4, 6)


def levels(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 level of each 2-bit code: `(1 + 2 large) * (1 - 2 negative)` in `{1, 3, -1, -3}`, times `a / 3`."""
    codes = codes.to(torch.int32)
    return ((1 + 2 * (codes & 1)) * (1 - (codes & 2))).float()


def third(absmax: torch.Tensor) -> torch.Tensor:
    """`a / 3` of each block, `[m, 1]`: the unit of [`levels`], on the sender and every receiver alike."""
    return (absmax / 3.0).unsqueeze(1)


def quantize_two_bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[m, B]` fp32 blocks -> `(codes [m, B] uint8 in 0..3, absmax [m] fp32)` (see the module docstring)."""
    absmax = x.abs().amax(dim=1)
    absmax = torch.where(absmax >= STEP_FLOOR, absmax, 0.0)  # a block below the floor: zeros, kept in the residual
    large = 3.0 * x.abs() > 2.0 * absmax.unsqueeze(1)
    codes = 2 * (x < 0).to(torch.uint8) + large.to(torch.uint8)
    return codes, absmax


def pack_two_bit(codes: torch.Tensor) -> torch.Tensor:
    """`[m, B]` 2-bit codes -> `[m, ceil(B / 4)]` uint8, 4 per byte, lowest first (padded with 0s)."""
    m, block = codes.shape
    pad = -block % CODES_PER_BYTE
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    quads = codes.view(m, -1, CODES_PER_BYTE).to(torch.int32)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=codes.device)
    return (quads << shifts).sum(dim=2).to(torch.uint8)


def unpack_two_bit(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of [`pack_two_bit`]: `[m, nbytes]` uint8 -> `[m, block]` uint8 codes."""
    m = packed.shape[0]
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(2) >> shifts) & 3).view(m, -1)[:, :block]


@register
class TwoBitCode(PackedBlockCode):
    """
    Four levels of every entry, `{-1, -1/3, +1/3, +1}` times the block's absmax, 4 per byte (see the module docstring);
    chosen by `CodecSpec(code="two-bit", bits=2)`.
    """

    name = "two-bit"
    codes_per_byte = CODES_PER_BYTE
    selected_by = {"grpo_sync_bits": {"2": 2}}

    def quantize(self, kernels, rows, residual):
        acc = rows.float()
        if residual is not None:
            acc = acc + residual.float()
        codes, absmax = quantize_two_bit(acc)
        new_residual = None
        if residual is not None:
            sent = levels(codes) * third(absmax)
            new_residual = (acc - sent).to(residual.dtype)
        return absmax, pack_two_bit(codes), new_residual

    def values(self, absmax: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """`level * a / 3`."""
        return levels(unpack_two_bit(packed, self.spec.block_size)) * third(absmax)


__all__ = ["TwoBitCode", "levels", "pack_two_bit", "quantize_two_bit", "unpack_two_bit"]
