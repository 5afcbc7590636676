"""The top-k code: below density 1 a row sends its `k = ceil(density * numel)` entries of largest magnitude.

The kept values are quantized in blocks by the codec's kernels (or sent raw at 32 bits) and their positions in the
cheapest index scheme; a message carries its sizes in a 16-byte header, so its size depends on the data (see
[`~grpo_hf.compression.sparse.TopKMessages`] for the format). Owner reduction sends each owner a top-k message of the
blocks it owns, keeping the owner's share of `k`.
"""

import torch

from ..sparse import TopKMessages
from ..spec import CodecSpec, num_kept
from .base import Code, register


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

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        return self.messages.read_nbytes(buffer)

    def num_values(self, length: int, numel: int) -> int:
        """`ceil(density * numel)`: the real entries only, not the padding."""
        return num_kept(numel, self.spec.density)

    def encode(self, kernels, rows, residual, scale=None, clip: float | None = None, k: int | None = None,
               message=None, in_place: bool = False):  # fmt: skip
        clip = clip if scale is not None else None
        k = rows.numel() if k is None else k
        encoded, _, new_residual = self.messages.encode(kernels, rows, residual, scale, clip, k)
        if in_place and new_residual is not None:  # the top-k output is freed at once: only short-lived allocations
            residual.copy_(new_residual)
            new_residual = residual
        return encoded, new_residual

    def decode(self, kernels, messages, nblocks: int, scale=None, divide: float = 1, out=None, ema=None,
               beta: float = 0.0, max_blocks: int | None = None):  # fmt: skip
        values = self.messages.decode(kernels, messages, (nblocks, self.spec.block_size), scale, divide)
        return self.finish(values, out, ema, beta)


__all__ = ["TopKCode"]
