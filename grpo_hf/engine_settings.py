"""Which engine a run's settings ask for (DDP, FSDP2, DeepSpeed ZeRO), and the refusals before any work: no torch.

- [`check_backends`]: FSDP2 and DeepSpeed ZeRO 1/2/3 are accepted; FSDP1, ZeRO stage 0 and a DeepSpeed config with an
  `"optimizer"` or `"scheduler"` block are refused with what to change, from the Trainer's arguments or what
  `accelerate launch` set.
- [`engine_from_environment`]: the engine a launch will run on, before the Trainer is built (the settings' checks,
  [`~grpo_hf.compression.settings.transport_settings`], need it early).

What the engine does at run time (FSDP2's parameters, DeepSpeed's optimizer step) is [`~grpo_hf.engines`]'s.
"""

from __future__ import annotations

import json
import os

from .errors import ConfigError


ENGINES = ("single", "ddp", "fsdp2", "deepspeed")
_FALSE = ("", "false", "no", "0", "none")


def backend_enabled(value) -> bool:
    """Whether an `fsdp` / `deepspeed` value turns the backend on (`"false"`, `""`, `[]`, `None` do not)."""
    if isinstance(value, str):
        return value.strip().lower() not in _FALSE
    return bool(value)


def _read_json(value, name: str):
    """A dict, or the content of the JSON file `value` names; `ConfigError` naming `name` when it cannot be read."""
    if value is None or isinstance(value, dict):
        return value or {}
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"{name}={value!r}: give a mapping (a dict, or a YAML mapping in a recipe) or the path of a JSON file, "
            f"not a {type(value).__name__}."
        )
    try:
        with open(value, encoding="utf-8") as handle:
            content = json.load(handle)
    except OSError as err:
        raise ConfigError(f"{name}={value!r}: cannot read the file ({err.strerror}).") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{name}={value!r}: invalid JSON at line {err.lineno}, column {err.colno} ({err.msg})."
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}={value!r}: not a UTF-8 text file; give a JSON file.") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{name}={value!r}: expected a JSON object, got {type(content).__name__}.")
    return content


def fsdp_version(fsdp_config) -> int:
    """
    The FSDP version of a Trainer `fsdp_config` (dict or JSON path; `version` or `fsdp_version`; default 2).

    Raises:
        [`~grpo_hf.errors.ConfigError`]: the version is not a whole number (`"fsdp2"`, `2.5`, `[2]`), naming it.
    """
    config = _read_json(fsdp_config, "fsdp_config")
    key = "version" if "version" in config else "fsdp_version"
    version = config.get(key, 2)
    if isinstance(version, str) and version.strip().isdigit():
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(
            f"fsdp_config={{{key!r}: {version!r}}}: the FSDP version is a number; GRPOTrainer runs on FSDP2, so give "
            f"{{{key!r}: 2}} (or leave it out: 2 is transformers' default)."
        )
    return version


def launched_fsdp_version(environ=None) -> str | None:
    """
    The FSDP version `accelerate launch` asked for (`"1"`, `"2"`), or `None` when this process was not launched with
    FSDP.

    `accelerate launch --use_fsdp` sets `ACCELERATE_USE_FSDP=true` *and* `FSDP_VERSION` for the processes it starts;
    building an `Accelerator` with an FSDP plugin (what the Trainer does for its `fsdp` argument) sets only
    `ACCELERATE_USE_FSDP`, for the rest of the process. That variable alone is therefore what an earlier trainer left
    behind, not a launch setting, and says nothing about the trainer being built now.
    """
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or "FSDP_VERSION" not in environ:
        return None
    return environ["FSDP_VERSION"]


# engine -> (the Trainer argument that asks for it, the variable Accelerate reads, `accelerate launch`'s flag, name)
_ENGINE_VARIABLES = {
    "deepspeed": ("deepspeed", "ACCELERATE_USE_DEEPSPEED", "--use_deepspeed", "DeepSpeed"),
    "fsdp": ("fsdp", "ACCELERATE_USE_FSDP", "--use_fsdp", "FSDP"),
}


def engine_from_environment(engine: str, args, environ=None) -> str:
    """
    Why a trainer whose arguments do not ask for `engine` (`"deepspeed"`, or `"fsdp"` / `"fsdp2"`) runs on it: a
    sentence (with a leading space) naming the environment variable that turned it on and how to clear it; `""` when
    the arguments ask for the engine or the variable is not set.

    Accelerate builds a DeepSpeed or FSDP plugin from `ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP` when none is
    given (transformers' `TrainingArguments` reads the first when it is built), and sets the variable itself whenever
    an `Accelerator` is built with such a plugin, for the rest of the process. So besides `accelerate launch
    --use_deepspeed` / `--use_fsdp`, an earlier Trainer of the same process (a notebook, a sweep) turns the engine on
    for every later one.
    """
    environ = os.environ if environ is None else environ
    field, variable, flag, name = _ENGINE_VARIABLES["deepspeed" if engine == "deepspeed" else "fsdp"]
    if backend_enabled(getattr(args, field, None)) or not backend_enabled(environ.get(variable, "false")):
        return ""
    when = (
        "before building the TrainingArguments / GRPOConfig (they read it when built)"
        if engine == "deepspeed"
        else "before building the trainer"
    )
    version = (
        ""
        if engine == "deepspeed" or "FSDP_VERSION" in environ
        else " (without FSDP_VERSION, so Accelerate builds an FSDP1 plugin)"
    )
    return (
        f" This trainer's arguments do not ask for {name} (`{field}` is not set): it comes from the environment "
        f"variable {variable}=true{version}, which `accelerate launch {flag}` sets, and which building any Trainer or "
        f"Accelerator with {name} leaves in os.environ for the rest of the process (an earlier run in a notebook or a "
        f'sweep). If this run should not use {name}, clear it {when}: `del os.environ["{variable}"]` (or launch '
        f"without {flag})."
    )


def refuse_fsdp1(where: str) -> None:
    raise ConfigError(
        f"{where}: GRPOTrainer runs on FSDP2 (`fully_shard`), not FSDP1, whose flat parameters hide the per-parameter "
        "groups GRPO needs. Switch to FSDP2: `fsdp_config={'version': 2}` with the Trainer's `fsdp` (transformers' "
        "default), or `fsdp_version: 2` in the accelerate config file (with `fsdp_reshard_after_forward: true` in place "
        "of `fsdp_sharding_strategy: FULL_SHARD`)."
    )


def check_deepspeed_config(config: dict, where: str) -> int:
    """
    Check a DeepSpeed config for GRPO; returns its ZeRO stage.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: an `"optimizer"` block (DeepSpeed would build one flat param group: GRPO's
            groups and their learning rates would be lost), a `"scheduler"` block (it writes one learning rate into
            every group), ZeRO stage 0 (DeepSpeed without ZeRO: use DDP), or no batch size (DeepSpeed asserts when
            the config has neither `train_batch_size` nor `train_micro_batch_size_per_gpu`, and the Trainer fills
            only values set to `"auto"`).
    """
    for block, effect in (
        ("optimizer", "DeepSpeed would build its own optimizer with one flat param group, losing GRPO's groups"),
        ("scheduler", "DeepSpeed's scheduler writes one learning rate into every param group, losing GRPO's ratios"),
    ):
        if block in config:
            raise ConfigError(
                f"{where}: the DeepSpeed config has the block {block!r} ({config[block]!r}): {effect}. Delete the "
                f"{block!r} block and choose the {block} with the Trainer's arguments (`optim`, `learning_rate`, "
                "`weight_decay`, `adam_beta1/2`, `lr_scheduler_type`, `warmup_steps`): the Trainer then builds it and "
                "ZeRO keeps GRPO's param groups."
            )
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage == "auto" or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise ConfigError(
            f"{where}: ZeRO stage {stage!r}: GRPOTrainer runs on DeepSpeed ZeRO 1, 2 or 3; set "
            '"zero_optimization": {"stage": 2} (or train with DDP, which GRPO can compress, instead of stage 0).'
        )
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        raise ConfigError(
            f"{where}: the DeepSpeed config gives no batch size, and DeepSpeed needs one: add "
            '"train_micro_batch_size_per_gpu": "auto" (the Trainer fills it from per_device_train_batch_size; '
            '"gradient_accumulation_steps": "auto" likewise).'
        )
    return stage


def check_backends(fsdp=None, fsdp_config=None, deepspeed=None, environ=None) -> None:
    """
    Refuse, before any work, an engine setting GRPOTrainer cannot run: FSDP1 (from the Trainer's `fsdp_config` or an
    `accelerate launch` FSDP config), and a DeepSpeed config (the Trainer's `deepspeed`, or `accelerate launch`'s
    `deepspeed_config_file`) that [`check_deepspeed_config`] refuses. Accepts FSDP2 and DeepSpeed ZeRO 1/2/3.

    Judged from these arguments and from what the launcher set ([`launched_fsdp_version`], and
    `ACCELERATE_DEEPSPEED_CONFIG_FILE`, which only `accelerate launch` sets): never from the variables an earlier
    trainer of the same process left in `os.environ`, so that one refused config does not refuse every later one.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: naming the field or the launcher setting, and what to change.
    """
    environ = os.environ if environ is None else environ
    if backend_enabled(fsdp):
        if backend_enabled(deepspeed):
            raise ConfigError("fsdp and deepspeed are both set: choose one engine.")
        if fsdp_version(fsdp_config) != 2:
            refuse_fsdp1(f"fsdp={fsdp!r}, fsdp_config={fsdp_config!r}")
    elif launched_fsdp_version(environ) not in (None, "2"):
        refuse_fsdp1(f"accelerate launch with FSDP version {launched_fsdp_version(environ)}")
    if backend_enabled(deepspeed):
        check_deepspeed_config(_read_json(deepspeed, "deepspeed"), f"deepspeed={deepspeed!r}")
    elif environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if path != "none":
            check_deepspeed_config(
                _read_json(path, "deepspeed_config_file"),
                f"deepspeed_config_file={path!r} (ACCELERATE_DEEPSPEED_CONFIG_FILE, set by accelerate launch)",
            )


__all__ = [
    "ENGINES",
    "backend_enabled",
    "check_backends",
    "check_deepspeed_config",
    "engine_from_environment",
    "fsdp_version",
    "launched_fsdp_version",
    "refuse_fsdp1",
]
