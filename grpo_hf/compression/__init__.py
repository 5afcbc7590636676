"""Compressed gradient communication: the codec, the compression plan, the DDP hook and its single-process twin.

A gradient's path from `backward` to the wire and back: DDP hands a bucket to [`grpo_comm_hook`] (`hook.py`), which
groups its tensors into one segment per [`CodecSpec`] (`layout.py`, specs from [`compression_plan`], `plan.py`); each
segment gets its residual added and is scaled by its gradient scales (`state.py`), compressed (`codec.py`: `topk.py`,
`quantize.py`, `indices.py`) into messages (`wire.py`), exchanged and decoded in rank order (`exchange.py`); the
averaged gradients are written back into the bucket. Every byte is counted by the formulas of `traffic.py`.
"""

from .codec import CompressedTensor, compress, compress_with_feedback, decompress, deserialize, serialize
from .hook import grpo_comm_hook
from .local import compress_locally
from .plan import compression_plan, resolve_compression, resolve_mode
from .spec import CodecSpec
from .state import GRPOCommState


__all__ = [
    "CodecSpec",
    "CompressedTensor",
    "GRPOCommState",
    "compress",
    "compress_locally",
    "compress_with_feedback",
    "compression_plan",
    "decompress",
    "deserialize",
    "grpo_comm_hook",
    "resolve_compression",
    "resolve_mode",
    "serialize",
]
