"""`GRPOConfig`: the Trainer's `TrainingArguments` plus every grpo_hf setting (`grpo_*`, `cost_*`)."""

import dataclasses
import functools
import json
import typing
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .choices import (
    COMM_MODE_CHOICES,
    COMPRESSION_CHOICES,
    DEFAULT_BITS,
    DEFAULT_DENSITY,
    DEFAULT_FSDP_ERROR_FEEDBACK,
    DEFAULT_MODE,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_SYNC_BITS,
    DEFAULT_SYNC_CHUNK,
    DEFAULT_SYNC_DELAY,
    DEFAULT_SYNC_DENSITY,
    DEFAULT_SYNC_DTYPE,
    DEFAULT_SYNC_ERROR_DECAY,
    DEFAULT_SYNC_GLOBAL_DEVICE,
    DEFAULT_SYNC_MIX,
    DEFAULT_SYNC_MOMENTS,
    DEFAULT_SYNC_RAMP,
    ERROR_FEEDBACK_CHOICES,
    SCALES_REMOVED,
    SYNC_DTYPE_CHOICES,
    SYNC_GLOBAL_DEVICE_CHOICES,
    SYNC_MOMENTS,
)
from .compression.plan import DEFAULT_MIN_NUMEL
from .compression.settings import BITS_CHOICES, SYNC_BITS_CHOICES, transport_settings
from .cost import CostSettings
from .cost.prices import CostFields
from .engine_settings import check_backends
from .errors import ConfigError
from .field_docs import append_field_docs
from .grouping import check_lr_ratios, load_group_spec
from .importance import SCORE_KINDS as SCORE_CHOICES
from .lr_presets import DEFAULT_PRESET, PRESET_CHOICES, check_preset
from .optim.builder import check_optimizer_state_settings
from .optim.layout import (
    DEFAULT_MIN_STATE_NUMEL,
    DEFAULT_OPTIMIZER_STATE,
    OPTIMIZER_STATE_CHOICES,
    check_optimizer_state,
)
from .optim.layout import (
    PRESETS as STATE_PRESETS,
)


@dataclass
class GRPOConfig(CostFields, TrainingArguments):
    r"""
    Configuration of [`GRPOTrainer`]: every field of [`~transformers.TrainingArguments`] plus the settings of grouped
    parameter resource optimization (GRPO; not TRL's Group Relative Policy Optimization).

    Every check runs when the config is built, before any model is loaded: the `grpo_*` and `cost_*` values, the
    group file (read and validated, errors name the file and the rule), and the engine (FSDP2 and DeepSpeed ZeRO 1/2/3
    are accepted; FSDP1, ZeRO stage 0 and a DeepSpeed config with an `"optimizer"` or `"scheduler"` block are refused,
    see [`~grpo_hf.engine_settings.check_backends`]). Errors are [`~grpo_hf.errors.ConfigError`] /
    [`~grpo_hf.errors.GroupConfigError`] (`ValueError`s) that name the field.

    Four fields of the sync had other names before (`grpo_outer_lr`, `grpo_outer_momentum`, `grpo_outer_dtype`,
    `grpo_outer_control`): deprecated aliases, accepted for one more release with a `FutureWarning`
    ([`DEPRECATED_FIELDS`] maps each to its new name). Settings that were measured and removed
    (`grpo_scale_gradients`, `grpo_scale_beta`, `grpo_scale_clip`) are refused, whatever their value, with one error
    that says why ([`REMOVED_FIELDS`]). The `grpo-hf` commands add fields of their own (`overwrite_output_dir`,
    `cost_noise_rounds`, `cost_noise_window_steps`) to the recipes they read; `GRPOTrainer` has no use for them.

    Example:

    ```python
    >>> from grpo_hf import GRPOConfig

    >>> args = GRPOConfig(output_dir="out", grpo_groups="semantic", learning_rate=2e-4, max_steps=100)
    ```
    """

    # The docstring's parameters are appended from each field's help (`append_field_docs` below the class, headings
    # from SECTIONS): the one text that help(), `--help-all` and docs/settings.md show. Edit the help, not a docstring.

    # --- grouping ---
    grpo_groups: str = field(
        default="semantic",
        metadata={
            "help": 'A group preset (`"semantic"`, `"semantic+shape"`) or the path of a JSON/YAML group file. The '
            'article\'s `{"groups": [{"name": ..., "pattern": ..., "sparsity": ...}]}` format loads as is.'
        },
    )
    grpo_groups_strict: bool = field(
        default=False,
        metadata={"help": "Make a group rule that matches no trainable parameter an error instead of a warning."},
    )
    grpo_lr_ratios: dict | str | None = field(
        default=None,
        metadata={
            "help": "Fixed factors on the scheduled learning rate of groups, by group-name pattern (`fnmatch`): a dict, "
            'or a JSON string on the command line, e.g. `{"*lora_B": 4, "embeddings": 0.5}` (`*lora_B`: LoRA+\'s '
            "idea, the B matrices learn faster). A group file's own `lr_ratio` wins; the importance multiplier "
            "(`grpo_importance`) multiplies on top."
        },
    )
    grpo_lr_preset: str = field(
        default=DEFAULT_PRESET,
        metadata={
            "help": "Fixed per-group learning-rate ratios made from the groups by a preset (`grpo_hf.lr_presets`). "
            '`"lora-b"`: LoRA\'s B matrices faster; `"llrd"`: layer-wise decay by depth, counted per stack; '
            '`"embeddings"`: embeddings slower, head faster; `"fan-in"`: each matrix by its fan-in, muP-like; '
            '`"auto"`: by model kind; `"none"`. Groups are split where a preset\'s factor differs inside them '
            "(`ffn/L3`). `grpo_lr_ratios` and a group file's `lr_ratio` win over it. Off by default: no preset has "
            "earned it on a learning-rate sweep yet.",
            "choices": list(PRESET_CHOICES),
        },
    )
    # --- importance-based LR scaling ---
    grpo_importance: bool = field(
        default=False,
        metadata={
            "help": "Scale each group's learning rate by its importance multiplier. Off by default: no importance "
            "score has beaten the plain Trainer on the benchmark suite (`docs/benchmarks.md`). The scores are "
            "computed and logged either way (`grpo/importance/<group>`), the multipliers (`grpo/lr_scale/<group>`) "
            "only when applied."
        },
    )
    grpo_importance_score: str = field(
        default="article",
        metadata={
            "help": 'The importance score of a group g: a signal times `ln(update_count_g + 1)`. `"article"`: '
            'the gradient\'s norm `||grad_g||_2`; `"rms"`: its per-element RMS `||grad_g||_2 / sqrt(numel_g)`, so '
            'that large groups do not win by size alone; `"coherence"`: the cosine between the group\'s gradient '
            "and its optimizer momentum (Adam's `exp_avg`), floored at 0.05, so that groups whose gradients keep "
            "their direction get more learning rate.",
            "choices": list(SCORE_CHOICES),
        },
    )
    grpo_lr_scale_min: float = field(
        default=0.9,
        metadata={
            "help": "Lower bound of every importance multiplier, in (0, 1]; a group file can override it per group. "
            "Wider bounds measured worse than the plain Trainer in `benchmarks/bench_importance.py` "
            "(`benchmarks/LOG.md`)."
        },
    )
    grpo_lr_scale_max: float = field(
        default=1.1,
        metadata={
            "help": "Upper bound of every importance multiplier, at least 1; a group file can override it per group. "
            "Wider bounds measured worse than the plain Trainer in `benchmarks/bench_importance.py` "
            "(`benchmarks/LOG.md`)."
        },
    )
    grpo_lr_scale_ema: float = field(
        default=0.9, metadata={"help": "EMA smoothing factor of the importance scores, in [0, 1); 0: no smoothing."}
    )
    grpo_lr_scale_warmup_steps: int = field(
        default=10,
        metadata={
            "help": "Optimizer steps during which every importance multiplier is 1 (the scores are still tracked)."
        },
    )
    grpo_log_groups: bool = field(
        default=False,
        metadata={
            "help": "Log each group's figures at every logging step: `grpo/lr/<group>`, `grpo/lr_scale/<group>`, "
            "`grpo/grad_norm/<group>`, `grpo/importance/<group>`, `grpo/update_count/<group>` and "
            "`grpo/memory/optimizer_state_bytes/<group>` (a five-group model: 30 more keys per line). Off, each "
            "logging step is one concise line: the Trainer's keys and GRPO's totals (`grpo/load_balance_std`, "
            "`grpo/nonfinite_steps`, `grpo/memory/optimizer_state_bytes`, the `grpo/comm/*` bytes). `grpo-hf "
            "compare` turns it on for the report's per-group plots."
        },
    )
    # --- gradient compression ---
    grpo_compression: str = field(
        default="auto",
        metadata={
            "help": 'How the gradients are compressed at every step. `"none"`; `"sparse"`: top-k, fp32 values; '
            '`"quantize"`: every entry, `grpo_bits` per value; `"sparse+quantize"`: the article\'s; `"auto"`: '
            '`"quantize"` under DDP or FSDP2 with more than one process, `"none"` otherwise. Every lossy DDP setting keeps what it did not '
            'send for the next step (error feedback). FSDP2 takes `"none"` and `"quantize"` (its compressed '
            'reduce-scatter, `grpo_hf.compression.fsdp`); DeepSpeed only `"none"` (ZeRO reduces gradients itself; '
            '`"auto"` turns compression off there).',
            "choices": list(COMPRESSION_CHOICES),
        },
    )
    grpo_density: float = field(
        default=DEFAULT_DENSITY,
        metadata={
            "help": "Fraction of gradient entries kept by top-k, in (0, 1] (the article's 15%%), when "
            '`grpo_compression` includes `"sparse"`, for groups that do not set their own.'
        },
    )
    grpo_bits: str = field(
        default=DEFAULT_BITS,
        metadata={
            "help": "Bits per sent value of the per-step codes, for every group that does not set its own. `2`: "
            "ternary codes, sent as a bitmap plus sign bits; `4`, `8`, `16`; `32`: fp32; a code's own value; "
            '`"auto"`: the article\'s, 4 for linear-like weights, 8 for convolutions and embeddings. The default is '
            "the setting chosen on the benchmark suite; what every setting measured, in quality and bytes, is in "
            "`docs/compression.md`.",
            "choices": BITS_CHOICES,  # the registered codes' values (compression/codes/), read at each use
        },
    )
    grpo_comm_mode: str = field(
        default=DEFAULT_MODE,
        metadata={
            "help": 'How the compressed gradients are exchanged. `"allgather"`: every rank\'s message to every rank '
            '(per-rank bytes grow as `W - 1`, `W` the number of workers); `"allreduce"`: compressed reduce-scatter '
            "with error feedback on the owners of each chunk too, then an all-gather (per-rank bytes flat in `W`); "
            '`"auto"`: `"allgather"` at 2 workers, `"allreduce"` above.',
            "choices": list(COMM_MODE_CHOICES),
        },
    )
    grpo_dense_warmup_steps: int = field(
        default=2,
        metadata={
            "help": "Optimizer steps sent dense before compression starts (at least 2 under DDP, which rebuilds its "
            "buckets after step 1)."
        },
    )
    grpo_fsdp_error_feedback: str = field(
        default=DEFAULT_FSDP_ERROR_FEEDBACK,
        metadata={
            "help": 'FSDP2\'s compressed reduce-scatter only: where it keeps what it did not send. `"none"`: no '
            "memory (an owner's own chunk is exact, the others' quantization errors are dropped); `\"worker-bf16\"` "
            'or `"worker-int8"`: every rank keeps the residual of the chunks it sends, in bf16 or 8-bit blocks '
            "(memory that does not shrink with the number of ranks). `docs/engines.md` has the measurement behind "
            "the default.",
            "choices": list(ERROR_FEEDBACK_CHOICES),
        },
    )
    grpo_min_compress_numel: int = field(
        default=DEFAULT_MIN_NUMEL,
        metadata={
            "help": "Tensors with fewer elements (norms, biases) are always sent dense (DDP; FSDP2 compresses every "
            "gradient of a unit alike)."
        },
    )
    grpo_max_consecutive_skips: int = field(
        default=8,
        metadata={
            "help": "Where GRPO's codec or sync touches the gradients (compression on, or `grpo_sync_every > 1`): stop "
            "the run after this many optimizer steps in a row skipped for NaN/Inf gradients; 0: never stop. Such a "
            "step is skipped (a transient overflow does not end a run, and the residuals stay clean); the error that "
            "stops the run (`grpo_hf.errors.GRPOError`) names the step, groups and parameters. Without a codec or "
            "sync such a step is the Trainer's (taken, with a warning), and nothing stops. Not applied under an fp16 "
            "`GradScaler`, which skips and rescales itself."
        },
    )
    # --- sync every H steps (grpo_hf.compression.outer_sync) ---
    grpo_sync_every: int = field(
        default=1,
        metadata={
            "help": "`H`, the optimizer steps between syncs (DiLoCo); 1: the gradients are exchanged at every step. "
            "Above 1, under DDP: the inner steps exchange nothing, and every `H` optimizer steps the ranks average "
            "their pseudo-gradient `delta = theta_global - theta_local` (in `grpo_sync_bits` codes with error feedback) and take "
            "an outer SGD step with Nesterov momentum; every rank restarts from `theta_global`. On one process (nothing "
            "to exchange) only the outer step is added. Under FSDP2 with replica groups (HSDP's "
            "`ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)`, the machine count, or "
            "`grpo_hf.replica_groups.shard_replica_groups`) FSDP2 shards each replica over its `S` ranks and "
            "reduce-scatters every step inside it, and the `R` replicas sync every `H` steps, each rank its local "
            "shards (`docs/engines.md`). DeepSpeed, tensor and context parallelism and fp16 mixed precision are "
            "refused with `H > 1`. For fine-tunes `32`, the other sync fields at their defaults; from scratch `8` "
            '(`docs/compression.md`, "Sync every H steps", has the measured cost of both). The fewest bytes on a '
            "fine-tune: `H` at or above `max_steps` with `grpo_sync_ramp=False`, one sync at the last step "
            '(`docs/compression.md`, "A thousand times fewer bytes").'
        },
    )
    grpo_sync_bits: str = field(
        default=DEFAULT_SYNC_BITS,
        metadata={
            "help": "With `grpo_sync_every > 1`: bits per entry of the pseudo-gradient `delta` the ranks exchange at a "
            'sync. `"ternary"`, `2`, `4`, `8` or `16` (or a code\'s own value): codes in blocks of 128 with one '
            "scale each, and error feedback (what a sync did not send is added to the next one's `delta`); `32`: fp32, "
            'no codes (so does `grpo_compression="none"`). `"ternary"` sends the levels of the per-step '
            "`grpo_bits=2` (`-1`, `0`, `+1` times the block's absmax), 5 per byte: 1.875 bits per entry with the "
            "scale; `2` sends four levels (`+-1/3`, `+-1` times the absmax), 2.25 bits per entry with the scale, so it "
            "is not the per-step `grpo_bits=2`, which is ternary. Tensors below `grpo_min_compress_numel` and a "
            "group file's `bits: 32` go in fp32. The default is the one that measured best for fine-tunes on the "
            "benchmark suite (`docs/compression.md`): as good as 8 bits best against best, at half the bytes. "
            "`grpo_bits` sets the per-step codes only, which the sync does not send.",
            "choices": SYNC_BITS_CHOICES,  # the registered codes' values (compression/codes/), read at each use
        },
    )
    grpo_sync_fragments: int = field(
        default=1,
        metadata={
            "help": "With `grpo_sync_every > 1`: GRPO's groups packed into this many fragments of balanced size, each "
            "syncing at its own offset of the `H` steps, so that the bytes of a sync are spread over the interval "
            "(Streaming DiLoCo); at most `grpo_sync_every`. A group larger than one fragment's share is split by "
            "parameter."
        },
    )
    grpo_sync_ramp: bool = field(
        default=DEFAULT_SYNC_RAMP,
        metadata={
            "help": "With `grpo_sync_every > 1`: sync after steps 1, 3, 7, ... (intervals doubling up to `H`) before "
            "the first full interval."
        },
    )
    grpo_sync_delay: int = field(
        default=DEFAULT_SYNC_DELAY,
        metadata={
            "help": "With `grpo_sync_every > 1`: `tau`, the inner steps a fragment's exchange runs behind (Streaming "
            "DiLoCo's overlap, torchft's `fragment_sync_delay`); 0: the exchange blocks the step that syncs. Above "
            "0, a fragment's exchange starts at its sync step and runs while the next `tau` inner steps compute; its "
            "outer step is applied `tau` steps later and merged with the local parameters as `grpo_sync_mix` says. "
            "Needs `tau < grpo_sync_every / grpo_sync_fragments`; the ramp's syncs and the last step's wait at once."
        },
    )
    grpo_sync_mix: float = field(
        default=DEFAULT_SYNC_MIX,
        metadata={
            "help": "With `grpo_sync_delay > 0`: `alpha` in [0, 1] (torchft's `fragment_update_alpha`). A fragment's "
            "parameters become `(1 - alpha) theta_global + alpha theta_local` when its delayed outer step is applied, so the local "
            "steps taken while the exchange ran are kept in part; 0 restarts from `theta_global` (those steps are "
            "dropped)."
        },
    )
    grpo_sync_moments: str = field(
        default=DEFAULT_SYNC_MOMENTS,
        metadata={
            "help": "With `grpo_sync_every > 1`: the inner optimizer's moments averaged over the ranks at every sync "
            'of a fragment, for its parameters, in place: `"none"` (each rank\'s AdamW state stays its own), '
            '`"second"` (`exp_avg_sq`, as hivemind does) or `"both"` (`exp_avg` and `exp_avg_sq`), so that every '
            "rank continues from the same moments. One blocking fp32 all-reduce per moment and sync "
            "(`2 (W - 1) / W * 4 n` bytes each, `n` the fragment's entries). Needs `grpo_sync_delay=0` and an "
            "Adam-like optimizer of torch (Adam, AdamW, NAdam, RAdam). Opt-in: on the suite it narrows the gap to "
            "DDP at many more bytes (`docs/compression.md`).",
            "choices": list(SYNC_MOMENTS),
        },
    )
    grpo_sync_outer_lr: float = field(
        default=DEFAULT_OUTER_LR,
        metadata={
            "help": "With `grpo_sync_every > 1`: learning rate of the outer SGD step (Nesterov momentum). The "
            "defaults, 1 and `grpo_sync_outer_momentum=0`, are plain parameter averaging (accelerate's `LocalSGD`), "
            "chosen best against best on the benchmark suite over the outer step of the prototype (0.7, 0.5); "
            "DiLoCo's published 0.7 / 0.9 is for large models and many steps."
        },
    )
    grpo_sync_outer_momentum: float = field(
        default=DEFAULT_OUTER_MOMENTUM,
        metadata={
            "help": "With `grpo_sync_every > 1`: Nesterov momentum of the outer step, in [0, 1) (the defaults: see "
            "`grpo_sync_outer_lr`)."
        },
    )
    grpo_sync_global_dtype: str = field(
        default=DEFAULT_SYNC_DTYPE,
        metadata={
            "help": "With `grpo_sync_every > 1`: dtype of `theta_global` and the outer momentum, two copies of the "
            'trainable parameters. `"bfloat16"` halves them, and every sync restarts the model from bf16 values: '
            "for training from scratch; a fine-tune at a small learning rate loses its pretrained weights' low bits "
            "and updates smaller than bf16's spacing.",
            "choices": list(SYNC_DTYPE_CHOICES),
        },
    )
    grpo_sync_global_device: str = field(
        default=DEFAULT_SYNC_GLOBAL_DEVICE,
        metadata={
            "help": 'With `grpo_sync_every > 1`: where `theta_global` and the outer momentum live. `"cpu"`: pinned '
            "memory when the parameters are on an accelerator, streamed to the parameters' device one fragment row "
            'at a time for the sync, as torchft and INTELLECT-1 do; `"parameters"`: beside the parameters; '
            '`"auto"`: `"cpu"` when the parameters are on an accelerator, with the parameters otherwise. The outer '
            'step always runs on the parameters\' device, so every choice gives the same bits; `"cpu"` frees 4 '
            "(fp32) or 8 (with momentum) bytes per trainable entry of accelerator memory, for two host-device "
            "copies of each row per sync.",
            "choices": list(SYNC_GLOBAL_DEVICE_CHOICES),
        },
    )
    grpo_sync_outer_only: bool = field(
        default=False,
        metadata={
            "help": "With `grpo_sync_every > 1`: keep DDP's fp32 all-reduce of the gradients at every step and add "
            "only the outer step every `H` steps: a control that saves no bytes (it separates the outer optimizer's "
            'effect from the savings). Needs `grpo_compression` `"none"` or `"auto"`.'
        },
    )
    grpo_sync_density: float = field(
        default=DEFAULT_SYNC_DENSITY,
        metadata={
            "help": "With `grpo_sync_every > 1`: `k / C`, in (0, 1]; 1: the sync sends every entry of `delta` "
            "(`grpo_sync_bits` codes). Below 1 (SparseLoCo, `grpo_hf.compression.codes.ChunkTopKCode`): of every "
            "chunk of `grpo_sync_chunk` entries of `delta +` the residual, only the `k = ceil(density * C)` of largest "
            "magnitude are sent, as 2-bit codes (sign and one of two magnitudes fitted to the chunk) with their "
            "positions in `log2 C` bits; the rest waits in the residual. SparseLoCo's `64 / 4096 = 0.015625` sends "
            "`4 + 64 (2 + 12) / 8 = 116` bytes per chunk of 4,096 entries where 4-bit codes send 2,176. Its "
            "messages are all-gathered whatever the number of ranks `W` (no owner reduction): each rank sends "
            "`(W - 1)` messages per sync, bytes that grow linearly with `W`. Needs `grpo_sync_bits` and "
            '`grpo_compression` at their defaults (or `grpo_compression="quantize"`); tensors the sync sends dense '
            "stay dense, and a group file's other `bits` give way to it. On short fine-tunes most of `delta` is still "
            "in the residual when training ends (`docs/compression.md`)."
        },
    )
    grpo_sync_chunk: int = field(
        default=DEFAULT_SYNC_CHUNK,
        metadata={
            "help": "With `grpo_sync_density < 1`: `C`, the entries per chunk of the sparse sync code, a power of two "
            "from 2 to 65536 (positions cost `log2 C` bits each). Each tensor's last chunk is zero-padded, and its "
            "padding is never sent in place of a non-zero entry."
        },
    )
    grpo_sync_error_decay: float = field(
        default=DEFAULT_SYNC_ERROR_DECAY,
        metadata={
            "help": "With `grpo_sync_every > 1`: `beta` in (0, 1]; each sync sends the codes of `delta + beta r` and keeps what "
            "they did not carry as the new residual `r`. SparseLoCo's error-feedback accumulator takes 0.95, with "
            "`grpo_sync_outer_momentum=0` (the accumulator stands in for the outer momentum). 1 keeps the error "
            "feedback whole, bit for bit as before; below 1 what stays unsent fades instead of piling up. Needs "
            'codes (not `grpo_sync_bits=32` or `grpo_compression="none"` at density 1).'
        },
    )

    # --- fault-tolerant replica groups (torchft; grpo_hf.fault_tolerance) ---
    grpo_fault_tolerance: bool = field(
        default=False,
        metadata={
            "help": "This launch is one replica group of a fault-tolerant run: the sync every `H` steps runs between "
            "the groups (each its own `torchrun` / `accelerate launch`, or one process) through torchft's "
            "lighthouse and process group. A group that dies is left out and the others go on without restarting; "
            "a restarted or new group heals from a live one at the next sync. Needs `grpo_sync_every > 1`, "
            "`grpo_sync_delay=0` and torchft (`pip install 'grpo_hf[peers]'`); `docs/engines.md`, \"Surviving a "
            'lost machine", has the how-to.'
        },
    )
    grpo_ft_lighthouse: str | None = field(
        default=None,
        metadata={
            "help": "The torchft lighthouse's address (`torchft_lighthouse --bind [::]:29510`), e.g. "
            "`http://10.0.0.1:29510`; `TORCHFT_LIGHTHOUSE` when unset."
        },
    )
    grpo_ft_replica_id: int | None = field(
        default=None,
        metadata={
            "help": "This replica group's id, 0 to `grpo_ft_replicas - 1`, its own: it picks the group's part of the "
            "data. `GRPO_HF_REPLICA_ID` when unset."
        },
    )
    grpo_ft_replicas: int | None = field(
        default=None,
        metadata={
            "help": "The replica groups the run is planned for: the data is split into that many parts, one per "
            "replica id."
        },
    )
    grpo_ft_min_replicas: int = field(
        default=1,
        metadata={
            "help": "A sync is kept only when at least this many replica groups took part (torchft's "
            "`min_replica_size`)."
        },
    )
    grpo_ft_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Seconds a collective of the sync or a heal may take before a peer is given up "
            "(`TORCHFT_TIMEOUT_SEC`)."
        },
    )
    grpo_ft_quorum_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Seconds a replica group waits at a quorum for the others, e.g. a restarted group for the live "
            "groups' next sync (`TORCHFT_QUORUM_TIMEOUT_SEC`)."
        },
    )
    grpo_ft_hostname: str | None = field(
        default=None,
        metadata={
            "help": "The address other replica groups reach this one's manager at, to heal from it; the machine's "
            "name when unset (the loopback address for a lighthouse on the loopback)."
        },
    )
    grpo_ft_take_over: bool = field(
        default=True,
        metadata={
            "help": "With `grpo_fault_tolerance`: the live replica groups train the batches of the planned groups "
            "that are away, so that every batch of the run is trained once, as without a fault. At each step those "
            "of the absent groups (each by one live group in turn), and after a sync that lost a group's local "
            "steps, that group's batches of the window, spread over the next one (`grpo_hf.replica_shares`). The "
            "price is time: while one group of `R` is away each live one trains `R / (R - 1)` batches a step (in "
            "micro-batches of the usual size). False: a lost group's batches are not trained (torchft's DiLoCo)."
        },
    )

    # --- deprecated names of the sync's fields (one release; see DEPRECATED_FIELDS) ---
    grpo_outer_lr: float | None = field(
        default=None,
        metadata={"help": "Deprecated: the old name of grpo_sync_outer_lr (removed in the next release)."},
    )
    grpo_outer_momentum: float | None = field(
        default=None,
        metadata={"help": "Deprecated: the old name of grpo_sync_outer_momentum (removed in the next release)."},
    )
    grpo_outer_dtype: str | None = field(
        default=None,
        metadata={"help": "Deprecated: the old name of grpo_sync_global_dtype (removed in the next release)."},
    )
    grpo_outer_control: bool | None = field(
        default=None,
        metadata={"help": "Deprecated: the old name of grpo_sync_outer_only (removed in the next release)."},
    )

    # --- removed settings: refused with the reason (see REMOVED_FIELDS) ---
    grpo_scale_gradients: bool | None = field(
        default=None, metadata={"help": "Removed (measured worse: benchmarks/LOG.md); setting it is an error."}
    )
    grpo_scale_beta: float | None = field(
        default=None, metadata={"help": "Removed with grpo_scale_gradients; setting it is an error."}
    )
    grpo_scale_clip: float | None = field(
        default=None, metadata={"help": "Removed with grpo_scale_gradients; setting it is an error."}
    )

    # --- optimizer state (grpo_hf.optim) ---
    # (No argparse "choices": a removed preset, 'mini' or 'mini8', reaches check_optimizer_state and its own error.)
    grpo_optimizer_state: str = field(
        default=DEFAULT_OPTIMIZER_STATE,
        metadata={
            "help": "How much optimizer state each group keeps: "
            + ", ".join(f'`"{name}"`' for name in OPTIMIZER_STATE_CHOICES)
            + '. `"full"`: the optimizer the arguments choose (`optim`), with its own state, as the Trainer builds '
            "it. Otherwise GRPO's `grpo_hf.optim.GroupedAdamW` with AdamW's settings (`learning_rate`, `adam_beta1`, "
            "`adam_beta2`, `adam_epsilon`, `weight_decay`) keeps less state, chosen per group: "
            + "; ".join(f'`"{name}"`: {preset.help}' for name, preset in STATE_PRESETS.items())
            + " A group file's `state` and `state_bits` override the preset per group. Norms, biases, LoRA and "
            'tensors under `grpo_min_state_numel` entries keep a full state. Needs `optim` `"adamw_torch"` (or '
            '`"adamw_torch_fused"`); refused under DeepSpeed. What each setting measured, in state bytes and quality: '
            '`docs/memory.md` (`"mini"` and `"mini8"`, Adam-mini\'s blocks, were measured there and removed).',
        },
    )
    grpo_min_state_numel: int = field(
        default=DEFAULT_MIN_STATE_NUMEL,
        metadata={
            "help": "Tensors with fewer entries (norms, biases) keep a full fp32 optimizer state whatever "
            "`grpo_optimizer_state` says."
        },
    )

    def __post_init__(self):
        check_backends(self.fsdp, self.fsdp_config, self.deepspeed)  # before transformers sets the backend up
        validate_grpo_fields(self)
        super().__post_init__()


# Deprecated field -> its new name: accepted for one release (a FutureWarning), then removed.
DEPRECATED_FIELDS = {
    "grpo_outer_lr": "grpo_sync_outer_lr",
    "grpo_outer_momentum": "grpo_sync_outer_momentum",
    "grpo_outer_dtype": "grpo_sync_global_dtype",
    "grpo_outer_control": "grpo_sync_outer_only",
}
# Removed field -> why, and what runs instead: set to any value (as a deprecated name is said whatever its value), one
# ConfigError. Kept as fields (default None) so that Python, a recipe file and the command line all reach that error.
REMOVED_FIELDS = {
    "grpo_scale_gradients": SCALES_REMOVED,
    "grpo_scale_beta": SCALES_REMOVED,
    "grpo_scale_clip": SCALES_REMOVED,
}


def grpo_field_names() -> list[str]:
    """
    Names of the fields that `GRPOConfig` adds to `TrainingArguments`: the `grpo_*` fields, then the `cost_*` ones (the
    deprecated names of [`DEPRECATED_FIELDS`] and the removed ones of [`REMOVED_FIELDS`] left out: they are no
    settings of their own).
    """
    base = {f.name for f in dataclasses.fields(TrainingArguments)} | set(DEPRECATED_FIELDS) | set(REMOVED_FIELDS)
    names = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in base]
    return sorted(names, key=lambda name: name.startswith("cost_"))  # stable: declaration order within each


# The headings of the parameter sections in GRPOConfig's docstring, by the first field of each section.
SECTIONS = {
    "grpo_groups": "Parameters that control grouping:",
    "grpo_importance": "Parameters that control importance-based learning-rate scaling:",
    "grpo_compression": "Parameters that control gradient compression (see [`~grpo_hf.compression`]):",
    "grpo_sync_every": "Parameters that control the sync every H steps (DiLoCo; see `docs/compression.md` and "
    "[`~grpo_hf.compression.outer_sync`]):",
    "grpo_fault_tolerance": 'Parameters of fault-tolerant replica groups (torchft; see "Surviving a lost machine" in '
    "`docs/engines.md` and [`~grpo_hf.fault_tolerance`]):",
    "grpo_optimizer_state": "Parameters that control the optimizer's memory (see `docs/memory.md` and "
    "[`~grpo_hf.optim`]):",
    "cost_gpu_hour_usd": "Parameters that control cost accounting (declared once, in [`~grpo_hf.cost.prices.CostFields`]; "
    "see also [`~grpo_hf.cost.CostSettings`]):",
}
append_field_docs(GRPOConfig, grpo_field_names(), SECTIONS)


def grpo_defaults() -> dict:
    """Default value of every field that `GRPOConfig` adds to `TrainingArguments`."""
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in set(grpo_field_names())}


def ensure_grpo_args(args: TrainingArguments) -> TrainingArguments:
    """Give a plain `TrainingArguments` the GRPO defaults (in place) so that `GRPOTrainer` accepts it as is."""
    if not isinstance(args, GRPOConfig):
        for name, value in grpo_defaults().items():
            if not hasattr(args, name):
                setattr(args, name, value)
        validate_grpo_fields(args)
    return args


@functools.cache
def _field_kinds() -> dict[str, tuple[type | None, bool]]:
    """
    Per field `GRPOConfig` adds: `bool`, `int` or `float` when that is its one type (else `None`: checked by
    [`validate_grpo_fields`]), and whether `None` is allowed.
    """
    hints = typing.get_type_hints(GRPOConfig)
    kinds = {}
    for name in grpo_field_names():
        args = set(typing.get_args(hints[name])) or {hints[name]}
        scalar = next((kind for kind in (bool, int, float) if kind in args), None)
        kinds[name] = (scalar if args - {type(None)} == {scalar} else None), type(None) in args
    return kinds


def _resolve_deprecated_fields(args) -> None:
    """
    A deprecated field that is set ([`DEPRECATED_FIELDS`]) gives its value to the field of its new name, with a
    `FutureWarning`, and is set back to `None` (so that a second check warns no more). A removed field that is set
    ([`REMOVED_FIELDS`]) is refused.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: both names set, to different values; a removed field set.
    """
    for name, why in REMOVED_FIELDS.items():
        value = getattr(args, name, None)
        if value is not None:
            raise ConfigError(f"{name}={value!r}: {why} Drop {name} from your settings.")
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for old, new in DEPRECATED_FIELDS.items():
        value = getattr(args, old, None)
        if value is None:
            continue
        current = getattr(args, new, defaults[new])
        if current != defaults[new] and current != value:
            raise ConfigError(
                f"{old}={value!r} and {new}={current!r}: {old} is the deprecated name of {new}; set {new} alone."
            )
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release: use {new} (the same setting).",
            FutureWarning,
            stacklevel=4,
        )
        setattr(args, new, value)
        setattr(args, old, None)


def _check_types(args) -> None:
    """
    The type of every boolean and numeric field `GRPOConfig` adds, by name, whatever built the object (Python, a JSON
    or YAML config, the command line): a quoted number (`grpo_density="0.1"`), a list or a bool where a number
    belongs is refused here, instead of failing later without the field's name.
    """
    for name, (kind, optional) in _field_kinds().items():
        value = getattr(args, name, None)
        if kind is None or (value is None and optional):
            continue
        quoted = " (a quoted string: write the value without quotes)" if isinstance(value, str) else ""
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: use true or false{quoted}.")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name}={value!r}: use a whole number{quoted}.")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value):
            raise ConfigError(f"{name}={value!r}: use a number{quoted}.")


def validate_grpo_fields(args) -> None:
    """
    Check the fields `GRPOConfig` adds to `TrainingArguments` on any object that has them (a `GRPOConfig`, a
    `TrainingArguments` given the defaults, the namespace of `grpo-hf groups`), parse `grpo_lr_ratios` from JSON, and
    read and validate the group file.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: a field's value is invalid; the message names the field and the fix.
        [`~grpo_hf.errors.GroupConfigError`]: the group file is missing or invalid; the message names the file.
    """
    _resolve_deprecated_fields(args)
    _check_types(args)
    if isinstance(args.grpo_lr_ratios, str):
        try:
            args.grpo_lr_ratios = json.loads(args.grpo_lr_ratios)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"grpo_lr_ratios={args.grpo_lr_ratios!r} is not valid JSON ({err}); give e.g. "
                "'{\"*lora_B\": 4}' (a mapping of group-name patterns to ratios)."
            ) from None
    check_lr_ratios(args.grpo_lr_ratios)
    check_preset(args.grpo_lr_preset)
    if args.grpo_importance_score not in SCORE_CHOICES:
        raise ConfigError(f"grpo_importance_score={args.grpo_importance_score!r}: use one of {SCORE_CHOICES}.")
    if not 0 < args.grpo_lr_scale_min <= 1 <= args.grpo_lr_scale_max:
        raise ConfigError(
            f"grpo_lr_scale_min={args.grpo_lr_scale_min}, grpo_lr_scale_max={args.grpo_lr_scale_max}: the bounds must "
            "satisfy 0 < min <= 1 <= max so that multipliers can average to 1 (e.g. 0.9 and 1.1)."
        )
    if not 0 <= args.grpo_lr_scale_ema < 1:
        raise ConfigError(f"grpo_lr_scale_ema={args.grpo_lr_scale_ema}: use a value in [0, 1), e.g. 0.9.")
    if args.grpo_lr_scale_warmup_steps < 0:
        raise ConfigError(f"grpo_lr_scale_warmup_steps={args.grpo_lr_scale_warmup_steps}: use 0 or more.")
    transport_settings(args)  # the codec's, the sync's and fault tolerance's fields: every rule in one place
    check_optimizer_state(args.grpo_optimizer_state)
    if args.grpo_min_state_numel < 0:
        raise ConfigError(f"grpo_min_state_numel={args.grpo_min_state_numel}: use 0 or more.")
    check_optimizer_state_settings(args)
    if args.grpo_max_consecutive_skips < 0:
        raise ConfigError(f"grpo_max_consecutive_skips={args.grpo_max_consecutive_skips}: use 0 (never stop) or more.")
    try:
        CostSettings.from_args(args)  # validates the cost_* fields
    except ValueError as err:
        raise ConfigError(str(err)) from None
    load_group_spec(args.grpo_groups)  # a missing or invalid group file fails here, naming the file
