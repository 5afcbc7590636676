"""Compressed gradient communication: the DDP hook and its state, the codec, and the compression plan.

Read it the way torch's `powerSGD_hook.py` reads: [`GRPOCommState`] (`state.py`) holds the settings, the bf16
error-feedback residuals and the gradient scales; [`grpo_comm_hook`] (`hook.py`) takes DDP's buckets and exchanges
them ([`compress_locally`] does the same in one process); `layout.py` cuts a bucket into runs of tensors that share a
[`CodecSpec`]; `exchange.py` is the one encode / exchange / decode seam of the DDP hook, FSDP2's reduce-scatter
(`fsdp.py`) and the sync every H steps (`outer_sync.py`); `codec.py` holds the two fused kernels (encode, decode;
compiled for CPU and CUDA from one source) and their messages, `sparse.py` the top-k messages;
[`compression_plan`] (`plan.py`) decides each parameter's spec.
Every byte is counted by the formulas of `traffic.py`, and summed by its `TrafficStats` (the one statistics window of
the hook, FSDP2 and the outer sync); `reshard.py` re-splits saved state for another world size.
"""

from .hook import compress_locally, grpo_comm_hook
from .plan import compression_plan, resolve_compression, resolve_mode
from .sparse import CompressedTensor, compress, compress_with_feedback, decompress
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
    "grpo_comm_hook",
    "resolve_compression",
    "resolve_mode",
]
