"""`build_comm_state`: the one place that builds a transport from the settings.

PEFT builds a LoRA layer by walking a list of dispatchers, each of which says whether it applies; the same here: each
transport of [`TRANSPORTS`] says, in its `from_settings`, whether the settings ask for it and builds itself from their
typed settings, checked once before ([`~grpo_hf.compression.settings.transport_settings`]: every rule and refusal of
the settings, the engine's included). The trainer only asks:

```python
>>> transport = transport_settings(args, engine, num_processes=W, groups=groups)  # raises a ConfigError, or is fine
>>> settings = CommSettings(transport, args, engine, plan=transport.plan(model, groups),
...                         compression=transport.codec.compression, groups=groups, num_processes=W, model=model)
>>> comm_state = build_comm_state(settings)  # None when nothing is compressed or synced
>>> plan, compression = settings.plan, settings.compression  # dense when the transport sends no codes
```

The conditions are exclusive: the sync every H steps when `grpo_sync_every > 1`; else, with compression on, FSDP2's
compressed reduce-scatter under FSDP2 and DDP's compressed exchange (or its one-process preview) otherwise.

The sync's wire is built here too, before the transport ([`sync_wire`]): under FSDP2 the replica groups of the layout
(Accelerate's mesh, a model marked by [`~grpo_hf.replica_groups.shard_replica_groups`]), and for a fault-tolerant
replica group torchft's communicator; the sync takes them from `CommSettings` as it is handed them.
"""

import logging

from ..errors import ConfigError
from .communicator import process_rank
from .fsdp import FSDPCommState
from .outer_sync import OuterSyncState
from .replicas import ReplicaGroups
from .state import GRPOCommState
from .transport import CommSettings, CommState


logger = logging.getLogger(__name__)


TRANSPORTS: tuple[type[CommState], ...] = (OuterSyncState, FSDPCommState, GRPOCommState)


def build_comm_state(settings: CommSettings) -> CommState | None:
    """
    The transport `settings` ask for, built (the first of [`TRANSPORTS`] whose `from_settings` applies), or `None`
    when none does (nothing compressed, nothing synced). The transport may make `settings.plan` dense and
    `settings.compression` `"none"` (the sync every H steps without an exchange): read them back.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: what the transport sees and cannot carry (a layout of replica groups, a
            group file's `bits` the sync cannot send).
    """
    if settings.syncing:
        settings.communicator, settings.replicas = sync_wire(settings)
    for transport in TRANSPORTS:
        state = transport.from_settings(settings)
        if state is not None:
            return state
    return None


def sync_wire(settings: CommSettings):
    """
    The wire of the sync every H steps, as `settings` ask for it: `(communicator, replicas)`. Under FSDP2 the replica
    groups of the layout (each FSDP2-sharded over its own ranks, syncing over their replicate groups); for a
    fault-tolerant replica group (`settings.fault_tolerance`) torchft's communicator ([`_fault_tolerant_wire`]);
    otherwise `settings.communicator` as given (`None`: the default process group).

    Raises:
        [`~grpo_hf.errors.ConfigError`]: a layout the sync cannot run over (tensor parallelism, HSDP sharded at load
            time, several replicas in one fault-tolerant launch).
    """
    from ..replica_groups import find_replica_groups  # (it builds the layouts' process groups: after the backend)

    replicas = None
    if settings.engine == "fsdp2":
        replicas = find_replica_groups(settings.model, settings.accelerator, settings.transport.sync.every)
    if settings.fault_tolerance is not None:  # this launch is one replica group: the sync runs between groups
        return _fault_tolerant_wire(settings, replicas)
    if replicas is not None:
        _between_replica_groups(settings.args, settings.transport.sync, replicas)
    return settings.communicator, replicas


def _fault_tolerant_wire(settings: CommSettings, replicas: ReplicaGroups | None):
    """
    The way to the wire of one fault-tolerant replica group: torchft's managed process group
    ([`~grpo_hf.compression.torchft_group.TorchFTCommunicator`]), one per rank. A group of one process syncs its whole
    model over it; a group sharded by FSDP2 over its processes syncs each rank's shards with the same shard of the
    other groups (the replica groups' layout, the launch being one replica). Returns `(communicator, replicas)`: the
    communicator of one process, or the replica groups whose replicate communicator is torchft's.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: a launch that holds several replicas itself (a DDP group was refused with the
            settings).
    """
    from .torchft_group import TorchFTCommunicator, group_store

    if settings.engine == "single":
        return TorchFTCommunicator(settings.fault_tolerance, store=group_store()), None
    if len(replicas.replicate_ranks[0]) > 1:
        raise ConfigError(
            f"grpo_fault_tolerance=True with {len(replicas.replicate_ranks[0])} replicas inside one launch: each launch "
            "is one fault-tolerant replica group. Shard the model over the launch's processes "
            "(grpo_hf.shard_replica_groups(model, replicas=1)) and start one launch per group."
        )
    shard = replicas.shard_communicator
    communicator = TorchFTCommunicator(
        settings.fault_tolerance,
        group_rank=shard.rank,
        group_world_size=shard.world_size,
        store=group_store(),
        within_group=shard,
    )
    return None, ReplicaGroups(
        replicate_group=None,
        shard_group=replicas.shard_group,
        replicate_ranks=replicas.replicate_ranks,
        mesh=replicas.mesh,
        replicate_communicator=communicator,
        shard_communicator=shard,
    )


def _between_replica_groups(args, sync, replicas: ReplicaGroups) -> None:
    """
    Between replica groups: warn when one replica leaves nothing to sync, and keep the Trainer's token count inside
    each replica (its per-step gather over every process would cross the replicate dimension at every step).
    """
    rank = process_rank(args)[0]
    if replicas.replicas == 1 and rank == 0:
        logger.warning(
            f"grpo_sync_every={sync.every} under FSDP2 with one replica group (FSDP2 shards over every "
            "process): there is nothing to sync, so only the outer step is added every H steps. For replicas, set "
            "parallelism_config=ParallelismConfig(dp_replicate_size=R, dp_shard_size=S), launch on several "
            "machines, or shard the model with grpo_hf.shard_replica_groups (docs/engines.md)."
        )
    if replicas.replicas > 1 and args.average_tokens_across_devices:
        args.average_tokens_across_devices = False
        if rank == 0:
            logger.info(
                "Replica groups: average_tokens_across_devices=False (each rank's loss is the mean over its own "
                "tokens, and FSDP2 averages a replica's shards): the Trainer's per-step gather of token counts "
                "over every process would cross the replicate dimension at every step."
            )


__all__ = ["TRANSPORTS", "CommSettings", "build_comm_state", "sync_wire"]
