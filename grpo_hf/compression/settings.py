"""The transports' settings: `GRPOConfig`'s fields turned into typed settings, every rule of them checked in one place.

[`transport_settings`] reads the `grpo_*` fields of the codec, of the sync every H steps and of fault-tolerant replica
groups, and returns them as a [`TransportSettings`]: [`CodecSettings`] (what every step sends) and [`SyncSettings`]
(the sync every H steps). It is the one place each rule is checked and each refusal raised, as torch's
`PowerSGDState` validates its settings once: `GRPOConfig` calls it when it is built (before any model is loaded), the
trainer again with what only a trainer knows (its engine, its processes, its groups), and the transports are built
from its typed settings as they are ([`~grpo_hf.compression.build.build_comm_state`]). Its parts, in order:

1. the codec's fields (and [`check_comm_settings`], the ranges the transports also take as arguments);
2. fault-tolerant replica groups (`grpo_ft_*`: what they need of the sync);
3. the sync's fields ([`check_sync_settings`], the ranges [`~grpo_hf.compression.outer_sync.OuterSyncState`] also
   takes as arguments), what `grpo_sync_every=1` leaves no room for, what the sync needs of the codec, and the
   training arguments it cannot run with (fp16, tensor or context parallelism: [`check_replica_parallelism`]);
4. the engine, when known: DeepSpeed, FSDP2's compressed reduce-scatter, FSDP2's and fault-tolerant replica groups.

The values of the code settings (`grpo_bits`, `grpo_sync_bits`) are those the registered codes declare
([`~grpo_hf.compression.codes.SettingValues`]), and [`TransportSettings.plan`] asks the registry which code each value
selects: a new code needs no edit here.
"""

from dataclasses import dataclass, fields, replace

from ..choices import (
    DEFAULT_BITS,
    DEFAULT_SYNC_BITS,
    DEFAULT_SYNC_CHUNK,
    DEFAULT_SYNC_ERROR_DECAY,
    DEFAULT_SYNC_GLOBAL_DEVICE,
    ERROR_FEEDBACK_CHOICES,
    SYNC_DTYPE_CHOICES,
    SYNC_GLOBAL_DEVICE_CHOICES,
    SYNC_MOMENTS,
)
from ..engine_settings import backend_enabled, engine_from_environment
from ..errors import ConfigError
from .codes import SettingValues, code_for, setting_spec
from .plan import compression_plan, resolve_compression, resolve_mode, sparse_sync_plan
from .spec import CodecSpec, num_kept


BITS_CHOICES = SettingValues("grpo_bits", first=("auto",))  # "auto": the article's, 4 or 8 bits by module type
SYNC_BITS_CHOICES = SettingValues("grpo_sync_bits")


@dataclass(frozen=True)
class CodecSettings:
    """
    What the transports of every step send: `grpo_compression` (resolved for the engine when it is known: `"auto"`
    then reads `"quantize"` or `"none"`), `grpo_bits`, `grpo_density`, `grpo_comm_mode`, `grpo_dense_warmup_steps`,
    `grpo_min_compress_numel` and `grpo_fsdp_error_feedback`, checked by [`transport_settings`].
    """

    compression: str
    bits: str
    density: float
    mode: str
    dense_warmup_steps: int
    min_numel: int
    error_feedback: str


@dataclass(frozen=True)
class SyncSettings:
    """
    The sync every H steps: the `grpo_sync_*` fields (`every` is H, 1 when there is no sync) and `grpo_fault_tolerance`,
    by the names [`~grpo_hf.compression.outer_sync.OuterSyncState`] gives its arguments, checked by
    [`transport_settings`].
    """

    every: int
    bits: str
    fragments: int
    ramp: bool
    delay: int
    mix: float
    moments: str
    outer_lr: float
    outer_momentum: float
    dtype: str
    global_device: str
    outer_only: bool
    density: float
    chunk: int
    error_decay: float
    fault_tolerance: bool

    @property
    def on(self) -> bool:
        """Whether the ranks sync every H steps (`grpo_sync_every > 1`)."""
        return self.every > 1


@dataclass(frozen=True)
class TransportSettings:
    """The typed settings of the transports ([`transport_settings`] makes them): the codec's and the sync's."""

    codec: CodecSettings
    sync: SyncSettings

    def plan(self, model, groups) -> dict:
        """
        How each trainable parameter of `model` is sent ([`~grpo_hf.compression.compression_plan`]; the codec's
        compression resolved first): in the per-step codes `grpo_bits` selects, or with the sync in those of
        `grpo_sync_bits`, or SparseLoCo's chunked top-k below `grpo_sync_density` 1. A value of a code setting is
        turned into its spec by the registry ([`~grpo_hf.compression.codes.setting_spec`]).
        """
        codec, sync = self.codec, self.sync
        setting, value = ("grpo_sync_bits", sync.bits) if sync.on else ("grpo_bits", codec.bits)
        bits, code = ("auto", None) if value == "auto" else setting_spec(setting, value)
        plan = compression_plan(model, groups, codec.compression, codec.density, bits, codec.min_numel, code=code)
        return sparse_sync_plan(plan, sync.density, sync.chunk) if sync.on and sync.density < 1 else plan


# The settings' keys as the check functions name them, and their fields.
_COMM_FIELDS = {"dense_warmup_steps": "grpo_dense_warmup_steps", "error_feedback": "grpo_fsdp_error_feedback"}
# (`grpo_sync_<key>`, but for two)
_SYNC_FIELDS = {field.name: f"grpo_sync_{field.name}" for field in fields(SyncSettings)}
_SYNC_FIELDS.update(dtype="grpo_sync_global_dtype", fault_tolerance="grpo_fault_tolerance")


def transport_settings(args, engine: str | None = None, num_processes: int = 1, groups=None) -> TransportSettings:
    """
    `args`' fields of the transports as typed settings, every rule of them checked (see the module docstring).

    Args:
        args: a `GRPOConfig`, or any object with its `grpo_*` fields (and `fp16`, `deepspeed`, `parallelism_config`
            where it has them).
        engine (`str`, *optional*): `"single"`, `"ddp"`, `"fsdp2"` or `"deepspeed"`, the trainer's. `None`: what the
            arguments say of it (DeepSpeed when `deepspeed` is set). Given, `grpo_compression` is resolved for it.
        num_processes (`int`, *optional*, defaults to `1`): the processes of the run (with `engine`).
        groups (`list[ParameterGroup]`, *optional*): GRPO's groups, whose own `bits` / `density` FSDP2 refuses.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: a value outside its range, two values that do not fit together, or one the
            engine cannot carry; the message names the fields and how to fix them.
    """
    codec = CodecSettings(
        compression=args.grpo_compression,
        bits=str(args.grpo_bits),
        density=args.grpo_density,
        mode=args.grpo_comm_mode,
        dense_warmup_steps=args.grpo_dense_warmup_steps,
        min_numel=args.grpo_min_compress_numel,
        error_feedback=args.grpo_fsdp_error_feedback,
    )
    _check_codec(args, codec)
    sync = SyncSettings(**{key: getattr(args, field) for key, field in _SYNC_FIELDS.items()})
    sync = replace(sync, bits=str(sync.bits))
    _check_fault_tolerance(args, sync)
    _check_sync(args, sync, codec)
    if engine is None and backend_enabled(getattr(args, "deepspeed", None)):
        engine = "deepspeed"
    if engine is not None:
        distributed = engine == "ddp" or (engine == "fsdp2" and num_processes > 1) or sync.fault_tolerance
        codec = replace(codec, compression=resolve_compression(codec.compression, distributed))
        _check_engine(args, engine, num_processes, groups or [], codec, sync)
    return TransportSettings(codec, sync)


# --- 1. the codec ---------------------------------------------------------------------------------------------------


def check_comm_settings(name=str, **settings) -> None:
    """
    The ranges of the compression's settings its states take as arguments, each given one named as `name(key)` says:
    `dense_warmup_steps` ([`~grpo_hf.compression.GRPOCommState`]'s argument) and `error_feedback`
    ([`~grpo_hf.compression.fsdp.FSDPCommState`]'s); [`transport_settings`] passes the fields' names.

    Raises:
        [`~grpo_hf.errors.ConfigError`] (a `ValueError`): a value outside its range; the message names it.
    """
    if "dense_warmup_steps" in settings and settings["dense_warmup_steps"] < 0:
        raise ConfigError(f"{name('dense_warmup_steps')}={settings['dense_warmup_steps']}: use 0 or more.")
    if "error_feedback" in settings and settings["error_feedback"] not in ERROR_FEEDBACK_CHOICES:
        raise ConfigError(
            f"{name('error_feedback')}={settings['error_feedback']!r}: use one of {ERROR_FEEDBACK_CHOICES}."
        )


def _check_codec(args, codec: CodecSettings) -> None:
    resolve_compression(codec.compression, distributed=True)  # (each refuses a value it does not know)
    resolve_mode(codec.mode, 2)
    if not 0 < codec.density <= 1:
        raise ConfigError(
            f"grpo_density={codec.density}: the density is the kept fraction of gradient entries and must lie in "
            "(0, 1], e.g. 0.15 to keep the top 15%."
        )
    if codec.bits not in BITS_CHOICES:
        raise ConfigError(f"grpo_bits={args.grpo_bits!r}: use one of {BITS_CHOICES}.")
    check_comm_settings(dense_warmup_steps=codec.dense_warmup_steps, error_feedback=codec.error_feedback,
                        name=_COMM_FIELDS.get)  # fmt: skip
    if codec.min_numel < 0:
        raise ConfigError(f"grpo_min_compress_numel={codec.min_numel}: use 0 or more.")


# --- 2. fault-tolerant replica groups -------------------------------------------------------------------------------


def _check_fault_tolerance(args, sync: SyncSettings) -> None:
    """The fault-tolerance fields' own ranges and what they need of the sync (the environment is read by the trainer)."""
    if not sync.fault_tolerance:
        return
    if not sync.on:
        raise ConfigError(
            "grpo_fault_tolerance=True needs grpo_sync_every > 1: the replica groups meet at the sync every H steps "
            "(e.g. grpo_sync_every=32)."
        )
    if sync.delay:
        raise ConfigError(
            f"grpo_fault_tolerance=True with grpo_sync_delay={sync.delay}: a delayed exchange would outlive its "
            "quorum. Use grpo_sync_delay=0."
        )
    if sync.outer_only:
        raise ConfigError("grpo_fault_tolerance=True with grpo_sync_outer_only=True: the control exchanges nothing.")
    if sync.moments != "none":
        raise ConfigError(
            f"grpo_fault_tolerance=True with grpo_sync_moments={sync.moments!r}: not supported between "
            "fault-tolerant replica groups in this release. Use grpo_sync_moments='none'."
        )
    replicas = args.grpo_ft_replicas
    if replicas is not None and replicas < 1:
        raise ConfigError(f"grpo_ft_replicas={replicas}: use the number of replica groups the run is planned for.")
    if args.grpo_ft_min_replicas < 1 or (replicas is not None and args.grpo_ft_min_replicas > replicas):
        raise ConfigError(
            f"grpo_ft_min_replicas={args.grpo_ft_min_replicas} with grpo_ft_replicas={replicas}: it can never be met. "
            "Use 1 to grpo_ft_replicas (1: a lone survivor goes on)."
        )
    rid = args.grpo_ft_replica_id
    if rid is not None and (rid < 0 or (replicas is not None and rid >= replicas)):
        raise ConfigError(f"grpo_ft_replica_id={rid}: use 0 to grpo_ft_replicas - 1 ({replicas}), one per group.")
    for name in ("grpo_ft_timeout", "grpo_ft_quorum_timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"{name}={getattr(args, name)}: use a number of seconds above 0.")
    if args.grpo_ft_quorum_timeout < 2 * args.grpo_ft_timeout:
        raise ConfigError(
            f"grpo_ft_quorum_timeout={args.grpo_ft_quorum_timeout:g} with grpo_ft_timeout={args.grpo_ft_timeout:g}: "
            "a group waits at a quorum for survivors that may each give a dead peer up twice (the exchange and its "
            "retry) before they come; give grpo_ft_quorum_timeout at least twice grpo_ft_timeout (docs/engines.md, "
            "'Timeouts')."
        )


# --- 3. the sync every H steps --------------------------------------------------------------------------------------


def check_sync_settings(every, fragments, delay, mix, moments, outer_lr, outer_momentum, dtype,
                        global_device=DEFAULT_SYNC_GLOBAL_DEVICE, error_decay=DEFAULT_SYNC_ERROR_DECAY,
                        name=str) -> None:  # fmt: skip
    """
    The ranges of the sync's own settings, each named as `name(key)` says: `"every"`, `"fragments"` (a count),
    `"delay"`, `"mix"`, `"moments"`, `"outer_lr"`, `"outer_momentum"`, `"dtype"` (a name of `SYNC_DTYPE_CHOICES`,
    or a torch dtype), `"global_device"` (one of `SYNC_GLOBAL_DEVICE_CHOICES`) and `"error_decay"` (in `(0, 1]`) are
    the arguments of [`~grpo_hf.compression.outer_sync.OuterSyncState`]; [`transport_settings`] passes the fields'
    names.

    Raises:
        [`~grpo_hf.errors.ConfigError`] (a `ValueError`): a value outside its range, or two that do not fit together;
            the message names them.
    """
    for key, value in (("every", every), ("fragments", fragments)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name(key)}={value!r}: use a whole number, 1 or more.")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ConfigError(f"{name('delay')}={delay!r}: use a whole number of steps, 0 (no overlap) or more.")
    for key, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum), ("mix", mix),
                       ("error_decay", error_decay)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"{name(key)}={value!r}: use a number.")
    if not 0 < outer_lr < float("inf"):
        raise ConfigError(f"{name('outer_lr')}={outer_lr}: use a positive number (1 with momentum 0 averages).")
    if not 0 <= outer_momentum < 1:
        raise ConfigError(f"{name('outer_momentum')}={outer_momentum}: use a value in [0, 1), e.g. 0.5.")
    if not 0 < error_decay <= 1:
        raise ConfigError(
            f"{name('error_decay')}={error_decay}: use a value in (0, 1] (1 keeps the error feedback whole; SparseLoCo "
            "decays it by 0.95 per sync)."
        )
    if str(dtype).replace("torch.", "") not in SYNC_DTYPE_CHOICES:
        raise ConfigError(f"{name('dtype')}={dtype!r}: use one of {SYNC_DTYPE_CHOICES}.")
    if not isinstance(global_device, str) or global_device not in SYNC_GLOBAL_DEVICE_CHOICES:
        raise ConfigError(
            f"{name('global_device')}={global_device!r}: use one of {SYNC_GLOBAL_DEVICE_CHOICES} ('auto': pinned CPU "
            "memory when the parameters are on an accelerator, with the parameters otherwise)."
        )
    if fragments > every:
        raise ConfigError(
            f"{name('fragments')}={fragments} with {name('every')}={every}: each fragment syncs at its own step of the "
            f"H steps, so use at most {name('every')} fragments."
        )
    if not 0 <= mix <= 1:
        raise ConfigError(
            f"{name('mix')}={mix}: use a value in [0, 1] (0 takes the global model, 1 keeps the local parameters, 0.5 "
            "weighs them equally)."
        )
    if delay > 0 and delay * fragments >= every:
        raise ConfigError(
            f"{name('delay')}={delay} with {name('every')}={every} and {name('fragments')}={fragments}: a fragment's "
            "exchange must end before the next fragment's starts, so use a delay below "
            f"{name('every')} / {name('fragments')} = {every / fragments:g}."
        )
    if not isinstance(moments, str) or moments not in SYNC_MOMENTS:
        raise ConfigError(f"{name('moments')}={moments!r}: use one of {tuple(SYNC_MOMENTS)}.")
    if moments != "none" and delay > 0:
        raise ConfigError(
            f"{name('moments')}={moments!r} with {name('delay')}={delay}: the moments are averaged by the blocking "
            f"syncs only. Set {name('delay')}=0, or {name('moments')}='none'."
        )


def check_replica_parallelism(parallelism_config, every: int) -> None:
    """
    With `grpo_sync_every > 1`, refuse an Accelerate `ParallelismConfig` with tensor, context or sequence parallelism
    (the arguments', and one from `accelerate launch --parallelism_config_*`, which the trainer finds).

    Raises:
        [`~grpo_hf.errors.ConfigError`]: naming the size that is set and what to do.
    """
    if every <= 1 or parallelism_config is None:
        return
    for name in ("tp_size", "cp_size", "sp_size"):
        size = getattr(parallelism_config, name, 1) or 1
        if size > 1:
            raise ConfigError(
                f"grpo_sync_every={every} with parallelism_config.{name}={size}: the sync every H steps exchanges each "
                "rank's local shards with the ranks holding the same shards in the other replicas, and tensor, "
                "context or sequence parallelism cuts a replica in other ways. Use dp_replicate_size (the replicas) "
                "and dp_shard_size (FSDP2 inside each) only, or set grpo_sync_every=1."
            )


def _check_sync(args, sync: SyncSettings, codec: CodecSettings) -> None:
    """The sync's own fields, what `grpo_sync_every=1` (no sync) leaves no room for, what the sync needs of the codec
    and what it cannot run with."""
    every, delay, moments = sync.every, sync.delay, sync.moments
    if every == 1 and delay != 0:
        raise ConfigError(
            f"grpo_sync_delay={delay} needs grpo_sync_every > 1: it delays the sync every H steps, and "
            f"grpo_sync_every={every} exchanges the gradients at every step."
        )
    if every == 1 and moments in SYNC_MOMENTS and moments != "none":
        raise ConfigError(
            f"grpo_sync_moments={moments!r} needs grpo_sync_every > 1: it averages the optimizer's moments at the sync "
            f"every H steps, and grpo_sync_every={every} keeps them identical (DDP averages the gradients every step)."
        )
    check_sync_settings(every, sync.fragments, delay, sync.mix, moments, sync.outer_lr, sync.outer_momentum,
                        sync.dtype, sync.global_device, sync.error_decay, name=_SYNC_FIELDS.get)  # fmt: skip
    if sync.bits not in SYNC_BITS_CHOICES:
        raise ConfigError(
            f"grpo_sync_bits={args.grpo_sync_bits!r}: use one of {SYNC_BITS_CHOICES} (bits per entry of the "
            "pseudo-gradient at a sync; 'ternary' sends trits, 1.6 bits each; 32 is fp32)."
        )
    _check_sparse_sync(sync, codec)
    if every == 1:
        if sync.outer_only:
            raise ConfigError("grpo_sync_outer_only=True needs grpo_sync_every > 1 (the steps between outer steps).")
        if sync.bits != DEFAULT_SYNC_BITS:
            raise ConfigError(
                f"grpo_sync_bits={sync.bits} needs grpo_sync_every > 1: it sets the codes of the sync every H steps. "
                "For the codes exchanged at every step, set grpo_bits."
            )
        return
    if "sparse" in codec.compression:
        raise ConfigError(
            f"grpo_compression={codec.compression!r} with grpo_sync_every={every}: the sync sends every entry of "
            "the pseudo-gradient in codes of one size. Use grpo_compression='auto' (codes of grpo_sync_bits) or "
            "'none' (fp32)."
        )
    if codec.bits != DEFAULT_BITS:
        raise ConfigError(
            f"grpo_bits={args.grpo_bits!r} with grpo_sync_every={every}: grpo_bits sets the codes exchanged at every "
            "step, and the sync every H steps exchanges none. Set the pseudo-gradient's codes with grpo_sync_bits "
            f"({', '.join(SYNC_BITS_CHOICES)}), and leave grpo_bits at its default."
        )
    if codec.compression == "none" and sync.bits != DEFAULT_SYNC_BITS:
        raise ConfigError(
            f"grpo_sync_bits={sync.bits} with grpo_compression='none': 'none' sends the pseudo-gradient in fp32. Use "
            "one of the two: grpo_compression='auto' with grpo_sync_bits, or grpo_compression='none'."
        )
    if sync.outer_only and codec.compression not in ("none", "auto"):
        raise ConfigError(
            f"grpo_sync_outer_only=True with grpo_compression={codec.compression!r}: the control keeps DDP's own "
            "fp32 all-reduce of the gradients. Set grpo_compression='none'."
        )
    check_replica_parallelism(getattr(args, "parallelism_config", None), every)
    if getattr(args, "fp16", False):
        raise ConfigError(
            f"grpo_sync_every={every} with fp16=True: between syncs each rank's fp16 GradScaler would skip steps on its "
            "own gradients. Use bf16=True (or fp32), or grpo_sync_every=1."
        )


def _check_sparse_sync(sync: SyncSettings, codec: CodecSettings) -> None:
    """`grpo_sync_density`, `grpo_sync_chunk` and `grpo_sync_error_decay` (its range is [`check_sync_settings`]'s):
    their own ranges, and the settings they need of the sync."""
    density, chunk, decay, every, sync_bits = sync.density, sync.chunk, sync.error_decay, sync.every, sync.bits
    if not 0 < density <= 1:
        raise ConfigError(
            f"grpo_sync_density={density}: use a value in (0, 1], the kept fraction of each chunk (1: every entry; "
            "SparseLoCo's 64 of 4096 is 0.015625)."
        )
    if chunk < 2 or chunk > 1 << 16 or chunk & (chunk - 1):
        raise ConfigError(f"grpo_sync_chunk={chunk}: use a power of two from 2 to 65536, e.g. 4096 (SparseLoCo's).")
    sparse = density < 1
    if not sparse and chunk != DEFAULT_SYNC_CHUNK:
        raise ConfigError(
            f"grpo_sync_chunk={chunk} with grpo_sync_density=1: the chunks are the sparse sync code's. Set "
            "grpo_sync_density below 1 (e.g. 0.015625, 64 of 4096), or leave grpo_sync_chunk at its default."
        )
    for value, field_name in ((density, "grpo_sync_density"), (decay, "grpo_sync_error_decay")):
        if every == 1 and value != 1:
            raise ConfigError(
                f"{field_name}={value} needs grpo_sync_every > 1: it sets the codes of the sync every H steps, and "
                f"grpo_sync_every={every} exchanges the gradients at every step."
            )
    if every == 1:
        return
    bits, code = setting_spec("grpo_sync_bits", sync_bits)
    fp32 = CodecSpec(bits=bits, code=code).lossless
    compression = codec.compression
    if sparse:
        k = num_kept(chunk, density)
        if k >= chunk:
            raise ConfigError(
                f"grpo_sync_density={density} with grpo_sync_chunk={chunk} keeps all {chunk} entries of a chunk. Use a "
                f"density below {(chunk - 1) / chunk:g}, or 1 for the dense codes of grpo_sync_bits."
            )
        if compression == "none" or "sparse" in compression:
            raise ConfigError(
                f"grpo_sync_density={density} with grpo_compression={compression!r}: the sparse sync code needs the "
                "sync's codes. Use grpo_compression='auto' or 'quantize'."
            )
        if sync_bits != DEFAULT_SYNC_BITS:
            raise ConfigError(
                f"grpo_sync_density={density} with grpo_sync_bits={sync_bits}: grpo_sync_bits"
                f"{' asks for fp32 values,' if fp32 else ''} sets the dense codes, and the sparse sync code sends its "
                "kept values in 2-bit codes. Leave grpo_sync_bits at its default, or set grpo_sync_density=1."
            )
    elif decay != 1 and (fp32 or compression == "none"):
        raise ConfigError(
            f"grpo_sync_error_decay={decay} with "
            f"{f'grpo_sync_bits={sync_bits}' if fp32 else 'grpo_compression=' + repr(compression)}: the sync sends "
            "fp32 values, which keep no residual to decay. Use codes (grpo_sync_bits 4, 8 or 16, or "
            "grpo_sync_density < 1), or leave grpo_sync_error_decay at 1."
        )
    if sync.outer_only and (sparse or decay != 1):
        raise ConfigError(
            "grpo_sync_outer_only=True with grpo_sync_density or grpo_sync_error_decay: the control exchanges no codes. "
            "Leave both at 1."
        )


# --- 4. the engine --------------------------------------------------------------------------------------------------


def _check_engine(args, engine: str, num_processes: int, groups: list, codec: CodecSettings,
                  sync: SyncSettings) -> None:  # fmt: skip
    """What the engine cannot carry: DeepSpeed compresses nothing and has no replicas to sync; FSDP2's compressed
    reduce-scatter sends one code of one size; FSDP2's replica groups have no outer-step-only control; a fault-tolerant
    replica group is one process, or FSDP2's."""
    origin = engine_from_environment(engine, args) if engine in ("deepspeed", "fsdp2") else ""
    if engine == "deepspeed" and args.grpo_compression not in ("auto", "none"):
        raise ConfigError(
            f"grpo_compression={args.grpo_compression!r} under DeepSpeed: ZeRO reduces gradients itself, so GRPO cannot "
            "compress them. Use grpo_compression='none' (or 'auto'), or train with DDP or FSDP2 to compress." + origin
        )
    if engine == "deepspeed" and sync.on:
        raise ConfigError(
            f"grpo_sync_every={sync.every} under DeepSpeed: ZeRO reduces the gradients over every rank at every step, so "
            "there are no replicas to sync. Train with DDP (each rank a replica) or FSDP2 with replica groups "
            "(docs/engines.md), or set grpo_sync_every=1." + origin
        )
    if engine == "fsdp2" and sync.on and sync.outer_only:
        raise ConfigError(
            "grpo_sync_outer_only=True under FSDP2: the control keeps DDP's per-step all-reduce; between replica "
            "groups train HSDP with grpo_sync_every=1 as the per-step baseline."
        )
    if sync.fault_tolerance and engine not in ("single", "fsdp2"):
        raise ConfigError(
            f"grpo_fault_tolerance=True under {engine} ({num_processes} processes): each process of a DDP replica "
            "group would send the whole model. Launch one process per group, or shard the group's model with FSDP2 "
            "over its processes (grpo_hf.shard_replica_groups(model, replicas=1); docs/engines.md, 'Surviving a lost "
            "machine')."
        )
    if engine != "fsdp2" or sync.on or codec.compression == "none":
        return  # (between replica groups FSDP2 reduces with its own reduce-scatter; the sync's codes are Δ's)
    if codec.compression != "quantize":
        raise ConfigError(
            f"grpo_compression={args.grpo_compression!r} under FSDP2: its compressed reduce-scatter sends every entry "
            "(top-k messages would differ in size from rank to rank). Use 'quantize' (or 'auto'), or 'none'." + origin
        )
    if codec.bits == "auto":
        raise ConfigError(
            "grpo_bits='auto' under FSDP2: FSDP hands the reduce-scatter one flat buffer per unit, so one bit width "
            "applies to every gradient. Choose one: grpo_bits=8 (or 4, 16, 32)." + origin
        )
    bits, name = setting_spec("grpo_bits", codec.bits)
    if name is not None or not code_for(CodecSpec(bits=bits)).fixed_size:
        why = f"the {name} code is not one of the block codes it sends" if name else f"{bits}-bit codes vary in size"
        raise ConfigError(
            f"grpo_bits={codec.bits!r} under FSDP2: its reduce-scatter exchanges messages of one size in one "
            f"all-to-all, and {why}. Choose grpo_bits=8 (the default) or 4." + origin
        )
    for group in groups:
        if group.rule.bits is not None or group.rule.density is not None:
            raise ConfigError(
                f"GRPO group {group.name!r} sets its own bits/density: under FSDP2 one setting (grpo_bits) "
                "applies to every gradient. Remove 'bits' / 'density' (or 'sparsity') from the group file, or set "
                "grpo_compression='none'." + origin
            )


__all__ = [
    "BITS_CHOICES",
    "SYNC_BITS_CHOICES",
    "CodecSettings",
    "SyncSettings",
    "TransportSettings",
    "check_comm_settings",
    "check_replica_parallelism",
    "check_sync_settings",
    "transport_settings",
]
