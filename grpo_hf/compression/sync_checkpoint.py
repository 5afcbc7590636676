"""How the sync every H steps resumes: a checkpoint's per-rank state back into an
[`~grpo_hf.compression.outer_sync.OuterSyncState`], its fragments, the parameters and the optimizer (what the state
saves: [`OuterSyncState.state_dict`]).

Resumed by as many ranks (in the same layout), every rank continues bit for bit: its own local parameters (local shards
under FSDP2), optimizer state, residuals and schedule, and `θ_global` and the momentum from the rank that saved them
(rank 0 under DDP; between replica groups replica 0's rank of the same shard, as each shard has its own). Under DDP
another world size restarts every rank from rank 0's `θ_global`, momentum and schedule, with a warning; between replica
groups another layout is refused (the local shards belong to their place in it).
"""

import torch

from ..errors import CheckpointError
from ..optim.moments import local_tensor
from .fragment import InFlight
from .replicas import load_local_optimizer_state, reshard
from .traffic import StepStats
from .transport import SavedComms


STATE_VERSION = 1


def restore_sync_state(state, saved: SavedComms) -> None:
    """
    Restore `state` (an `OuterSyncState`) from `saved`: this rank's own state and rank 0's `θ_global` when the
    checkpoint was written by as many ranks; from another world size every rank restarts from rank 0's `θ_global`,
    momentum and schedule (a warning says what is dropped). Between replica groups `θ_global` of this rank's shard
    comes from replica 0's rank of the same shard, and another layout is refused.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the checkpoint was written in another layout (replica groups, or DDP
            against replica groups).
    """
    layout = state.replicas.layout() if state.replicas is not None else None
    saved_layout = next((comm.get("layout") for comm in saved.comms if comm is not None), None)
    if layout is not None or saved_layout is not None:
        if len(saved.comms) != 1 or saved.comms[0].get("layout") != layout:
            raise CheckpointError(
                f"the checkpoint was written by {saved.saved_world_size} ranks syncing every H steps in the layout "
                f"{saved_layout or 'of DDP (whole models)'} and is resumed by {saved.world_size} in "
                f"{layout or 'that of DDP (whole models)'}: each rank's local shards and optimizer state belong to "
                "its place in the layout. Resume with the same replicas and shards, or start from the saved model "
                "(θ_global) without resume_from_checkpoint."
            )
    if len(saved.comms) == 1:
        # (before `bind`, as at `on_train_begin`, the state's own rank is not known yet: ask the layout)
        holds_global = state.replicas.replica == 0 if state.replicas is not None else saved.rank == 0
        holds_global = holds_global or state.communicator.elastic  # a fault-tolerant group saves its own
        source = state.replicas.first_replica_rank() if state.replicas is not None else 0
        own = saved.comms[0]
        load_sync_state(state, own, own if holds_global else saved.read_rank(source))
        return
    load_sync_state(state, None, saved.comms[0])
    saved.warn(
        f"{saved.folder} was written by {len(saved.comms)} ranks syncing every H steps and is resumed by "
        f"{saved.world_size}: every rank restarts from rank 0's global model, outer momentum and schedule; the "
        "local steps since the last sync, the error-feedback residuals and the local optimizer states are dropped "
        "(rank 0's optimizer state goes to every rank). Resume with the same world size to continue bit for bit."
    )


def load_sync_state(state, state_dict: dict | None, shared: dict | None = None) -> None:
    """
    Restore a saved state into `state` at its next `bind` (at once when bound already). `state_dict` is this rank's
    saved state, `shared` that of the rank holding `θ_global` and the momentum of this rank's shard (rank 0 under DDP,
    replica 0's rank of the same shard between replica groups; defaults to `state_dict`). `state_dict=None` restarts
    every rank from rank 0's `θ_global` with its momentum, step and schedule, without residuals or local steps (a
    checkpoint of another world size; the owner residuals, cut per world size, go with the residuals).

    Raises:
        `ValueError`: a state written by another grpo_hf version, or for other trainable parameters.
    """
    shared = state_dict if shared is None else shared
    for saved in (state_dict, shared):
        if saved is not None and saved.get("version") != STATE_VERSION:
            raise ValueError(
                f"outer-sync state of version {saved.get('version')}, expected {STATE_VERSION}: written by another "
                "grpo_hf version; resume with that version or from a checkpoint written by this one."
            )
    names = {name for names in state.fragment_names for name in names}
    if set(shared["global"]) != names:
        other = sorted(set(shared["global"]) ^ names)
        raise ValueError(
            f"the checkpoint's global model and this run's trainable parameters differ (e.g. {other[0]}); resume "
            "with the same model and adapters as the run that wrote it."
        )
    state.step = int(shared["step"])
    count = len(state.fragment_names)
    if state_dict is None:  # every rank restarts from θ_global: in sync
        last_sync = [state.step] * count
    elif len(state_dict["last_sync"]) == count:
        last_sync = list(state_dict["last_sync"])
    else:  # other fragments: each holds local steps since the oldest saved sync
        last_sync = [min(state_dict["last_sync"])] * count
    state.pending = {"own": state_dict, "shared": shared, "last_sync": last_sync}
    source = state_dict if state_dict is not None else shared
    state.hook_calls = int(source.get("hook_calls", 0))
    state.traffic.load_state_dict(source.get("totals", {}))
    state.stats = StepStats()
    if state.fragments:
        with torch.no_grad():
            apply_saved(state, state.pending)
        state.pending = None


def apply_saved(state, pending: dict) -> None:
    """A saved state into the bound fragments, the parameters and the optimizer."""
    own, shared = pending["own"], pending["shared"]
    reshard(state.fsdp_units)
    same_fragments = own is not None and own["fragments"] == state.fragment_names
    residuals = own.get("residuals", {}) if own is not None else {}
    owner_residuals = own.get("owner_residuals", {}) if own is not None else {}
    for fragment, last in zip(state.fragments, pending["last_sync"]):
        fragment.load(shared["global"], shared["momentum"], residuals, owner_residuals)
        fragment.last_sync, fragment.in_flight = last, None
    saved = (own if own is not None else shared).get("in_flight")
    if saved is not None and same_fragments:  # its outer step and merge at its due step, as in the saved run
        fragment = state.fragments[int(saved["fragment"])]
        flight = fragment.in_flight = InFlight(fragment.index, int(saved["started"]), int(saved["due"]))
        flight.unsafe, flight.completed = bool(saved["unsafe"]), True
        flight.deltas = fragment.rows_from(saved["delta"])
    elif saved is not None and not saved["unsafe"]:  # another world size or other fragments: its outer step now
        for fragment in state.fragments:
            fragment.apply_outer_step_by_name(saved["delta"], state.outer_lr, state.outer_momentum)
    if own is None:  # every rank restarts from θ_global
        for fragment in state.fragments:
            fragment.show_global()
    else:  # this rank's local parameters (by name: the fragments may differ)
        for name, p in state.params.items():
            local_tensor(p).copy_(own["local"][name].view_as(local_tensor(p)))
    if own is not None and state.optimizer is not None and own.get("optimizer") is not None:
        load_local_optimizer_state(state.optimizer, own["optimizer"])


__all__ = ["STATE_VERSION", "apply_saved", "load_sync_state", "restore_sync_state"]
