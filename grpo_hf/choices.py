"""The defaults of the compression and sync settings and the values of their closed choices, shared by `config.py`,
`grouping.py` (a group file's `bits`), `compression/` and the command line's help (which imports no torch).

The values of the code settings (`grpo_bits`, `grpo_sync_bits`) are not here: each code declares those that select it
(`compression/codes/`); their rules are checked in one place, `compression/settings.py`.
"""

# The widths of the built-in codes, chosen from density and bits (`codes/block.py`, `codes/fp32.py`; a test holds them)
SUPPORTED_BITS = (2, 4, 8, 16, 32)
COMPRESSION_CHOICES = ("auto", "none", "sparse", "quantize", "sparse+quantize")
MODES = ("allgather", "allreduce")
COMM_MODE_CHOICES = ("auto", *MODES)
DEFAULT_DENSITY = 0.15  # the article's top 15%, used when compression includes "sparse"
DEFAULT_BITS = "8"
DEFAULT_MODE = "auto"
# grpo_sync_bits: the codes of the sync every H steps' pseudo-gradient (32: fp32). 4 bits: as good as 8 best against best
# on the suite's fine-tune, at half the bytes (benchmarks/LOG.md, 2026-12-04).
DEFAULT_SYNC_BITS = "4"
# grpo_fsdp_error_feedback: where FSDP2's compressed reduce-scatter keeps what it did not send.
ERROR_FEEDBACK_CHOICES = ("none", "worker-bf16", "worker-int8")
DEFAULT_FSDP_ERROR_FEEDBACK = "none"
DEFAULT_OUTER_LR = 1.0  # plain averaging: best against best on the suite (benchmarks/LOG.md, 2026-12-04)
DEFAULT_OUTER_MOMENTUM = 0.0
DEFAULT_SYNC_RAMP = True
DEFAULT_SYNC_DELAY = 0
DEFAULT_SYNC_MIX = 0.5  # α, provisional (not measured on the suite); torchft's `fragment_update_alpha` defaults to 0
SYNC_DTYPE_CHOICES = ("float32", "bfloat16")  # of θ_global and the outer momentum
DEFAULT_SYNC_DTYPE = "float32"
# grpo_sync_global_device: where θ_global and the outer momentum live. "auto": pinned CPU memory when the parameters are on
# an accelerator (torchft, INTELLECT-1), with the parameters otherwise; the outer step runs on the parameters' device.
SYNC_GLOBAL_DEVICE_CHOICES = ("auto", "cpu", "parameters")
DEFAULT_SYNC_GLOBAL_DEVICE = "auto"
# grpo_sync_moments: the inner optimizer's state averaged over ranks at a sync (hivemind averages Adam's exp_avg_sq)
SYNC_MOMENTS = {"none": (), "second": ("second",), "both": ("first", "second")}
DEFAULT_SYNC_MOMENTS = "none"
# grpo_sync_density / grpo_sync_chunk: below density 1 the sync sends the top k = ceil(density * C) entries of every
# chunk of C (SparseLoCo's 64 of 4,096), in 2-bit codes; grpo_sync_error_decay: β, the residual's decay per sync
# (1: the error feedback of the block codes, kept whole)
DEFAULT_SYNC_DENSITY = 1.0
DEFAULT_SYNC_CHUNK = 4096
DEFAULT_SYNC_ERROR_DECAY = 1.0
# Why the gradient scales (grpo_scale_gradients, grpo_scale_beta, grpo_scale_clip) were removed: one sentence, in the
# error a removed setting or a checkpoint that used them gets.
SCALES_REMOVED = (
    "the gradient scales (AdamW's exp_avg_sq) measured worse than block absmax alone on the benchmark suite (perplexity "
    "/ dense over seven tasks: 1.020 against 1.003 at 8 bits, 1.025 against 1.019 at 4 bits; benchmarks/LOG.md, "
    "2026-12-01) and were removed: the codes are scaled by their block's absmax, as by default."
)


__all__ = [
    "DEFAULT_FSDP_ERROR_FEEDBACK",
    "ERROR_FEEDBACK_CHOICES",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "DEFAULT_SYNC_DELAY",
    "DEFAULT_SYNC_CHUNK",
    "DEFAULT_SYNC_DENSITY",
    "DEFAULT_SYNC_DTYPE",
    "DEFAULT_SYNC_ERROR_DECAY",
    "DEFAULT_SYNC_GLOBAL_DEVICE",
    "DEFAULT_SYNC_MIX",
    "DEFAULT_SYNC_MOMENTS",
    "DEFAULT_SYNC_RAMP",
    "SYNC_DTYPE_CHOICES",
    "SYNC_GLOBAL_DEVICE_CHOICES",
    "SYNC_MOMENTS",
    "COMM_MODE_CHOICES",
    "COMPRESSION_CHOICES",
    "DEFAULT_BITS",
    "DEFAULT_DENSITY",
    "DEFAULT_MODE",
    "DEFAULT_SYNC_BITS",
    "MODES",
    "SUPPORTED_BITS",
    "SCALES_REMOVED",
]
