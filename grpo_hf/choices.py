"""The values the compression and sync settings take, shared by `config.py`, `grouping.py` (a group file's `bits`) and
`compression/`, and the one check of the sync's own settings ([`check_sync_settings`]).

Kept apart from all of them so that each imports it at its top level: `compression/plan.py` builds on `grouping.py`,
which checks group files against these values, and neither imports the other back; `config.py` reads the defaults here
without importing torch's side of `compression/`.
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
SYNC_BITS_CHOICES = ("ternary", "2", "4", "8", "16", "32")
DEFAULT_SYNC_BITS = "4"
# The values of grpo_sync_bits sent by a code of the sync's own, by name (`CodecSpec(code=..., bits=...)`): the per-step
# code of `grpo_bits=2` is ternary in messages whose size depends on the data, which the sync cannot write in place.
# "ternary" sends its levels (-1, 0, +1 times the block's absmax) 5 trits per byte; "2" the four levels 2 bits hold.
SYNC_CODES = {"ternary": ("ternary", 2), "2": ("two-bit", 2)}
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


def sync_code(sync_bits: str | int) -> tuple[int, str | None]:
    """`grpo_sync_bits` as the `(bits, code)` of the sync's `CodecSpec` (`code=None`: the block code of those bits)."""
    if str(sync_bits) in SYNC_CODES:
        code, bits = SYNC_CODES[str(sync_bits)]
        return bits, code
    return int(sync_bits), None


def check_comm_settings(name=str, **settings) -> None:
    """
    The one check of the compression's settings that its states take as arguments, each given one named as `name(key)`
    says: `dense_warmup_steps` ([`~grpo_hf.compression.GRPOCommState`]'s argument) and `error_feedback` ([`~grpo_hf.compression.fsdp.FSDPCommState`]'s); `GRPOConfig` passes its field names.

    Raises:
        `ValueError`: a value outside its range; the message names it.
    """
    if "dense_warmup_steps" in settings and settings["dense_warmup_steps"] < 0:
        raise ValueError(f"{name('dense_warmup_steps')}={settings['dense_warmup_steps']}: use 0 or more.")
    if "error_feedback" in settings and settings["error_feedback"] not in ERROR_FEEDBACK_CHOICES:
        raise ValueError(
            f"{name('error_feedback')}={settings['error_feedback']!r}: use one of {ERROR_FEEDBACK_CHOICES}."
        )


def check_sync_settings(every, fragments, delay, mix, moments, outer_lr, outer_momentum, dtype,
                        global_device=DEFAULT_SYNC_GLOBAL_DEVICE, error_decay=DEFAULT_SYNC_ERROR_DECAY,
                        name=str) -> None:  # fmt: skip
    """
    The one check of the sync's own settings, each named as `name(key)` says: `"every"`, `"fragments"` (a count),
    `"delay"`, `"mix"`, `"moments"`, `"outer_lr"`, `"outer_momentum"`, `"dtype"` (a name of `SYNC_DTYPE_CHOICES`,
    or a torch dtype), `"global_device"` (one of `SYNC_GLOBAL_DEVICE_CHOICES`) and `"error_decay"` (in `(0, 1]`) are
    the arguments of [`~grpo_hf.compression.outer_sync.OuterSyncState`]; `GRPOConfig` passes its field names.

    Raises:
        `ValueError`: a value outside its range, or two that do not fit together; the message names them.
    """
    for key, value in (("every", every), ("fragments", fragments)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name(key)}={value!r}: use a whole number, 1 or more.")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"{name('delay')}={delay!r}: use a whole number of steps, 0 (no overlap) or more.")
    for key, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum), ("mix", mix),
                       ("error_decay", error_decay)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{name(key)}={value!r}: use a number.")
    if not 0 < outer_lr < float("inf"):
        raise ValueError(f"{name('outer_lr')}={outer_lr}: use a positive number (1 with momentum 0 averages).")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"{name('outer_momentum')}={outer_momentum}: use a value in [0, 1), e.g. 0.5.")
    if not 0 < error_decay <= 1:
        raise ValueError(
            f"{name('error_decay')}={error_decay}: use a value in (0, 1] (1 keeps the error feedback whole; SparseLoCo "
            "decays it by 0.95 per sync)."
        )
    if str(dtype).replace("torch.", "") not in SYNC_DTYPE_CHOICES:
        raise ValueError(f"{name('dtype')}={dtype!r}: use one of {SYNC_DTYPE_CHOICES}.")
    if not isinstance(global_device, str) or global_device not in SYNC_GLOBAL_DEVICE_CHOICES:
        raise ValueError(
            f"{name('global_device')}={global_device!r}: use one of {SYNC_GLOBAL_DEVICE_CHOICES} ('auto': pinned CPU "
            "memory when the parameters are on an accelerator, with the parameters otherwise)."
        )
    if fragments > every:
        raise ValueError(
            f"{name('fragments')}={fragments} with {name('every')}={every}: each fragment syncs at its own step of the "
            f"H steps, so use at most {name('every')} fragments."
        )
    if not 0 <= mix <= 1:
        raise ValueError(
            f"{name('mix')}={mix}: use a value in [0, 1] (0 takes the global model, 1 keeps the local parameters, 0.5 "
            "weighs them equally)."
        )
    if delay > 0 and delay * fragments >= every:
        raise ValueError(
            f"{name('delay')}={delay} with {name('every')}={every} and {name('fragments')}={fragments}: a fragment's "
            "exchange must end before the next fragment's starts, so use a delay below "
            f"{name('every')} / {name('fragments')} = {every / fragments:g}."
        )
    if not isinstance(moments, str) or moments not in SYNC_MOMENTS:
        raise ValueError(f"{name('moments')}={moments!r}: use one of {tuple(SYNC_MOMENTS)}.")
    if moments != "none" and delay > 0:
        raise ValueError(
            f"{name('moments')}={moments!r} with {name('delay')}={delay}: the moments are averaged by the blocking "
            f"syncs only. Set {name('delay')}=0, or {name('moments')}='none'."
        )


__all__ = [
    "BITS_CHOICES",
    "DEFAULT_FSDP_ERROR_FEEDBACK",
    "ERROR_FEEDBACK_CHOICES",
    "check_comm_settings",
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
    "check_sync_settings",
    "COMM_MODE_CHOICES",
    "COMPRESSION_CHOICES",
    "DEFAULT_BITS",
    "DEFAULT_DENSITY",
    "DEFAULT_MODE",
    "DEFAULT_SYNC_BITS",
    "MODES",
    "SUPPORTED_BITS",
    "SYNC_BITS_CHOICES",
    "SYNC_CODES",
    "SCALES_REMOVED",
    "sync_code",
]
