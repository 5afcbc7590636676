"""The block codes: every entry, 2, 4, 8 or 16 bits, one fp32 absmax per block of `B` entries (density 1).

The arithmetic is the codec's two fused kernels ([`~grpo_hf.compression.codec.Kernels`]) and the wire format its
[`~grpo_hf.compression.codec.BlockMessages`] (see `codec.py` for the codes of each width); this file is how the
transports use them:

- message of `n` blocks: `4 n + n B bits / 8` bytes padded to 16 (fixed by `n`: written in place, no size announced),
  except at 2 bits (a 16-byte header, a bitmap of the non-zero codes and their signs: the size depends on the data, so
  the sync sends these ternary levels in a code of its own, fixed in size: `ternary.py`);
- owner reduction encodes a run in one kernel call and cuts each owner's codes and absmax out of it; the owners' codes
  are put back in block order and decoded in one call;
- rows (FSDP2): `ceil(S / B) (4 + B bits / 8)` bytes per row of `S` entries, unpadded (4, 8 and 16 bits).
"""

import math

import torch

from ..codec import BlockMessages, code_shape
from ..owned import put_owned, take_owned
from ..spec import CodecSpec, num_blocks
from .base import Code, register


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
    and those bits. Fixed in size, and carried by the sync, at 4, 8 and 16 bits.
    """

    name = "block"

    def __init__(self, spec: CodecSpec):
        super().__init__(spec)
        self.messages = BlockMessages(spec)
        self.row_messages = BlockMessages(spec, align=1)  # FSDP2's: equal in size to the byte, not padded
        self.fixed_size = spec.bits != 2
        self.in_sync = self.fixed_size  # the sync sends codes of one size (4, 8 or 16 bits)

    @classmethod
    def accepts(cls, spec: CodecSpec) -> bool:
        return spec.code is None and spec.density >= 1.0 and spec.bits in (2, 4, 8, 16)

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


__all__ = ["BlockCode"]
