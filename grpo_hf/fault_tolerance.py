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

The Trainer's methods for all this are [`FaultToleranceMixin`]'s, which [`~grpo_hf.GRPOMixin`] mixes in.

Checkpoints stay per replica group (each group's `output_dir`, written by its own ranks); a run whose every group died
resumes from them as any run does, each group from its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from transformers.utils import logging

from .compression.fragment import global_checksum
from .compression.torchft_group import FaultTolerance
from .errors import ConfigError
from .replica_shares import TAKEN_OVER, ReplicaShares, SharedBatches


logger = logging.get_logger(__name__)
# What a healed replica group's first epoch passes the Trainer as its checkpoint: the resume's skip of trained batches
# (no RNG file is found there: each group keeps its own random state).
HEALED = "<healed from a live replica group>"


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


class FaultToleranceMixin:
    """
    The Trainer's side of fault-tolerant replica groups, mixed into [`~grpo_hf.GRPOMixin`]: this group's part of the
    data (and the absent groups' units it takes over), the first quorum at train start (a late group heals there), and
    the settings every group must agree on. Every method is the Trainer's own where fault tolerance is off.
    """

    grpo_fault_tolerance: FaultTolerance | None = None  # set by GRPOMixin.__init__, checked before any work
    grpo_replica_shares: ReplicaShares | None = None  # with grpo_ft_take_over: the units this group trains
    _grpo_shared_batches: SharedBatches | None = None  # ... and the batches of every planned group it reads
    _grpo_healed = False  # this launch healed from a live group at train start

    def _pop_taken_over(self, inputs) -> list:
        """The micro-batches of the units taken over that ride on `inputs` ([`get_batch_samples`]), taken off it; the
        step's gradient accumulation counts them (the loss's mean when it is not over `num_items_in_batch`)."""
        taken_over = inputs.pop(TAKEN_OVER, None) if isinstance(inputs, dict) else None
        if taken_over:
            self.current_gradient_accumulation_steps += len(taken_over)
        return list(taken_over or ())

    def get_train_dataloader(self):
        """[`~transformers.Trainer.get_train_dataloader`]; between fault-tolerant replica groups, this group's part of
        the data ([`~grpo_hf.fault_tolerance.replica_data`]), and with `grpo_ft_take_over` every planned group's
        read beside it ([`~grpo_hf.replica_shares.SharedBatches`])."""
        settings = self.grpo_fault_tolerance
        if settings is None or not self.args.grpo_ft_take_over:
            with replica_data(settings):
                return super().get_train_dataloader()
        loaders = []
        for replica_id in range(settings.replicas):
            with replica_data(settings, replica_id):
                loaders.append(super().get_train_dataloader())
        self._grpo_shared_batches = SharedBatches(
            loaders,
            settings.replica_id,
            self.args.gradient_accumulation_steps,
            keep_steps=2 * self.args.grpo_sync_every,
        )
        return self._grpo_shared_batches

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The Trainer's skip of the batches a resume (or a heal) already trained; [`SharedBatches`] skips its own."""
        if isinstance(dataloader, SharedBatches):
            return dataloader.skipping(num_batches)
        return super().get_resumed_dataloader(dataloader, num_batches)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """
        The Trainer's; with `grpo_ft_take_over`, the micro-batches of the units this group takes over at this step
        ([`~grpo_hf.replica_shares`]) ride on the first micro-batch (`training_step` trains them), and
        `num_items_in_batch` counts them too (the step's loss is the mean over all its tokens).
        """
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        shares = self.grpo_replica_shares
        if shares is None or self._grpo_shared_batches is None or not batch_samples:
            return batch_samples, num_items
        units = shares.extras_at(self.state.global_step + 1)
        taken_over = self._grpo_shared_batches.batches(units)
        if not taken_over:
            return batch_samples, num_items
        kept = self._grpo_shared_batches.kept
        self.grpo_comm_state.traffic.count(taken_over=sum(unit in kept for unit in units))  # those still kept
        num_items = self._get_num_items_in_batch([*batch_samples, *taken_over], device)
        batch_samples = [{**batch_samples[0], TAKEN_OVER: taken_over}, *batch_samples[1:]]
        return batch_samples, num_items

    def _join_replica_groups(self, epochs_trained: int, skipped: int, num_update_steps_per_epoch: int):
        """
        Between fault-tolerant replica groups, at train start (after the Trainer's state is set up, a resume's
        included): the first quorum. A group behind the others (a restarted or a new one) heals from a live one and
        goes on from its step, skipping the batches it did not train, as a resume does. Returns `(epochs_trained,
        batches to skip)`, those given when nothing changes.
        """
        self._grpo_healed = False
        if self.grpo_fault_tolerance is None:
            return epochs_trained, skipped
        communicator = self.grpo_comm_state.communicator
        payload = communicator.join(
            save=lambda: trainer_heal_state(self),
            step=self.state.global_step,
            description=self._grpo_description(),
            checksum=lambda received: global_checksum(received["grpo"]["comm"]["global"].values()),
            final_step=self.state.max_steps,
            every=self.args.grpo_sync_every,
        )
        if payload is not None:
            epochs_trained, skipped = heal_training_state(
                self.state, payload, num_update_steps_per_epoch, self.args.gradient_accumulation_steps
            )
            self.grpo_callback.heal_from = payload
            self._grpo_healed = True
            logger.warning(
                f"GRPO fault tolerance: replica group {self.grpo_fault_tolerance.replica_id} healed from a live group "
                f"at step {self.state.global_step}; it trains on from there."
            )
        if self._grpo_shared_batches is not None:  # the first window: its members, a healer's catch-up
            comm_state, max_steps = self.grpo_comm_state, self.state.max_steps
            self.grpo_replica_shares = ReplicaShares(
                self.grpo_fault_tolerance.replica_id,
                self.grpo_fault_tolerance.replicas,
                next_sync=lambda step: comm_state.next_sync(step, max_steps),
            )
            catch_up = payload.get("catch_up", ()) if payload is not None else ()
            self.grpo_replica_shares.open(self.state.global_step, communicator.members, catch_up)
            self.grpo_callback.replica_shares = self.grpo_replica_shares
        return epochs_trained, skipped

    def _run_epoch(self, *args, **kwargs):
        """The Trainer's; the first epoch of a healed replica group skips the batches of the steps it did not train
        (the Trainer's skip of a resume). Pinned: transformers < 5.30."""
        if self._grpo_healed and kwargs.get("resume_from_checkpoint") is None:
            kwargs["resume_from_checkpoint"] = HEALED
        return super()._run_epoch(*args, **kwargs)

    def _grpo_description(self) -> dict:
        """What every fault-tolerant replica group must agree on: the settings that shape the training and the sync,
        and the trainable parameters (names and shapes, as a digest)."""
        args = self.args
        shapes = ";".join(
            f"{name}:{tuple(p.shape)}" for g in self.grpo_groups for name, p in zip(g.param_names, g.params)
        )
        fields = ["learning_rate", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                  "lr_scheduler_type", "weight_decay", "optim"]  # fmt: skip
        fields += [name for name in vars(args) if name.startswith("grpo_") and not name.startswith("grpo_ft_")]
        fields.append("grpo_ft_take_over")  # the groups share the absent ones' batches alike
        described = {name: getattr(args, name) for name in sorted(fields) if hasattr(args, name)}
        described["trainable_parameters"] = hashlib.sha256(shapes.encode()).hexdigest()[:16]
        described["world_size_per_group"] = args.world_size
        return described


__all__ = [
    "FaultToleranceMixin",
    "LIGHTHOUSE_ENV",
    "REPLICA_ID_ENV",
    "fault_tolerance_settings",
    "heal_training_state",
    "replica_data",
    "trainer_heal_state",
]
