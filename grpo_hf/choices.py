"""The values the compression settings take, shared by `grouping.py` (a group file's `bits`) and `compression/`.

Kept apart from both so that each imports it at its top level: `compression/plan.py` builds on `grouping.py`, which
checks group files against these values, and neither imports the other back.
"""

SUPPORTED_BITS = (2, 4, 8, 16, 32)
BITS_CHOICES = ("auto", *(str(bits) for bits in SUPPORTED_BITS))
COMPRESSION_CHOICES = ("auto", "none", "sparse", "quantize", "sparse+quantize")
MODES = ("allgather", "allreduce")
COMM_MODE_CHOICES = ("auto", *MODES)
DEFAULT_DENSITY = 0.15  # the article's top 15%, used when compression includes "sparse"
DEFAULT_BITS = "8"
DEFAULT_MODE = "auto"
# grpo_sync_bits: the codes of the sync every H steps' pseudo-gradient (32: fp32). 4 bits: as good as 8 best against best
# on the suite's fine-tune, at half the bytes (benchmarks/LOG.md, 2026-12-04).
SYNC_BITS_CHOICES = ("4", "8", "16", "32")
DEFAULT_SYNC_BITS = "4"


__all__ = [
    "BITS_CHOICES",
    "COMM_MODE_CHOICES",
    "COMPRESSION_CHOICES",
    "DEFAULT_BITS",
    "DEFAULT_DENSITY",
    "DEFAULT_MODE",
    "DEFAULT_SYNC_BITS",
    "MODES",
    "SUPPORTED_BITS",
    "SYNC_BITS_CHOICES",
]
