"""Fault-tolerant replica groups in the Trainer: what `grpo_fault_tolerance=True` adds around the sync every H steps.

Every launch is one **replica group** (`torchrun` or `accelerate launch` on one machine, one process or several with
FSDP2 inside), and the groups meet at the sync every H steps through torchft's lighthouse
([`~grpo_hf.compression.torchft_group.TorchFTCommunicator`]). This module holds the Trainer's side of it:

- **Settings** ([`fault_tolerance_settings`]): the `grpo_ft_*` fields, with torchft's environment variables where they
  are unset (`TORCHFT_LIGHTHOUSE`, and `GRPO_HF_REPLICA_ID` for the replica id), checked before any work.
- **Data** ([`replica_data`]): each group reads its own part of the data, as if the groups' processes were the ranks of
  one DDP job (rank `replica_id × group size + group rank` of `replicas × group size`; torchtitan's split): with no
  fault, the groups see exactly the batches the ranks of a DDP run of the sync see. With `grpo_ft_take_over` (the
  default) the live groups also train the batches of the groups that are away, and those of a window a lost group's
  sync did not keep ([`~grpo_hf.replica_shares`]); a healed group goes on with its own part from the step it healed at
  (the batches the live groups' step implies).
- **Healing** ([`trainer_heal_state`], [`heal_training_state`]): what a restarted or new group receives from a live one
  beside the sync's own state (`θ_global`, outer momentum, local parameters, inner optimizer state): the trainer's step
  and epoch and the learning-rate scheduler, and GRPO's importance state and counters; then it skips the batches of
  the steps it did not take, as a resume from a checkpoint does.

Checkpoints stay per replica group (each group's `output_dir`, written by its own ranks); a run whose every group died
resumes from them as any run does, each group from its own.
"""

from __future__ import annotations

import contextlib
import os

from .compression.torchft_group import FaultTolerance
from .errors import ConfigError


REPLICA_ID_ENV = "GRPO_HF_REPLICA_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def fault_tolerance_settings(args, environ=None) -> FaultTolerance | None:
    """
    The replica group's [`~grpo_hf.compression.torchft_group.FaultTolerance`] from `args` (a `GRPOConfig`), the
    environment filling the lighthouse (`TORCHFT_LIGHTHOUSE`) and the replica id (`GRPO_HF_REPLICA_ID`); `None`
    without `grpo_fault_tolerance`.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: the lighthouse, the replica id or the planned number of groups is missing, or
            the replica id is out of range; the message names the field and the variable.
    """
    if not getattr(args, "grpo_fault_tolerance", False):
        return None
    environ = os.environ if environ is None else environ
    lighthouse = args.grpo_ft_lighthouse or environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise ConfigError(
            "grpo_fault_tolerance=True needs the lighthouse's address: set grpo_ft_lighthouse (e.g. "
            f"http://10.0.0.1:29510) or {LIGHTHOUSE_ENV}; start it with `torchft_lighthouse --bind [::]:29510 "
            "--min_replicas 1` (docs/engines.md)."
        )
    replica_id = args.grpo_ft_replica_id
    if replica_id is None and environ.get(REPLICA_ID_ENV, "").strip():
        try:
            replica_id = int(environ[REPLICA_ID_ENV])
        except ValueError:
            raise ConfigError(
                f"{REPLICA_ID_ENV}={environ[REPLICA_ID_ENV]!r}: use an integer, 0 to replicas - 1."
            ) from None
    if replica_id is None:
        raise ConfigError(
            f"grpo_fault_tolerance=True needs this replica group's id: set grpo_ft_replica_id or {REPLICA_ID_ENV} "
            "(0, 1, ... one per group)."
        )
    replicas = args.grpo_ft_replicas
    if replicas is None:
        raise ConfigError(
            "grpo_fault_tolerance=True needs grpo_ft_replicas, the number of replica groups the run is planned for "
            "(the data is split into that many parts)."
        )
    if not 0 <= replica_id < replicas:
        raise ConfigError(
            f"replica id {replica_id} with grpo_ft_replicas={replicas}: use 0 to {replicas - 1}, one per group."
        )
    return FaultTolerance(
        lighthouse=lighthouse,
        replica_id=replica_id,
        replicas=replicas,
        min_replicas=args.grpo_ft_min_replicas,
        timeout=args.grpo_ft_timeout,
        quorum_timeout=args.grpo_ft_quorum_timeout,
        hostname=args.grpo_ft_hostname,
    )


@contextlib.contextmanager
def replica_data(settings: FaultTolerance | None, replica_id: int | None = None):
    """
    Within the block, Accelerate prepares data loaders for this replica group's part of the data (or group
    `replica_id`'s): as the ranks `replica_id × group size + group rank` of `replicas × group size` (the batches a DDP
    run of that many ranks gives each). Nothing changes without fault tolerance.
    """
    if settings is None:
        yield
        return
    import accelerate.accelerator as accelerator_module

    original = accelerator_module.prepare_data_loader
    replica_id = settings.replica_id if replica_id is None else replica_id

    def for_replica(*args, **kwargs):
        size = kwargs.get("num_processes", 1) or 1
        kwargs["process_index"] = replica_id * size + (kwargs.get("process_index", 0) or 0)
        kwargs["num_processes"] = settings.replicas * size
        return original(*args, **kwargs)

    accelerator_module.prepare_data_loader = for_replica
    try:
        yield
    finally:
        accelerator_module.prepare_data_loader = original


def trainer_heal_state(trainer) -> dict:
    """
    What a healing replica group receives of `trainer` (a live group's, at the start of an interval) beside the sync's
    own state: the step, the epoch, the scheduler, and GRPO's callback state (importance, counters, the sync's state
    as a healer takes it).
    """
    scheduler = getattr(trainer, "lr_scheduler", None)
    shares, comm = trainer.grpo_replica_shares, trainer.grpo_comm_state
    return {
        "global_step": int(trainer.state.global_step),
        "epoch": trainer.state.epoch,
        "total_flos": trainer.state.total_flos,
        "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grpo": trainer.grpo_callback.state_dict(heal=True),
        # the catch-up of the window the healer opens with the others (the one closing now lost whom the sync lacked)
        "catch_up": shares.catch_up_after(trainer.state.global_step, comm.kept_members) if shares else [],
    }


def heal_training_state(state, payload: dict, num_update_steps_per_epoch: int, accumulation: int) -> tuple[int, int]:
    """
    Put a healing group's `TrainerState` at the live group's step; returns `(epochs_trained, batches to skip in the
    current epoch)`, as the Trainer computes them when it resumes from a checkpoint.
    """
    state.global_step = int(payload["global_step"])
    state.epoch = payload["epoch"]
    state.total_flos = payload["total_flos"]
    state.num_input_tokens_seen = payload["num_input_tokens_seen"]
    epochs_trained = state.global_step // max(1, num_update_steps_per_epoch)
    skipped = (state.global_step % max(1, num_update_steps_per_epoch)) * accumulation
    return epochs_trained, skipped


__all__ = [
    "LIGHTHOUSE_ENV",
    "REPLICA_ID_ENV",
    "fault_tolerance_settings",
    "heal_training_state",
    "replica_data",
    "trainer_heal_state",
]
