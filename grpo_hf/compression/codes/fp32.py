"""The fp32 pass-through: rows sent as their fp32 bytes (`bits=32`, density 1), exact.

Only FSDP2's reduce-scatter sends it as a code (`grpo_bits=32`, and its dense warm-up steps): one message of `4 S` bytes
per row of `S` entries, in one all-to-all of equal-size messages. The DDP hook and the sync send such tensors dense, in
their fp32 all-reduce (the plan gives them no spec), so this code has no messages of its own.
"""

import torch

from ..spec import CodecSpec
from .base import Code, register


@register
class Fp32Code(Code):
    """The fp32 values as they are (see the module docstring); chosen for a spec of density 1 and 32 bits."""

    name = "fp32"
    fixed_size = True
    owner_reducible = False
    selected_by = {"grpo_bits": {"32": 32}, "grpo_sync_bits": {"32": 32}}

    @classmethod
    def accepts(cls, spec: CodecSpec) -> bool:
        return spec.code is None and spec.density >= 1.0 and spec.bits == 32

    def row_nbytes(self, numel: int) -> int:
        """`4 numel`."""
        return 4 * numel

    def encode_rows(self, kernels, rows: torch.Tensor, nonfinite: torch.Tensor | None = None):
        """The rows' bytes (a NaN/Inf travels as it is)."""
        n, numel = rows.shape
        return rows.contiguous().view(torch.uint8).reshape(n, 4 * numel), rows

    def decode_rows(self, kernels, messages: torch.Tensor, numel: int) -> torch.Tensor:
        return messages.contiguous().view(torch.float32)


__all__ = ["Fp32Code"]
