"""Fixed-size messages of packed block codes: the layout the sync's 2-bit and ternary codes share (`two_bit.py`,
`ternary.py`).

A message of `n` blocks of `B` entries is the `n` fp32 absmax of its blocks, then each block's codes packed into
`code_nbytes` bytes (`ceil(B / 4)` for 2-bit codes, `ceil(B / 5)` for trits), padded with zeros to 16 bytes:

    4 n + n code_nbytes bytes, rounded up to a multiple of 16

fixed by `n` alone, so the messages are written in place into the gathered buffer (the all-gather at `W = 2`, the
owners' all-to-all and all-gather from `W = 3`) with no size announced. A subclass says how a block is quantized and
packed ([`PackedBlockCode.quantize`]) and how its packed codes decode ([`PackedBlockCode.values`]); encoding and
decoding go a chunk of blocks at a time (the work memory of a chunk, as the codec's kernels), owner reduction puts the
owners' codes back in block order and decodes them at once.
"""

import torch

from ..owned import put_owned
from ..spec import CodecSpec
from .base import ENCODE_CHUNK, Code, padded_nbytes


class PackedBlockCode(Code):
    """
    A code of every entry whose message is the blocks' fp32 absmax then their packed codes (see the module docstring);
    the base of [`~grpo_hf.compression.codes.TwoBitCode`] and [`~grpo_hf.compression.codes.TernaryCode`]. Fixed in
    size, carried by the sync every H steps and by owner reduction.
    """

    fixed_size = True
    in_sync = True
    codes_per_byte: int = 0  # a subclass's: codes packed into one byte (4 two-bit codes, 5 trits)

    def __init__(self, spec: CodecSpec):
        if spec.bits != 2 or spec.density < 1.0:
            raise ValueError(
                f"the {self.name} code sends every entry in {8 / self.codes_per_byte:g} bits: use "
                f"CodecSpec(code={self.name!r}, bits=2), got {spec}."
            )
        super().__init__(spec)

    @property
    def code_nbytes(self) -> int:
        """Bytes of one block's packed codes: `ceil(B / codes_per_byte)`."""
        return -(-self.spec.block_size // self.codes_per_byte)

    # --- what a subclass implements ---
    def quantize(self, kernels, rows, residual):
        """
        `[m, B]` rows (`rows + residual`) as `(absmax [m] fp32, packed [m, code_nbytes] uint8, new_residual)`:
        `new_residual = acc - values` in `residual`'s dtype (`None` without a residual), `values` exactly what
        [`values`] decodes.
        """
        raise NotImplementedError(f"{type(self).__name__} quantizes its blocks.")

    def values(self, absmax: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The `[m, B]` fp32 values of `m` blocks' packed codes and absmax."""
        raise NotImplementedError(f"{type(self).__name__} decodes its blocks.")

    # --- sizes ---
    def message_nbytes(self, nblocks: int) -> int:
        """`4 n + n code_nbytes` bytes, padded to 16."""
        return padded_nbytes(nblocks * (4 + self.code_nbytes))

    def views(self, message: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(absmax [n] fp32, packed [n, code_nbytes] uint8)`: views into a message of `nblocks` blocks."""
        body = 4 * nblocks + nblocks * self.code_nbytes
        if message.numel() < body:
            raise ValueError(
                f"{type(self).__name__}: a message of {message.numel()} bytes is too short for {nblocks} blocks "
                f"({self.message_nbytes(nblocks)} bytes); the ranks disagree on the layout."
            )
        absmax = message[: 4 * nblocks].view(torch.float32)
        return absmax, message[4 * nblocks : body].view(nblocks, self.code_nbytes)

    # --- messages ---
    def encode(self, kernels, rows, residual, k: int | None = None, message=None, in_place: bool = False):
        nblocks = rows.shape[0]
        if message is None:
            message = torch.empty(self.message_nbytes(nblocks), dtype=torch.uint8, device=rows.device)
        absmax, packed = self.views(message, nblocks)
        new_residual = None
        if residual is not None:
            new_residual = residual if in_place else torch.empty_like(residual)
        step = max(1, ENCODE_CHUNK // self.spec.block_size)  # the work memory of a chunk
        for start in range(0, nblocks, step):
            end = min(start + step, nblocks)
            held = None if residual is None else residual[start:end]
            chunk_absmax, chunk_packed, kept = self.quantize(kernels, rows[start:end], held)
            absmax[start:end] = chunk_absmax
            packed[start:end] = chunk_packed
            if kept is not None:
                new_residual[start:end] = kept
        message[4 * nblocks + nblocks * self.code_nbytes :].zero_()
        return message, new_residual

    def decode(self, kernels, messages, nblocks: int, divide: float = 1, out=None, max_blocks: int | None = None):
        return self._decode([self.views(message, nblocks) for message in messages], nblocks, divide, out, max_blocks)

    def _decode(self, held, nblocks, divide, out, max_blocks):
        """The sum of the `(absmax, packed)` of `held` in order, divided, into `out`; `max_blocks` blocks at a
        time."""
        device = held[0][0].device if held else None
        if out is None:
            out = torch.empty(nblocks, self.spec.block_size, device=device)
        step = nblocks if max_blocks is None else max_blocks
        for start in range(0, nblocks, max(1, step)):
            end = min(start + max(1, step), nblocks)
            total = None
            for absmax, packed in held:  # in order from the first: every rank adds them the same way
                values = self.values(absmax[start:end], packed[start:end])
                total = values if total is None else total + values
            if divide != 1:
                total = total / divide
            out[start:end] = total
        return out

    # --- owner reduction: the owners' codes put back in block order, decoded at once ---
    def decode_from_owners(self, kernels, messages, owned: list[tuple], nblocks: int, out=None,
                           max_blocks: int | None = None):  # fmt: skip
        device = messages[0].device if messages else None
        absmax = torch.empty(nblocks, device=device)
        packed = torch.empty(nblocks, self.code_nbytes, dtype=torch.uint8, device=device)
        for owner, ranges in enumerate(owned):
            count = ranges[1].numel()
            if count:
                owner_absmax, owner_packed = self.views(messages[owner], count)
                put_owned(absmax, ranges, owner_absmax)
                put_owned(packed, ranges, owner_packed)
        return self._decode([(absmax, packed)], nblocks, 1, out, max_blocks)


__all__ = ["PackedBlockCode"]
