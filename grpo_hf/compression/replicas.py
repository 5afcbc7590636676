"""`ReplicaGroups`: the ranks the sync every H steps runs over when FSDP2 shards each replica, and what a rank keeps of
its own (local shards, optimizer state) in GRPO's per-rank files.

The layout is a 2-D mesh, replicate × shard: `R` replicas (machines), each sharded by FSDP2 over its `S` ranks (the
machine's own fast link). FSDP2 shards over the shard dimension only: its reduce-scatter stays inside a replica. The
sync every H steps ([`~grpo_hf.compression.outer_sync.OuterSyncState`]) runs over this rank's **replicate group**, the
`R` ranks that hold the same shard index, one per replica: they hold the same local shapes, so a fragment's rows (its
parameters' local shards, `Δ`, `θ_global`, the residuals) line up rank by rank, and the per-step hook's exchange (codec,
owner reduction, fragments, overlap) runs over them unchanged, at world size `R`. The whole model under DDP is the
one-shard case (`S = 1`, the replicate group is the world).

```python
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
>>> replicas = ReplicaGroups.from_mesh(mesh)
>>> replicas.replicas, replicas.shards, replicas.replicate_ranks  # R, S, every replicate group's global ranks
(2, 2, [[0, 2], [1, 3]])
```

What differs between replicas (their local shards between syncs, their optimizer states, their residuals) is saved by
each rank with `torch.save` in GRPO's per-rank files, as local tensors ([`local_optimizer_state`]), and never through
torch's distributed checkpoint (DCP): DCP dedupes the shards it believes replicated, keyed by parameter name and
offset, and the replicas' local shards have the same names and offsets with different values (pytorch #116469). What
the Trainer saves through DCP (the model) is `θ_global`, which is the same on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..optim.moments import local_tensor
from .communicator import Communicator, ProcessGroupCommunicator


REPLICATE_DIM = "dp_replicate"  # Accelerate's and transformers' name of the replicate dimension
SHARD_DIM = "dp_shard"


@dataclass
class ReplicaGroups:
    """
    The process groups of a replicate × shard layout, as this rank sees them.

    Args:
        replicate_group (`torch.distributed.ProcessGroup`): this rank's replicate group (its rank there is its
            replica's index).
        shard_group (`torch.distributed.ProcessGroup`): this rank's replica (FSDP2's shard group).
        replicate_ranks (`list[list[int]]`): every replicate group's global ranks, in shard order (the groups a state
            creates of its own are made from them, collectively).
        mesh (`torch.distributed.device_mesh.DeviceMesh`, *optional*): the 2-D mesh they come from.
        replicate_communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*): the way to the wire
            between the replicas (the sync's); `None`: a
            [`~grpo_hf.compression.communicator.ProcessGroupCommunicator`] over `replicate_group`, whose peers are
            `replicate_ranks`.
        shard_communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*): the way to the wire inside
            this rank's replica (the machine's own link: not emulated as slow); `None`: one over `shard_group`.
    """

    replicate_group: object
    shard_group: object
    replicate_ranks: list = field(default_factory=list)
    mesh: object = None
    replicate_communicator: Communicator | None = None
    shard_communicator: Communicator | None = None

    def __post_init__(self):
        if self.replicate_communicator is None:
            peers = self.replicate_ranks or None
            self.replicate_communicator = ProcessGroupCommunicator(self.replicate_group, peers=peers)
        if self.shard_communicator is None:
            self.shard_communicator = ProcessGroupCommunicator(self.shard_group, emulated=False)

    @classmethod
    def from_mesh(cls, mesh, replicate_dim: str = REPLICATE_DIM, shard_dim: str = SHARD_DIM) -> ReplicaGroups:
        """From a 2-D `DeviceMesh` whose dimensions `replicate_dim` and `shard_dim` are the replicas and the shards."""
        names = tuple(mesh.mesh_dim_names or ())
        if replicate_dim not in names or shard_dim not in names or mesh.ndim != 2:
            raise ValueError(
                f"replica groups need a 2-D mesh ({replicate_dim!r}, {shard_dim!r}); got dimensions {names} of shape "
                f"{tuple(mesh.mesh.shape)}."
            )
        ranks = mesh.mesh if names.index(replicate_dim) == 0 else mesh.mesh.T  # [R, S]
        return cls(
            replicate_group=mesh.get_group(replicate_dim),
            shard_group=mesh.get_group(shard_dim),
            replicate_ranks=[ranks[:, s].tolist() for s in range(ranks.shape[1])],
            mesh=mesh,
        )

    @property
    def replicas(self) -> int:
        """`R`."""
        return self.replicate_communicator.world_size

    @property
    def shards(self) -> int:
        """`S`."""
        return self.shard_communicator.world_size

    @property
    def replica(self) -> int:
        """This rank's replica (its rank in the replicate group)."""
        return self.replicate_communicator.rank

    @property
    def shard(self) -> int:
        """This rank's shard index (its rank in the shard group)."""
        return self.shard_communicator.rank

    def layout(self) -> dict:
        """What a checkpoint records of the layout: `replicas`, `shards`, this rank's `shard`."""
        replicas = "fault-tolerant" if self.replicate_communicator.elastic else self.replicas  # (their number varies)
        return {"replicas": replicas, "shards": self.shards, "shard": self.shard}

    def first_replica_rank(self) -> int:
        """The global rank of replica 0 that holds this rank's shard index (its files hold `θ_global` of the shard)."""
        return self.replicate_ranks[self.shard][0]

    def agree_within_replica(self, flag: bool, device) -> bool:
        """Whether `flag` is set on any rank of this replica: a max all-reduce over the shard group (the machine's
        own link; not counted in the sync's bytes between replicas)."""
        value = torch.tensor([int(flag)], device=device)
        self.shard_communicator.all_reduce(value, op=dist.ReduceOp.MAX)
        self.shard_communicator.pop_comm_ms()  # inside the replica: not the sync's time between replicas
        return bool(value.item())

    def broadcast_first_replica(self, params) -> None:
        """Every replica's local shards of `params` become replica 0's (in place): `θ` starts identical everywhere."""
        with torch.no_grad():
            for param in params:
                local = local_tensor(param.detach())
                if local.numel():
                    self.replicate_communicator.broadcast(local, src=0)

    def check_sharded(self, params: dict) -> None:
        """
        Every trainable parameter of `params` (name -> parameter) is sharded by FSDP2 over this rank's replica only (a
        1-D mesh of the shard group's ranks): the model was prepared as the layout says, not as HSDP, nothing whole.

        Raises:
            [`~grpo_hf.errors.ConfigError`]: naming the first parameter that is not.
        """
        ranks = sorted(self.shard_communicator.global_ranks())
        for name, param in params.items():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None or mesh.ndim != 1 or sorted(mesh.mesh.reshape(-1).tolist()) != ranks:
                where = "is not sharded by FSDP2" if mesh is None else f"is sharded over {mesh}"
                raise ConfigError(
                    f"{name} {where}, not over this rank's replica (ranks {ranks}): between replica groups FSDP2 "
                    "shards each replica over the shard dimension only. Shard the model with "
                    "grpo_hf.shard_replica_groups, or let GRPOTrainer prepare it (a parallelism_config with "
                    "dp_replicate_size); leave no trainable parameter outside fully_shard."
                )

    def __getstate__(self):
        """Pickled without its process groups (they belong to the processes that made them)."""
        return {"replicate_ranks": self.replicate_ranks}

    def __setstate__(self, state):
        self.replicate_group = self.shard_group = self.mesh = None
        self.replicate_communicator = self.shard_communicator = None
        self.replicate_ranks = state["replicate_ranks"]


# ----------------------------------------------------------------------------------------------------------------
# What a rank saves of its own: local tensors, never DTensors (no DCP, no dedupe)
# ----------------------------------------------------------------------------------------------------------------


def local_optimizer_state(optimizer) -> dict:
    """
    `optimizer.state_dict()` with every `DTensor` replaced by this rank's local tensor (a copy on the CPU, so that
    `torch.load(weights_only=True)` reads it back and nothing of it is shared with another rank's file), and under
    `"local_keys"` which state entries were `DTensor`s (with their global shape and stride). A plain optimizer's state
    dict is returned as torch gives it.
    """
    saved = optimizer.state_dict()
    saved["state"] = {index: dict(state) for index, state in saved["state"].items()}  # the optimizer's own dicts
    local_keys = {}
    for index, state in saved["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and hasattr(value, "to_local"):
                state[key] = value.to_local().detach().to("cpu", copy=True)
                local_keys.setdefault(index, []).append((key, list(value.shape), list(value.stride())))
    if local_keys:
        saved["local_keys"] = local_keys
    return saved


def load_local_optimizer_state(optimizer, saved: dict) -> None:
    """
    The inverse of [`local_optimizer_state`]: each entry that was a `DTensor` becomes one again, on its parameter's
    mesh and placements, with its saved shape and stride (`DTensor.from_local` needs them for uneven shards); then
    `optimizer.load_state_dict`. The other entries (`step`, plain parameters' states) load as they are.
    """
    saved = dict(saved)
    saved["state"] = {index: dict(state) for index, state in saved["state"].items()}
    local_keys = saved.pop("local_keys", {})
    if local_keys:
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's numbering
        for index, keys in local_keys.items():
            param, state = params[int(index)], saved["state"][index]
            for key, shape, stride in keys:
                local = state[key].to(local_tensor(param).device)
                state[key] = DTensor.from_local(local, param.device_mesh, param.placements, shape=torch.Size(shape),
                                                stride=tuple(stride))  # fmt: skip
    optimizer.load_state_dict(saved)


def fsdp_modules(model) -> list:
    """The `fully_shard` units of `model` (none for a model FSDP2 does not shard)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def reshard(modules) -> None:
    """
    Free the unsharded parameters FSDP2 units keep after a forward (`reshard_after_forward=False`, or an evaluation):
    written into the shards, the parameters would otherwise not be gathered again, and the next forward would read the
    stale unsharded copy.
    """
    for module in modules:
        module.reshard()


__all__ = [
    "REPLICATE_DIM",
    "SHARD_DIM",
    "ReplicaGroups",
    "fsdp_modules",
    "load_local_optimizer_state",
    "local_optimizer_state",
    "reshard",
]
