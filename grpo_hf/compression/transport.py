"""`CommState`: what the trainer, its callback and its checkpoints ask of a transport, whichever it is.

A transport is a state class behind one protocol (PEFT's `LoraVariant` idea: the callers never ask which one they
hold). There are three: [`~grpo_hf.compression.GRPOCommState`] (DDP's compressed exchange at every step, and its
one-process preview), [`~grpo_hf.compression.fsdp.FSDPCommState`] (FSDP2's compressed reduce-scatter) and
[`~grpo_hf.compression.outer_sync.OuterSyncState`] (the sync every H steps). The one the settings ask for is built
in one place, [`~grpo_hf.compression.build.build_comm_state`]: each transport's [`CommState.from_settings`] says
whether it applies to the [`CommSettings`] (whose typed settings were checked once, in
[`~grpo_hf.compression.settings.transport_settings`]); the trainer only asks. A transport is handed its
way to the wire, a [`~grpo_hf.compression.communicator.Communicator`] (`communicator=`; `process_group=` is a
convenience that makes a `ProcessGroupCommunicator`), and builds no collective of its own: every collective, rank and
world size goes through it, timed there, and its time spent communicating is moved into the step's statistics when
the transport closes the step; the bytes are counted once, by the exchange. From then on, one optimizer step's life is
the same for all:

1. [`CommState.attach`], once per prepared model, before its first backward: the transport hooks itself in (a DDP comm
   hook, FSDP2's reduce-scatter on every unit) and follows the optimizer.
2. The backward, inside which the transport's hook runs; then [`CommState.after_backward`] (the one-process preview
   compresses the gradients here).
3. [`CommState.agree_norms`] (and [`CommState.agree_mean`]): the per-group gradient norms every rank shares, for the
   LR multipliers and the skip of a NaN/Inf step.
4. `optimizer.step()`, then [`CommState.end_step`]: the step closed (the sync every H steps syncs its fragments due);
   it returns the bytes this rank sent in the step, for the cost report.
5. Around evaluation and saving, [`CommState.global_weights`]; at the end of training, [`CommState.finish`].

Each transport saves and restores its own per-rank state ([`CommState.state_dict`], [`CommState.restore`]);
[`restore_comm_state`] decides, from a checkpoint's saved transport and the one that runs now, whether the current one
restores it or what was saved is dropped (with a warning that names what and why). The statistics are the same for
all: [`CommState.pop_stats`], [`CommState.totals`], [`CommState.memory_bytes`].
"""

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import CheckpointError


logger = logging.getLogger(__name__)

OUTER_MODE = "outer-sync"  # the `mode` of the sync every H steps in checkpoints (beside "allgather", "allreduce")
FSDP_MODE = "fsdp-reduce-scatter"  # the `mode` of FSDP2's reduce-scatter


@dataclass
class SavedComms:
    """
    What a checkpoint holds of the transports, for the rank that resumes it.

    Args:
        folder (`str`) and path (`str`): the checkpoint and the state file errors name.
        rank (`int`) and world_size (`int`): the rank that resumes, of how many.
        comms (`list[dict | None]`): the saved transport states it restores from: its own alone when the checkpoint
            was written by as many ranks in the same mode, else every saved rank's in rank order.
        saved_world_size (`int`): the ranks that wrote the checkpoint.
        numels (`dict[str, int]`): the entries of every trainable parameter, by name.
        compression (`str`, *optional*): the run's `grpo_compression`, for the warnings.
        read_rank (`Callable[[int], dict | None]`): a saved rank's transport state (the sync's global model: rank 0's,
            or between replica groups replica 0's rank of this rank's shard).
        log (`logging.Logger`, *optional*): where rank 0 warns about what is dropped or moved (the checkpoints').
    """

    folder: str
    path: str
    rank: int
    world_size: int
    comms: list
    saved_world_size: int
    numels: dict
    compression: str | None
    read_rank: Callable
    log: logging.Logger = logger

    @property
    def mode(self) -> str | None:
        """The saved transport's mode; `None` when the checkpoint holds none (no compression)."""
        return next((comm["mode"] for comm in self.comms if comm is not None), None)

    def warn(self, message: str) -> None:
        """A warning, from rank 0 only."""
        if self.rank == 0:
            self.log.warning(message)


@dataclass
class CommSettings:
    """
    What a transport is built from ([`~grpo_hf.compression.build.build_comm_state`] hands it to each transport's
    [`CommState.from_settings`] in turn).

    Args:
        transport ([`~grpo_hf.compression.settings.TransportSettings`]): the typed settings of the codec and the sync,
            checked once by [`~grpo_hf.compression.settings.transport_settings`] (the transports take them as they are).
        args: the trainer's arguments (its process rank, the engine's origin; the sync between replica groups may turn
            off `average_tokens_across_devices`).
        engine (`str`): `"single"`, `"ddp"`, `"fsdp2"` or `"deepspeed"`.
        plan (`dict[str, CodecSpec | None]`): the compression plan; a transport that sends no codes leaves it dense
            (every value `None`), and the builder's caller reads it back.
        compression (`str`): `grpo_compression` resolved (`"none"` when nothing is compressed; set so by a transport
            that sends no codes).
        groups (`list`): GRPO's parameter groups (`grpo_hf.grouping.ParameterGroup`).
        num_processes (`int`): the processes of the run.
        model (`torch.nn.Module`, *optional*): the model (FSDP2's replica groups are read from it).
        accelerator (*optional*): the trainer's `Accelerator` (its parallelism config and device mesh).
        communicator ([`~grpo_hf.compression.communicator.Communicator`], *optional*): the way to the wire the
            transport is handed; `None`: each makes a `ProcessGroupCommunicator` over its own group (the default one,
            FSDP2's, the replicas').
        fault_tolerance ([`~grpo_hf.compression.torchft_group.FaultTolerance`], *optional*): this launch is one
            fault-tolerant replica group (`grpo_fault_tolerance`): the sync's wire is torchft's.
        replicas ([`~grpo_hf.compression.replicas.ReplicaGroups`], *optional*): the sync's replica groups under FSDP2,
            set by [`~grpo_hf.compression.build.sync_wire`] with the sync's `communicator`.
    """

    transport: object
    args: object
    engine: str
    plan: dict
    compression: str
    groups: list
    num_processes: int = 1
    model: object = None
    accelerator: object = None
    communicator: object = None
    fault_tolerance: object = None
    replicas: object = None

    @property
    def syncing(self) -> bool:
        """Whether the ranks sync every H steps (`grpo_sync_every > 1`)."""
        return self.transport.sync.on


class CommState:
    r"""
    The protocol of every transport (see the module docstring). A subclass sets `mode` (its name in checkpoints) and
    `nonfinite_origin` (what a run stopped by NaN/Inf gradients says of them), and implements [`attach`],
    [`end_step`], [`restore`], the statistics and the state dict; the rest has defaults that do nothing.
    """

    __slots__ = ()
    nonfinite_origin = "They were NaN/Inf as the backward pass and gradient synchronization made them (no GRPO codec)"

    # --- building ---
    @classmethod
    def from_settings(cls, settings: CommSettings) -> "CommState | None":
        """This transport built from `settings` when they ask for it, else `None` (the settings' rules were checked
        where they were made; what only the transport sees, e.g. a layout, it refuses with a `ConfigError`)."""
        return None

    @property
    def last_step(self) -> str | None:
        """How the last closed step was sent, where the transport knows (`"compressed"`, `"dense"`, `"nonfinite"`)."""
        return None

    # --- wiring ---
    def attach(self, wrapped: torch.nn.Module, model: torch.nn.Module, optimizer) -> None:
        """Hook the transport into `wrapped` (the model as the engine prepared it) and follow `model` (unwrapped) and
        the `optimizer` that steps; once per prepared model, before its first backward."""
        raise NotImplementedError

    def count_bytes_for(self, world_size: int) -> None:
        """On one process: count the bytes one of `world_size` workers would send, where the transport counts any."""

    # --- per step ---
    def after_backward(self, model: torch.nn.Module) -> None:
        """After the backward of an optimizer step's last micro-batch (communication included), before clipping."""

    def agree_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-group gradient norms every rank shares (as they are when the gradients were averaged already)."""
        return norms

    def agree_mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of per-group `values` (as they are when every rank holds the same ones)."""
        return values

    def share_at_sync(self, get: Callable, put: Callable) -> None:
        """
        Ask for state the ranks keep apart between syncs to be averaged at every sync: `put(mean of get())` over the
        ranks that trained apart (replica groups, whose norms are their own). Nothing to do for the others.
        """

    def end_step(self, finite: bool = True, last: bool = False) -> float:
        """
        Close an optimizer step, after `optimizer.step()`; `finite`: the step's gradients were finite on every rank
        (it was not skipped), `last`: the last step of training. Returns the bytes this rank sent in the step.
        """
        raise NotImplementedError

    def step_ended(self, step: int) -> None:
        """
        After the trainer closed optimizer step `step` (scheduler stepped, step counted). Between fault-tolerant replica
        groups the sync's next interval starts here (a quorum, at which late groups heal from this one). Nothing for
        the others.
        """
        return None

    def shutdown(self) -> None:
        """At the end of training, whether it ended well or not: the transport leaves its wire's membership
        (fault-tolerant replica groups leave their quorum, so that the lighthouse stops waiting for them). Nothing for
        the others."""

    def heal_state_dict(self) -> dict:
        """What a healing replica group receives of this rank's transport (fault-tolerant replica groups)."""
        raise NotImplementedError(f"{type(self).__name__} does not heal replica groups.")

    def load_heal_state_dict(self, state: dict) -> None:
        """A live group's [`heal_state_dict`] into this healing one, before its first step."""
        raise NotImplementedError(f"{type(self).__name__} does not heal replica groups.")

    def finish(self) -> float | None:
        """At the end of training: what is left to send (the bytes sent), `None` when nothing ever is."""
        return None

    def global_weights(self):
        """A context in which the model holds the weights every rank agrees on (nothing to do for most transports)."""
        return contextlib.nullcontext()

    # --- checkpoints ---
    def resumes(self, mode: str | None) -> bool:
        """Whether this transport restores a checkpoint whose transport was `mode` (`None`: none was saved)."""
        return mode == self.mode

    def restore(self, saved: SavedComms) -> None:
        """Restore this rank's state from `saved` (a checkpoint this transport [`resumes`])."""
        raise NotImplementedError

    # --- statistics (each transport's `TrafficStats`), memory ---
    def pop_stats(self) -> dict[str, float]:
        """The logged window's `grpo/comm/*` figures since the last call (then cleared)."""
        raise NotImplementedError

    def totals(self) -> dict[str, float]:
        """The run's totals (checkpointed): `bytes_sent`, `steps`, `hook_ms`, ..."""
        raise NotImplementedError

    def memory_bytes(self) -> dict[str, int]:
        """The bytes this transport holds, by kind (residuals, work buffers, `θ_global`, ...)."""
        raise NotImplementedError


def sends_every(mode: str | None) -> str | None:
    """What a compression state of `mode` (as saved in checkpoints) sends: `"sync"` (every H steps), `"step"` (every
    step) or `None` (no compression state)."""
    if mode is None:
        return None
    return "sync" if mode == OUTER_MODE else "step"


def restore_comm_state(comm_state: CommState | None, saved: SavedComms) -> None:
    """
    Resume the transport that runs now (`None`: none) from a checkpoint's: restored when it [`~CommState.resumes`] the
    saved one, else what was saved is dropped with a warning naming what and why (a model-only resume). A checkpoint of
    another world size without any transport state says so.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the saved state belongs to another model or setup (naming the file).
    """
    if comm_state is not None and comm_state.resumes(saved.mode):
        try:
            comm_state.restore(saved)
        except CheckpointError as err:
            raise CheckpointError(f"{saved.folder}: {err}") from None
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"{saved.path}: {err}") from None
    elif saved.mode is not None or comm_state is not None:
        saved.warn(_dropped_message(saved, comm_state.mode if comm_state is not None else None))
    elif len(saved.comms) > 1:
        saved.warn(world_size_message(saved, None))


def world_size_message(saved: SavedComms, mode: str | None) -> str:
    """A checkpoint of another world size, resumed in `mode`: what moves, and from where."""
    saved_mode = saved.mode
    merged = any(comm is not None for comm in saved.comms)
    return (
        f"{saved.folder} was written by {len(saved.comms)} ranks"
        + (f" in {saved_mode!r} mode" if saved_mode else "")
        + f" and is resumed by {saved.world_size}"
        + (f" in {mode!r} mode" if mode is not None else "")
        + ": the LR importance state and gradient scales come from rank 0 (they are the same on every rank); "
        + (
            "the error-feedback residuals of every saved rank are merged (their mean plus the owners' residuals) "
            "and every rank resumes with that: nothing they held back is lost, but the run no longer matches one "
            "that kept its world size bit for bit."
            if merged
            else "there is no compression state to move."
        )
    )


def _dropped_message(saved: SavedComms, mode: str | None) -> str:
    """What a resume drops of a saved transport that the running one does not restore (`mode`: the running one's)."""
    folder, world_size = saved.folder, saved.world_size
    if OUTER_MODE in (saved.mode, mode):
        sizes = f"by {saved.saved_world_size} rank(s) "
        if saved.mode == OUTER_MODE:
            return (
                f"{folder} was written {sizes}with grpo_sync_every > 1 and is resumed by {world_size} without it: "
                "every rank continues from the saved global model with rank 0's optimizer state; the local steps "
                "since the last sync are dropped."
            )
        return (
            f"{folder} was written {sizes}without grpo_sync_every > 1 and is resumed by {world_size} with it: the "
            "sync starts from the saved model, and what the per-step compression held back (its error-feedback "
            "residuals) is dropped."
        )
    if FSDP_MODE in (saved.mode, mode):
        return (
            f"{folder} was written by {saved.saved_world_size} rank(s) with compression mode {saved.mode!r} and is "
            f"resumed by {world_size} in mode {mode!r}: the error-feedback residuals are dropped (the FSDP2 "
            "reduce-scatter lays them out per world size). Resume with the same world size and compression to keep "
            "them."
        )
    return _dropped_residuals_message(saved)


def _dropped_residuals_message(saved: SavedComms) -> str:
    """What a resume without compression drops from a checkpoint written with DDP's per-step compression, and why."""
    folder, world_size, compression = saved.folder, saved.world_size, saved.compression
    saved_world_size = saved.saved_world_size
    comms = [comm for comm in saved.comms if comm is not None]
    tensors = len(comms[0].get("residuals") or {}) if comms else 0
    owners = len(comms[0].get("owner_residuals") or {}) if comms else 0
    what = f"the error-feedback residuals of {tensors} compressed tensor(s)" + (
        f" (and {owners} owner residual(s))" if owners else ""
    )
    what += f" saved by each of its {saved_world_size} rank(s)" if saved_world_size > 1 else " it saved"
    if compression == "none":
        why = "this run sets grpo_compression='none'"
    elif compression == "auto" and world_size == 1:
        why = "grpo_compression='auto' compresses nothing on one process, which sends no gradient"
    elif compression == "auto":
        why = "grpo_compression='auto' turns compression off on this engine"
    else:
        why = "compression is off in this run"
    moved = (
        f"; it was written by {saved_world_size} rank(s) and is resumed by {world_size} process(es)"
        if saved_world_size != world_size
        else ""
    )
    keep = (
        "grpo_compression='quantize' (on one process too: the residuals of every saved rank are then merged)"
        if world_size == 1
        else "grpo_compression='quantize'"
    )
    if not tensors and not owners:  # saved during the dense warm-up: only counters
        return (
            f"{folder} holds the compression state of a run that compressed its gradients, with no error-feedback "
            f"residual yet (it was saved during the dense warm-up): it is not carried over, because compression is "
            f"off in this run ({why}){moved}. Nothing the model is owed is lost; resume with {keep} to compress."
        )
    return (
        f"{folder} holds {what}, what gradient compression held back and still owed the model: they are dropped, "
        f"because compression is off in this run ({why}){moved}. The run continues correctly without them (the "
        f"model, optimizer and scheduler come from the Trainer's resume); to keep them, resume with {keep}."
    )


__all__ = [
    "FSDP_MODE",
    "OUTER_MODE",
    "sends_every",
    "CommSettings",
    "CommState",
    "SavedComms",
    "restore_comm_state",
    "world_size_message",
]
