"""Replica groups: the sync every H steps between machines without a fast link, FSDP2 inside each.

The layout is a 2-D mesh, replicate × shard: `R` replicas (machines), each sharded by FSDP2 over its `S` ranks (the
machine's GPUs, its own fast link), which reduce-scatter every step. The replicate dimension sends nothing between
syncs: every `H` steps each rank exchanges `Δ` of its local shards over its replicate group (the `R` ranks holding the
same shard index) with the DDP sync's codec, owner reduction, fragments, overlap, NaN flag and outer step
([`~grpo_hf.compression.outer_sync.OuterSyncState`] with [`~grpo_hf.compression.replicas.ReplicaGroups`]).

How a Trainer user asks for it (`docs/engines.md` has the launch lines), with `grpo_sync_every=H`:

- **On GPUs**, Accelerate's FSDP plugin (`fsdp` with `fsdp_config={"version": 2}`, or `accelerate launch` with
  `fsdp_version: 2`) and `parallelism_config=ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)`: that is HSDP,
  whose `fully_shard` would get the `("dp_replicate", "dp_shard_cp")` mesh and all-reduce over the replicas every step.
  GRPOTrainer gives `fully_shard` the shard dimension only ([`shard_within_replicas`]): HSDP's per-step replicate
  all-reduce becomes the sync. Without a `parallelism_config`, the launch's machine count is `R` and each machine's
  processes are `S` ([`parallelism_for_machines`]).
- **Anywhere, CPU included**, a model sharded before the Trainer by [`shard_replica_groups`] (Accelerate's FSDP plugin
  needs a GPU): it builds the mesh, shards over the shard dimension only, and marks the model as transformers marks
  one sharded at load time, so that the Trainer neither wraps nor shards it again.

Refused before any work, with what to do: tensor, context or sequence parallelism (a replica's shards would not line up
rank by rank), a model sharded at load time with transformers' `DistributedConfig(dp_replicate_size=R)` (HSDP built
before GRPO sees it), and a parameter FSDP2 does not shard inside its replica. DeepSpeed and fp16 are refused by
`GRPOConfig`. One replica has nothing to sync: a warning, and only the outer step is added.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .compression.replicas import REPLICATE_DIM, SHARD_DIM, ReplicaGroups
from .compression.settings import check_replica_parallelism
from .engine_settings import launched_fsdp_version
from .errors import ConfigError


REPLICA_GROUPS_ATTR = "grpo_replica_groups"  # set on a model by shard_replica_groups


def machine_count(environ=None) -> tuple[int, int]:
    """`(machines, processes per machine)` of the launch: `WORLD_SIZE / LOCAL_WORLD_SIZE` and `LOCAL_WORLD_SIZE`."""
    environ = os.environ if environ is None else environ
    world = int(environ.get("WORLD_SIZE", 1))
    local = int(environ.get("LOCAL_WORLD_SIZE", world)) or world
    return max(1, world // local), local


def parallelism_for_machines(args, environ=None):
    """
    The replica groups of a launch on several machines when neither the arguments nor the launcher give any:
    Accelerate's `ParallelismConfig(dp_replicate_size=machines, dp_shard_size=processes per machine)`, for FSDP2 (`fsdp`
    in the arguments, or `accelerate launch` with `fsdp_version: 2`) with `grpo_sync_every > 1`; `None` otherwise (one
    machine, no FSDP, or a `parallelism_config` given, by the arguments or by `accelerate launch
    --parallelism_config_*`).
    """
    environ = os.environ if environ is None else environ
    if getattr(args, "grpo_sync_every", 1) <= 1 or getattr(args, "parallelism_config", None) is not None:
        return None
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return None  # accelerate launch --parallelism_config_dp_replicate_size ... gave one
    fsdp = getattr(args, "fsdp", None)
    by_arguments = fsdp and str(fsdp).strip().lower() not in ("", "false", "no", "none")
    if not (by_arguments or launched_fsdp_version(environ) == "2"):
        return None
    machines, local = machine_count(environ)
    if machines < 2:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=machines, dp_shard_size=local)


_SHARD_ONLY_CLASSES: dict[type, type] = {}


def _shard_only(config_class: type) -> type:
    """`config_class` whose `fsdp_dim_names` leaves the replicate dimension out (one subclass per class)."""
    if config_class not in _SHARD_ONLY_CLASSES:

        class ShardWithinReplicas(config_class):
            @property
            def fsdp_dim_names(self):
                # FSDP2 over the shard dimensions only: the replicate dimension is GRPO's sync every H steps
                return [name for name in super().fsdp_dim_names if name != REPLICATE_DIM]

        ShardWithinReplicas.__name__ = ShardWithinReplicas.__qualname__ = f"ShardWithinReplicas{config_class.__name__}"
        _SHARD_ONLY_CLASSES[config_class] = ShardWithinReplicas
    return _SHARD_ONLY_CLASSES[config_class]


def shard_within_replicas(parallelism_config) -> bool:
    """
    Make Accelerate's HSDP config (`dp_replicate_size > 1`) give `fully_shard` the shard dimensions only, before
    `accelerator.prepare` shards the model: each replica is sharded over its own ranks, and nothing is all-reduced over
    the replicas at every step. Returns whether the config was changed. The mesh, the data loaders' split (every rank its
    own batches) and everything else Accelerate reads of the config stay as they are.
    """
    if parallelism_config is None or not getattr(parallelism_config, "dp_replicate_enabled", False):
        return False
    if type(parallelism_config) not in _SHARD_ONLY_CLASSES.values():
        parallelism_config.__class__ = _shard_only(type(parallelism_config))
    return True


def shard_replica_groups(model, replicas: int, device_type: str | None = None, **fully_shard_kwargs):
    r"""
    Shard `model` for the sync every H steps between `replicas` replica groups, before it reaches the Trainer: a mesh
    `(replicas, world_size / replicas)` named `("dp_replicate", "dp_shard")`, and FSDP2's `fully_shard` over the shard
    dimension only, on every module of `model._no_split_modules` (a transformers model's decoder layers) and on the
    root. The path for CPUs, where Accelerate's FSDP plugin does not run; on GPUs `ParallelismConfig` does the same
    through the Trainer.

    The model is marked as transformers marks a model it sharded at load time (`DistributedConfig`), so that the
    Trainer neither wraps nor shards it again, and it keeps its replica groups for GRPOTrainer. As for such models,
    the Trainer then saves the model only (`save_only_model=True`); GRPO's per-rank files hold each rank's local
    shards and optimizer state, so that a resume is exact (a constant learning-rate schedule, or one GRPO restarts
    the same way: the Trainer saves no scheduler for such models).

    Example (`torchrun --nproc_per_node 4 train.py`: 2 replicas × 2 shards, gloo on CPU):

    ```python
    >>> import torch.distributed as dist
    >>> from grpo_hf import GRPOConfig, GRPOTrainer, shard_replica_groups

    >>> dist.init_process_group("gloo")
    >>> model = shard_replica_groups(AutoModelForCausalLM.from_pretrained(path), replicas=2)
    >>> args = GRPOConfig("out", use_cpu=True, grpo_sync_every=32, save_only_model=True)
    >>> GRPOTrainer(model=model, args=args, train_dataset=train).train()
    ```

    Args:
        model (`torch.nn.Module`): the model, whole, the same on every rank (the sync starts every replica from
            replica 0's shards).
        replicas (`int`): `R`, dividing the world size; each replica has `S = world_size / R` ranks, at least 2
            (one rank per replica is DDP: train it with DDP and `grpo_sync_every`).
        device_type (`str`, *optional*): of the mesh; `"cuda"` when CUDA is available, else `"cpu"`.
        fully_shard_kwargs: passed to every `fully_shard` (e.g. `mp_policy`, `reshard_after_forward`).

    Returns:
        The model, sharded in place.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: torch.distributed is not initialized, `replicas` does not divide the world
            size, or leaves one rank per replica.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "shard_replica_groups needs torch.distributed initialized (torchrun, then init_process_group)."
        )
    world = dist.get_world_size()
    if replicas < 1 or world % replicas:
        raise ConfigError(f"replicas={replicas} does not divide the world size {world}: use a divisor of it.")
    shards = world // replicas
    if shards < 2:
        raise ConfigError(
            f"replicas={replicas} on {world} processes leaves one rank per replica: that is DDP. Train the whole model "
            "with DDP and grpo_sync_every instead, or use fewer replicas."
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = init_device_mesh(device_type, (replicas, shards), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh[SHARD_DIM], **fully_shard_kwargs)
    fully_shard(model, mesh=mesh[SHARD_DIM], **fully_shard_kwargs)
    setattr(model, REPLICA_GROUPS_ATTR, ReplicaGroups.from_mesh(mesh))
    if hasattr(model, "_is_distributed_loading_by_transformers"):  # a transformers model: sharded before the Trainer
        from transformers.distributed import DistributedConfig

        model._is_distributed_loading_by_transformers = True  # the Trainer's test; pinned: transformers < 5.30
        model.config.distributed_config = DistributedConfig(fsdp_size=shards)  # its sharding, inside a replica
    return model


def _single_replica() -> ReplicaGroups:
    """The layout of one replica (FSDP2 over every rank): a replicate group of one rank each (made collectively)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for member in range(world):
        group = dist.new_group([member])
        if member == rank:
            mine = group
    return ReplicaGroups(
        replicate_group=mine, shard_group=dist.group.WORLD, replicate_ranks=[[r] for r in range(world)]
    )


def find_replica_groups(model, accelerator, every: int = 2) -> ReplicaGroups:
    """
    The replica groups a Trainer's FSDP2 run syncs between: those [`shard_replica_groups`] gave the model, or those of
    Accelerate's `ParallelismConfig` (`dp_replicate_size`, whose `fully_shard` [`shard_within_replicas`] keeps inside
    each replica); otherwise one replica (FSDP2 over every rank: nothing to sync). `every`: `grpo_sync_every`, for the
    messages.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: tensor parallelism, or a model sharded at load time as HSDP
            (`DistributedConfig(dp_replicate_size=R)`).
    """
    marked = getattr(model, REPLICA_GROUPS_ATTR, None)
    if marked is not None:
        return marked
    if (getattr(model, "tp_size", None) or 1) > 1:
        raise ConfigError(
            "grpo_sync_every > 1 with a model loaded with tensor parallelism: the sync exchanges each rank's local "
            "shards with the same shards of the other replicas. Load it without tp_size, and shard it with "
            "grpo_hf.shard_replica_groups (or Accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size))."
        )
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if (getattr(distributed_config, "dp_replicate_size", 1) or 1) > 1:
        raise ConfigError(
            f"grpo_sync_every > 1 with a model sharded at load time as HSDP (DistributedConfig(dp_replicate_size="
            f"{distributed_config.dp_replicate_size})): its replicas all-reduce their gradients at every step, which the "
            "sync every H steps replaces. Load the model whole and shard it with grpo_hf.shard_replica_groups(model, "
            "replicas=R) (docs/engines.md), or set grpo_sync_every=1 to train HSDP."
        )
    config = getattr(accelerator, "parallelism_config", None)
    check_replica_parallelism(config, every)  # (one from `accelerate launch --parallelism_config_*` too)
    if config is not None and getattr(config, "dp_replicate_enabled", False):
        mesh = accelerator.torch_device_mesh
        return ReplicaGroups.from_mesh(mesh[(REPLICATE_DIM, SHARD_DIM)])
    return _single_replica()


__all__ = [
    "REPLICA_GROUPS_ATTR",
    "check_replica_parallelism",
    "find_replica_groups",
    "machine_count",
    "parallelism_for_machines",
    "shard_replica_groups",
    "shard_within_replicas",
]
