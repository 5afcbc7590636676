"""Gradient compression: the pure-torch codec (`codec`) and the DDP communication hook built on it (`hook`)."""

from .codec import CodecSpec, CompressedTensor, compress, compress_with_feedback, decompress
from .hook import GRPOCommState, compress_locally, grpo_comm_hook


__all__ = [
    "CodecSpec",
    "CompressedTensor",
    "GRPOCommState",
    "compress",
    "compress_locally",
    "compress_with_feedback",
    "decompress",
    "grpo_comm_hook",
]
