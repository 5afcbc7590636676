"""What GRPO needs of the engine a Trainer runs on: DDP, FSDP2 (`fully_shard`) or DeepSpeed ZeRO.

- **Settings** ([`check_backends`]): FSDP2 and DeepSpeed ZeRO 1/2/3 are accepted; FSDP1, ZeRO stage 0 and a DeepSpeed
  config with an `"optimizer"` or `"scheduler"` block are refused before any work, with what to change.
- **FSDP2**: `fully_shard` replaces every parameter by a new `DTensor` parameter (same name), so GRPO's groups follow
  the sharded model by name ([`follow_parameters`]), and a group's gradient norm is the square root of the sum, over
  the shards of the FSDP mesh, of each rank's local sum of squares ([`sum_over_shards`]: gathered and added in rank
  order, so every rank gets the same bits).
- **DeepSpeed**: ZeRO steps the optimizer GRPO built (its param groups survive; ZeRO swaps their parameters for flat
  fp32 partitions) inside `accelerator.backward`, before any Trainer callback runs. [`OptimizerStepProbe`] therefore
  hooks that optimizer's `step`: it reads each group's partition of the gradient as ZeRO steps it (sums of squares,
  and the dot products with Adam's `exp_avg` for the coherence score) and applies each group's LR factor for that
  step only. The sums are gathered over the ranks after the step, so importance multipliers computed from step `t`
  apply from step `t + 1` on (one step later than under DDP and FSDP2; the scores are smoothed over ~10 steps anyway).
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError
from .optim.moments import first_moment


logger = logging.getLogger(__name__)

ENGINES = ("single", "ddp", "fsdp2", "deepspeed")
_FALSE = ("", "false", "no", "0", "none")


# ----------------------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------------------


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


def detect_engine(trainer) -> str:
    """
    The engine a Trainer trains on: `"deepspeed"`, `"fsdp2"` (Accelerate's FSDP plugin at version 2, or a model sharded
    with `fully_shard` before it reached the Trainer, e.g. loaded with transformers' `DistributedConfig`), `"ddp"`
    (several processes otherwise) or `"single"`.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: the Trainer runs FSDP1, or DeepSpeed with a config GRPO refuses.
    """
    if trainer.is_deepspeed_enabled:
        plugin = trainer.accelerator.state.deepspeed_plugin
        check_deepspeed_config(plugin.deepspeed_config, "the DeepSpeed config")
        return "deepspeed"
    if trainer.is_fsdp_enabled:
        version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            origin = engine_from_environment("fsdp", trainer.args)
            if origin:
                raise ConfigError(
                    f"Accelerate's FSDP plugin is at version {version} (FSDP1), and GRPOTrainer runs on FSDP2 only."
                    + origin
                    + " To train with FSDP, use FSDP2: `fsdp` and `fsdp_config={'version': 2}` in the arguments."
                )
            refuse_fsdp1(f"Accelerate's FSDP plugin is at version {version}")
        return "fsdp2"
    if trainer.model is not None and has_fsdp2_units(trainer.model):
        return "fsdp2"
    accelerator = trainer.accelerator
    if accelerator.num_processes > 1 and accelerator.distributed_type.value.startswith("MULTI_"):
        return "ddp"
    return "single"


def process_rank(args) -> tuple[int, int]:
    """
    This process's rank and the world size: torch.distributed's when it is initialized (Accelerate's state reports
    process 0 on every rank of a DeepSpeed run on CPU), else the Trainer arguments' `process_index` and `world_size`.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return args.process_index, args.world_size


def deepspeed_zero_stage(trainer) -> int:
    """The ZeRO stage of a Trainer running DeepSpeed."""
    return check_deepspeed_config(trainer.accelerator.state.deepspeed_plugin.deepspeed_config, "the DeepSpeed config")


# ----------------------------------------------------------------------------------------------------------------
# FSDP2
# ----------------------------------------------------------------------------------------------------------------


def has_fsdp2_units(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model` or one of its submodules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def canonical_name(name: str) -> str:
    """A parameter name without the prefixes that wrappers add (`torch.compile`, activation checkpointing)."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
    return name.replace("._orig_mod", "").removeprefix("_orig_mod.")


def follow_parameters(groups, model: nn.Module) -> bool:
    """
    Point every [`~grpo_hf.grouping.ParameterGroup`] at `model`'s parameters of the same (canonical) names, in place;
    returns whether any parameter object changed (as `fully_shard` replaces them by `DTensor` parameters).

    Raises:
        `ValueError`: a grouped parameter is not in `model` (the model was changed after GRPO grouped it).
    """
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    changed = False
    for group in groups:
        missing = [n for n in group.param_names if canonical_name(n) not in named]
        if missing:
            raise ValueError(
                f"GRPO group {group.name!r}: the prepared model has no parameter {missing[0]!r} (of {len(missing)} "
                "missing): the model was changed after GRPOTrainer grouped its parameters. Build the trainer with the "
                "final model."
            )
        params = [named[canonical_name(n)] for n in group.param_names]
        changed |= any(a is not b for a, b in zip(params, group.params))
        group.params = params
    return changed


def load_into_shards(model: nn.Module, folder: str) -> bool:
    """
    Load a checkpoint's `model.safetensors` (whole tensors, as `save_model` writes them) into a model FSDP2 sharded
    before the Trainer (loaded with transformers' `DistributedConfig`, or [`~grpo_hf.replica_groups.shard_replica_groups`]):
    each rank keeps its shards (torch's `set_model_state_dict` with `full_state_dict=True`). The Trainer's own resume
    copies whole tensors into `DTensor` parameters, which fails. Returns `False` (nothing loaded) for a model without
    FSDP2 units or a checkpoint without that file (the Trainer's resume then runs as usual).
    """
    path = os.path.join(folder, "model.safetensors")
    if not has_fsdp2_units(model) or not os.path.isfile(path):
        return False
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, load_file(path), options=StateDictOptions(full_state_dict=True, strict=False))
    return True


from .optim.moments import local_tensor  # noqa: E402  (this rank's part of a DTensor; defined where moments are read)


def shard_groups(param: torch.Tensor) -> tuple:
    """
    The process groups over which `param` is sharded (one per `Shard` dimension of its mesh; `()` for a plain or a
    replicated tensor): summing a local partial sum over them gives the sum over the whole tensor.
    """
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    groups = []
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            groups.append(param.device_mesh.get_group(dim))
        elif placement.is_partial():
            raise ValueError("a Partial DTensor parameter: GRPO expects FSDP2's Shard / Replicate placements.")
    return tuple(groups)


def ordered_sum(value: torch.Tensor, group) -> torch.Tensor:
    """The sum of `value` over the ranks of `group`, added in rank order: the same bits on every rank."""
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def sum_over_shards(partials: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """
    Add up local partial sums (float64) keyed by [`shard_groups`] of the parameters they come from: each is summed over
    its groups ([`ordered_sum`]), then the keys are added in their insertion order. Every rank must pass the same keys in
    the same order (build them from the parameters, not from which gradients exist).
    """
    total = None
    for groups, value in partials.items():
        for group in groups:
            value = ordered_sum(value, group)
        total = value if total is None else total + value
    return total


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed
# ----------------------------------------------------------------------------------------------------------------


class OptimizerStepProbe:
    r"""
    Step hooks on the optimizer DeepSpeed ZeRO steps (the one GRPO built; ZeRO calls its `step` once per param group or
    sub-group, with that group's flat fp32 partition and its gradient, already averaged, unscaled and clipped).

    Before each such `step`: adds each group's local sums (squared gradient; with `coherence`, gradient . `exp_avg` and
    squared `exp_avg`) and multiplies each group's learning rate by `factors[group name]`; after it, puts the learning
    rates back (the scheduler's values: the factors never compound). [`OptimizerStepProbe.pop`] gathers the sums of
    the steps since the last call over the ranks.

    Args:
        optimizer (`torch.optim.Optimizer`): the optimizer whose param groups carry `grpo_group`.
        names (`list[str]`): the GRPO group names, in the order of the importance state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: list[str]):
        self.index = {name: i for i, name in enumerate(names)}
        self.factors: dict[str, float] = {}
        self.coherence = False
        self._sums = torch.zeros(len(names), 4, dtype=torch.float64)  # |g|^2, g . m, |m|^2, groups with a moment
        self._steps = 0
        self._saved: list[tuple[dict, float]] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        for group in optimizer.param_groups:
            name = group.get("grpo_group")
            if name not in self.index or not group["params"]:
                continue
            row = self._sums[self.index[name]]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.detach().float()
                row[0] += float(torch.linalg.vector_norm(grad)) ** 2
                moment = first_moment(optimizer, param) if self.coherence else None
                if moment is not None:
                    row[1] += float((grad * moment.float()).sum())
                    row[2] += float(torch.linalg.vector_norm(moment.float())) ** 2
                    row[3] += 1
            factor = self.factors.get(name, 1.0)
            if factor != 1.0:
                self._saved.append((group, group["lr"]))
                group["lr"] = group["lr"] * factor

    def _post(self, optimizer, args, kwargs) -> None:
        for group, lr in self._saved:
            group["lr"] = lr
        self._saved.clear()

    def pop(self, process_group=None) -> torch.Tensor | None:
        """
        The sums of the optimizer steps since the last call, added over all ranks in rank order (`[G, 4]` float64, the
        same on every rank), or `None` when no rank stepped (e.g. an fp16 overflow step DeepSpeed skipped). A
        collective: every rank calls it once per optimizer step.
        """
        local = torch.cat([self._sums.reshape(-1), torch.tensor([float(self._steps)], dtype=torch.float64)])
        self._sums.zero_()
        self._steps = 0
        total = ordered_sum(local, process_group) if dist.is_available() and dist.is_initialized() else local
        if total[-1] == 0:
            return None
        return total[:-1].reshape(-1, 4)


__all__ = [
    "ENGINES",
    "backend_enabled",
    "OptimizerStepProbe",
    "canonical_name",
    "check_backends",
    "check_deepspeed_config",
    "deepspeed_zero_stage",
    "detect_engine",
    "engine_from_environment",
    "follow_parameters",
    "fsdp_version",
    "has_fsdp2_units",
    "launched_fsdp_version",
    "load_into_shards",
    "local_tensor",
    "ordered_sum",
    "process_rank",
    "shard_groups",
    "sum_over_shards",
]
