"""The one-tensor facade of the codec: [`compress`], [`compress_with_feedback`] and [`decompress`] of one tensor with
the code of its [`~grpo_hf.compression.spec.CodecSpec`] ([`~grpo_hf.compression.codes.code_for`]: top-k below density
1, block codes at density 1, fp32 as it is when lossless).

The top-k code, its index schemes and its messages live in `codes/topk.py` ([`~grpo_hf.compression.codes.TopKCode`]);
their names are re-exported here.
"""

from dataclasses import dataclass

import torch

from .codec import all_safe, compile_kernels
from .codes import code_for
from .codes.topk import (  # noqa: F401 - the top-k code's names, re-exported where they lived
    HEADER_NBYTES,
    IndexScheme,
    TopKMessages,
    decode_indices,
    decode_positions,
    encode_indices,
    encode_positions,
    topk_positions,
    view_as,
)
from .spec import CodecSpec, num_blocks


# ----------------------------------------------------------------------------------------------------------------
# One tensor at a time
# ----------------------------------------------------------------------------------------------------------------

_FACADE_KERNELS = compile_kernels(False)


@dataclass
class CompressedTensor:
    """
    One compressed flat tensor: its message (`uint8`, the wire form), the entries of the dense tensor and the spec.
    A tensor holding a NaN or an Inf is carried raw (`nonfinite=True`, the message holds its fp32 bytes).
    """

    numel: int
    spec: CodecSpec
    message: torch.Tensor
    nonfinite: bool = False

    def nbytes(self) -> int:
        """Bytes of the message."""
        return self.message.numel()


def _rows(flat: torch.Tensor, block: int) -> torch.Tensor:
    return torch.nn.functional.pad(flat, (0, num_blocks(flat.numel(), block) * block - flat.numel())).view(-1, block)


def compress_with_feedback(
    grad: torch.Tensor, residual: torch.Tensor | None, spec: CodecSpec
) -> tuple[CompressedTensor, torch.Tensor, torch.Tensor]:
    """
    Error-feedback compression of one tensor: compress `grad + residual` (flattened, fp32) and keep what was not sent.
    Returns `(compressed, decoded, new_residual)`, flat fp32 tensors with `decoded + new_residual == grad + residual`
    up to fp32 rounding (exact wherever a value is sent as 0 or is within a factor 2 of its code).

    If `grad + residual` holds a NaN, an Inf or a magnitude of `2**60` or more, the raw `grad` is carried dense (`nonfinite=True`), `decoded` is `grad`
    in fp32 and the **old residual object** is returned unchanged, so that an overflow never poisons the residual.
    """
    flat = grad.detach().reshape(-1).to(torch.float32)
    residual = torch.zeros_like(flat) if residual is None else residual
    if residual.numel() != flat.numel():
        raise ValueError(
            f"`residual` has {residual.numel()} entries but `grad` has {flat.numel()}; key residuals by parameter name "
            "and reset them when a parameter changes shape."
        )
    acc = flat + residual.reshape(-1).to(torch.float32)
    if not all_safe([acc]):
        raw = CompressedTensor(flat.numel(), CodecSpec(1.0, 32), flat.clone().view(torch.uint8), nonfinite=True)
        return raw, flat.clone(), residual
    if spec.lossless or flat.numel() == 0:
        return CompressedTensor(flat.numel(), spec, acc.clone().view(torch.uint8)), acc.clone(), torch.zeros_like(acc)
    rows = _rows(acc, spec.block_size)
    code, numel = code_for(spec), flat.numel()
    message, new_residual = code.encode(
        _FACADE_KERNELS, rows, torch.zeros_like(rows), k=code.num_values(rows.numel(), numel)
    )
    decoded, _ = code.decode(_FACADE_KERNELS, [message], rows.shape[0])  # what every receiver decodes
    return CompressedTensor(numel, spec, message), decoded.view(-1)[:numel], new_residual.view(-1)[:numel]


def compress(tensor: torch.Tensor, spec: CodecSpec) -> CompressedTensor:
    """Compress one tensor (any float dtype and shape; flattened, fp32) with `spec` (see [`compress_with_feedback`])."""
    return compress_with_feedback(tensor, None, spec)[0]


def decompress(ct: CompressedTensor) -> torch.Tensor:
    """The dense flat fp32 tensor a [`CompressedTensor`] decodes to (zeros where nothing was kept)."""
    spec, numel = ct.spec, ct.numel
    if ct.nonfinite or spec.lossless or numel == 0:
        return ct.message.view(torch.float32).clone()
    decoded, _ = code_for(spec).decode(_FACADE_KERNELS, [ct.message], num_blocks(numel, spec.block_size))
    return decoded.reshape(-1)[:numel]


__all__ = [
    "CompressedTensor",
    "IndexScheme",
    "TopKMessages",
    "compress",
    "compress_with_feedback",
    "decode_indices",
    "decode_positions",
    "decompress",
    "encode_indices",
    "encode_positions",
    "topk_positions",
    "view_as",
]
