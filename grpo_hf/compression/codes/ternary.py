"""The ternary code of the sync every H steps (`grpo_sync_bits="ternary"`): every entry as a trit, 5 trits per byte.

The levels are the per-step code's at `grpo_bits=2` (`block.py`), which is ternary too: per block of `B` entries with
absmax `a`, an entry `x` is sent as `sign(x) a` where `|x| > a / 2`, else as 0 (a block whose absmax lies below
`STEP_FLOOR` is sent as zeros, and kept in the residual). The quantizer is the codec's own kernel at 2 bits
([`~grpo_hf.compression.codec.Kernels.encode`]), with its error feedback: the new residual is `acc - sent`, added to
the next sync's `Δ`. What differs is the message. The per-step code sends a 16-byte header, a bitmap of the non-zero
codes and their signs, a size that depends on the data (so the sync cannot write it in place); this code packs the
trits `t = code + 1` of 5 entries into one byte, `t0 + 3 t1 + 9 t2 + 27 t3 + 81 t4` (at most 242), so its size is
fixed by the number of blocks:

    per block: 4 (fp32 absmax) + ceil(B / 5) bytes; B = 128: 4 + 26 = 30 bytes, 1.875 bits per entry (1.625 of trits)

and a message of `n` blocks is `30 n` bytes padded to 16 (`packed.py`).
"""

import torch

from .base import register
from .packed import PackedBlockCode


TRITS_PER_BYTE = 5
_POWERS = (1, 3, 9, 27, 81)
_TABLES: dict[torch.device, torch.Tensor] = {}  # byte -> its 5 codes (int8 in {-1, 0, 1}), one table per device


def _table(device) -> torch.Tensor:
    """`[256, 5]` int8: the codes of each byte, lowest trit first (bytes above 242 are never written)."""
    device = torch.device(device)
    if device not in _TABLES:
        values = torch.arange(256, dtype=torch.int32)
        trits = torch.stack([(values // power) % 3 for power in _POWERS], dim=1)
        _TABLES[device] = (trits - 1).to(torch.int8).to(device)
    return _TABLES[device]


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """`[m, B]` codes in `{-1, 0, 1}` -> `[m, ceil(B / 5)]` uint8, 5 per byte, lowest trit first (padded with 0s)."""
    m, block = codes.shape
    trits = (codes.to(torch.int32) + 1).view(m, block)
    pad = -block % TRITS_PER_BYTE
    if pad:
        trits = torch.nn.functional.pad(trits, (0, pad), value=1)  # code 0
    powers = torch.tensor(_POWERS, dtype=torch.int32, device=codes.device)
    return (trits.view(m, -1, TRITS_PER_BYTE) * powers).sum(dim=2).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of [`pack_trits`]: `[m, nbytes]` uint8 -> `[m, block]` int8 codes."""
    m = packed.shape[0]
    return _table(packed.device)[packed.long()].view(m, -1)[:, :block]


@register
class TernaryCode(PackedBlockCode):
    """
    Trits of every entry, `{-1, 0, +1}` times the block's absmax, 5 per byte (see the module docstring); chosen by
    `CodecSpec(code="ternary", bits=2)` (`bits`: the 1.6 bits of a trit, rounded up to the per-step code's 2 of the
    same levels).
    """

    name = "ternary"
    codes_per_byte = TRITS_PER_BYTE
    selected_by = {"grpo_sync_bits": {"ternary": 2}}

    def quantize(self, kernels, rows, residual):
        """The codec's 2-bit kernel (ternary codes, error feedback), its codes packed as trits."""
        codes, absmax, new_residual = kernels.encode(rows, residual, 2)
        return absmax, pack_trits(codes), new_residual

    def values(self, absmax: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """`code * absmax`, as the codec decodes its 2-bit codes."""
        return unpack_trits(packed, self.spec.block_size).float() * absmax.unsqueeze(1)


__all__ = ["TernaryCode", "pack_trits", "unpack_trits"]
