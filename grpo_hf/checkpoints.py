"""GRPO state in checkpoints: one file per rank, written atomically; the last complete checkpoint; resuming it with the
same or another world size.

A checkpoint folder `checkpoint-<step>` is **complete** when the Trainer's `trainer_state.json` (written last by the
Trainer) is there and, for a GRPO run, `grpo_state_rank<r>.pt` of every rank `r` of the world size recorded in rank
0's file (each rank writes its own right after the Trainer's save). A worker killed in the middle of a save leaves an
incomplete folder; `resume_from_checkpoint="last"` skips it and resumes from the newest complete one.

Resuming with the world size and exchange mode of the saved run restores every rank's state exactly. Otherwise
(another world size, or `grpo_comm_mode="auto"` resolving to the other mode) the LR importance state and the gradient
scales are restored from rank 0 (they are the same on every rank) and the error-feedback residuals of all saved ranks
are re-split with [`~grpo_hf.compression.reshard.reshard_comm_state`] (nothing they hold back is dropped), with a
warning naming both world sizes.

With `grpo_sync_every > 1` ([`~grpo_hf.compression.outer_sync`]) rank 0's file also holds `θ_global` and the outer
momentum, and every rank's file its residuals, its local parameters and its local optimizer state (the Trainer saves
rank 0's only), so that a run resumed with the same world size continues bit for bit; the model the Trainer saves in
the checkpoint is `θ_global`. Another world size restarts every rank from rank 0's `θ_global`, momentum and schedule
(the local steps since the last sync, the residuals and the local optimizer states are dropped, with a warning).
"""

import json
import logging
import os
import re

import torch

from .compression.transport import SavedComms, restore_comm_state
from .errors import CheckpointError
from .files import atomic_write, checkpoint_folders


logger = logging.getLogger(__name__)

STATE_FILE = "grpo_state_rank{rank}.pt"
STATE_VERSION = 1
TRAINER_STATE_FILE = "trainer_state.json"
LAST = "last"
_STATE_FILE_PATTERN = re.compile(r"^grpo_state_rank(\d+)\.pt$")


def state_path(folder: str, rank: int) -> str:
    return os.path.join(folder, STATE_FILE.format(rank=rank))


def saved_ranks(folder: str) -> list[int]:
    """Ranks whose GRPO state file is in `folder`, sorted."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for m in map(_STATE_FILE_PATTERN.match, os.listdir(folder)) if m)


def write_grpo_state(folder: str, rank: int, state: dict) -> str:
    """Write one rank's GRPO state into `folder` atomically (a kill leaves the old file or none, never half of one)."""
    path = state_path(folder, rank)
    with atomic_write(path, "wb") as handle:
        torch.save(state, handle)
    return path


def read_grpo_state(path: str, mmap: bool = False) -> dict:
    """
    Read and check one GRPO state file (`mmap=True` maps its tensors instead of reading them: a cheap check).

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the file is unreadable (corrupt, truncated, overwritten with something
            else) or is not a GRPO state of this version; the message names the file.
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001  (arbitrary bytes fail torch.load in many ways: IndexError, KeyError, ...)
        raise CheckpointError(
            f"cannot read the GRPO state file {path} ({type(err).__name__}: {str(err)[:200]}). The checkpoint is "
            "corrupt: resume from an earlier checkpoint, or delete the checkpoint's grpo_state_rank*.pt files to "
            "resume it with fresh GRPO state."
        ) from None
    importance = saved.get("importance") if isinstance(saved, dict) else None
    if (
        not isinstance(saved, dict)
        or saved.get("version") != STATE_VERSION
        or not isinstance(importance, dict)
        or not {"names", "update_counts", "smoothed", "multipliers", "steps"} <= set(importance)
        or not (saved.get("comm") is None or isinstance(saved["comm"], dict))
    ):
        raise CheckpointError(
            f"{path} is not a GRPO state file of version {STATE_VERSION} (written by another grpo_hf version, or "
            "replaced by another file); resume from another checkpoint."
        )
    return saved


def check_grpo_state_files(folder: str) -> None:
    """
    Read every GRPO state file of the checkpoint `folder` (mapping its tensors: cheap), so that a corrupt one fails
    before any work.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: a file is unreadable or not a GRPO state file; the message names it.
    """
    for rank in saved_ranks(folder):
        read_grpo_state(state_path(folder, rank), mmap=True)


def check_grpo_setup(folder: str, names: list[str], lr_ratios: dict[str, float]) -> None:
    """
    Refuse to resume `folder` into a run whose GRPO groups (`names`, in order) or fixed LR ratios (`lr_ratios`, by
    group) differ from the ones that wrote it, before the Trainer loads anything: its optimizer state holds one param
    group per GRPO group, and its importance state one score per group. Reads rank 0's GRPO state file (mapped); a
    folder without one (a plain Trainer's checkpoint) passes, and so do the ratios of a file written before they were
    saved.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: other groups (their names or number) or other ratios; the message names
            the difference and the settings that decide it.
    """
    if 0 not in saved_ranks(folder):
        return
    path = state_path(folder, 0)
    saved = read_grpo_state(path, mmap=True)
    saved_names = list(saved["importance"]["names"])
    if saved_names != list(names):
        only_saved = [n for n in saved_names if n not in names]
        only_here = [n for n in names if n not in saved_names]
        if not only_saved and not only_here:
            what = " (the same names in another order)"
        elif len(only_saved) < len(saved_names):  # some in common: name what differs
            what = f" (only the checkpoint has {only_saved}, only this run {only_here})"
        else:
            what = ""
        raise CheckpointError(
            f"{path}: the checkpoint was trained with {len(saved_names)} GRPO groups {saved_names}, and this run has "
            f"{len(names)} {list(names)}{what}. Resume with the grpo_groups (or group file), grpo_lr_preset and "
            "trainable parameters that wrote it, or start a new run from the checkpoint's model."
        )
    saved_ratios = saved.get("lr_ratios")
    if not isinstance(saved_ratios, dict):
        return
    changed = [
        f"{name}: {float(saved_ratios.get(name, 1.0)):g} -> {float(lr_ratios.get(name, 1.0)):g}"
        for name in names
        if abs(float(saved_ratios.get(name, 1.0)) - float(lr_ratios.get(name, 1.0))) > 1e-12
    ]
    if changed:
        raise CheckpointError(
            f"{path}: the checkpoint was trained with other LR ratios ({'; '.join(changed)}, checkpoint -> this run). "
            "Resume with the grpo_lr_ratios, group file lr_ratio and grpo_lr_preset that wrote it, or start a new run "
            "from the checkpoint's model."
        )


def _world_size_of(folder: str, rank0_state: dict) -> int:
    # Files written before the world size was recorded: one file per rank.
    return int(rank0_state.get("world_size") or len(saved_ranks(folder)))


def missing_parts(folder: str, grpo: bool = True) -> list[str]:
    """
    What `folder` lacks to be a complete checkpoint (`[]` when complete): `trainer_state.json` (or it does not parse)
    and, when `grpo`, the GRPO state files of the saved world size. A corrupt rank-0 GRPO state file counts as missing.
    """
    trainer_state = os.path.join(folder, TRAINER_STATE_FILE)
    try:
        with open(trainer_state, encoding="utf-8") as handle:
            json.load(handle)
    except (OSError, ValueError):
        return [TRAINER_STATE_FILE]
    if not grpo:
        return []
    if 0 not in saved_ranks(folder):
        return [STATE_FILE.format(rank=0)]
    try:
        world_size = _world_size_of(folder, read_grpo_state(state_path(folder, 0), mmap=True))
    except CheckpointError:
        return [f"a readable {STATE_FILE.format(rank=0)} (it is corrupt)"]
    present = set(saved_ranks(folder))
    return [STATE_FILE.format(rank=r) for r in range(world_size) if r not in present]


def last_complete_checkpoint(output_dir: str, grpo: bool = True) -> str | None:
    """
    The newest complete `checkpoint-<step>` folder of `output_dir` (see the module docstring), `None` when there is
    none. Incomplete newer folders are skipped with a warning naming what they lack.
    """
    for folder in reversed(checkpoint_folders(output_dir)):
        missing = missing_parts(folder, grpo)
        if not missing:
            return folder
        logger.warning(f"{folder} is incomplete (no {', '.join(missing)}; a save was interrupted): skipped.")
    return None


def incomplete_checkpoints(output_dir: str, grpo: bool = True) -> list[str]:
    """The `checkpoint-<step>` folder names of `output_dir` that are not complete."""
    return [os.path.basename(f) for f in checkpoint_folders(output_dir) if missing_parts(f, grpo)]


def resolve_resume_checkpoint(output_dir: str, resume_from_checkpoint: str | bool | None, grpo: bool = True):
    """
    The checkpoint folder `trainer.train(resume_from_checkpoint=...)` resumes from, or `None` to start fresh.

    Args:
        output_dir (`str`):
            The run's output folder.
        resume_from_checkpoint (`str`, `bool` or `None`):
            `None` / `False`: start fresh. `"last"`: the newest complete checkpoint of `output_dir`, or start fresh
            when there is none (so that one command line both starts a run and continues it after a crash). `True`:
            the newest complete checkpoint, an error when there is none (the Trainer's meaning). A path: that folder.
        grpo (`bool`, *optional*, defaults to `True`):
            Whether a complete checkpoint must hold the GRPO state of every rank.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: `True` without a complete checkpoint, or a path that is not a folder.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == LAST:
        folder = last_complete_checkpoint(output_dir, grpo)
        if folder is None and resume_from_checkpoint is True:
            incomplete = [
                f"{os.path.basename(f)} lacks {', '.join(missing_parts(f, grpo))}"
                for f in checkpoint_folders(output_dir)
            ]
            raise CheckpointError(
                f"No valid checkpoint found in output directory ({output_dir})"  # the Trainer's words, then GRPO's
                + (f": no complete checkpoint-<step> folder ({'; '.join(incomplete)})" if incomplete else "")
                + ". Give a checkpoint's path, use resume_from_checkpoint='last' to start fresh when there is none, "
                "or drop the option."
            )
        return folder
    if not os.path.isdir(resume_from_checkpoint):
        raise CheckpointError(
            f"Can't find a valid checkpoint at {resume_from_checkpoint}: it is not a folder. Give a checkpoint-<step> "
            f"folder (e.g. {os.path.join(output_dir, 'checkpoint-500')}), or 'last' for the newest complete one of "
            "output_dir."
        )
    check_trainer_state(resume_from_checkpoint)
    return os.fspath(resume_from_checkpoint)


def check_trainer_state(folder: str) -> None:
    """
    Read the Trainer's `trainer_state.json` of a checkpoint folder, when there is one (the Trainer resumes a folder
    without it from the weights alone), so that a corrupt one fails before any work, naming the file.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the file is not a JSON object (a `ValueError`, as the Trainer's own
            `JSONDecodeError` would be).
    """
    path = os.path.join(folder, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
        problem = None if isinstance(content, dict) else f"a JSON {type(content).__name__}, not an object"
    except (OSError, ValueError) as err:  # ValueError: invalid JSON, or not UTF-8
        problem = f"{type(err).__name__}: {str(err)[:200]}"
    if problem is not None:
        raise CheckpointError(
            f"cannot read the Trainer state {path} ({problem}): the checkpoint is corrupt. Resume from an earlier "
            "checkpoint, or give resume_from_checkpoint='last' (it skips checkpoints that are not complete)."
        )


def planned_checkpoint_steps(
    save_strategy: str,
    max_steps: int,
    *,
    save_steps: int = 0,
    steps_per_epoch: int = 0,
    eval_strategy: str = "no",
    eval_steps: int = 0,
    after_step: int = 0,
) -> tuple[list[int], bool]:
    """
    The global steps in `(after_step, max_steps]` at which the Trainer's `DefaultFlowCallback` saves a
    `checkpoint-<step>` folder, and whether it surely saves at each (`False` for `"best"`, which saves at an
    evaluation step only when the metric improved).

    `"steps"`: every `save_steps` steps and at `max_steps`; `"epoch"`: at the end of every epoch of `steps_per_epoch`
    optimizer steps and at `max_steps`; `"best"`: the evaluation steps (`eval_strategy` `"steps"` every `eval_steps`
    and at `max_steps`, or `"epoch"`); `"no"`: none.
    """
    save_strategy = str(getattr(save_strategy, "value", save_strategy))  # the Trainer's enums, or their values
    eval_strategy = str(getattr(eval_strategy, "value", eval_strategy))

    def every(interval: int) -> set[int]:
        return set(range(interval, max_steps + 1, interval)) | {max_steps} if interval > 0 else {max_steps}

    if max_steps <= 0 or save_strategy == "no":
        steps, sure = set(), True
    elif save_strategy == "steps":
        steps, sure = every(save_steps), True
    elif save_strategy == "epoch":
        steps, sure = every(steps_per_epoch), True
    else:  # "best": saved where an evaluation improves the metric
        steps = every(eval_steps) if eval_strategy == "steps" else every(steps_per_epoch)
        steps, sure = (steps if eval_strategy in ("steps", "epoch") else set()), False
    return sorted(step for step in steps if step > after_step), sure


def overwritten_checkpoints(output_dir: str, steps: list[int]) -> list[str]:
    """The `checkpoint-<step>` folders of `output_dir` whose step is in `steps` (full paths, in step order)."""
    wanted = {f"checkpoint-{step}" for step in steps}
    return [folder for folder in checkpoint_folders(output_dir) if os.path.basename(folder) in wanted]


def warn_overwritten_checkpoints(
    output_dir: str, steps: list[int], sure: bool, settings: str, save_total_limit: int | None = None
) -> list[str]:
    """
    Warn, naming them, about the `checkpoint-<step>` folders of `output_dir` that a run writing checkpoints at `steps`
    (described by `settings`) will overwrite, and how to avoid it; returns their names. The Trainer writes into an
    existing folder without a word (so does the library: only the `grpo-hf` commands refuse such a folder).
    """
    names = [os.path.basename(folder) for folder in overwritten_checkpoints(output_dir, steps)]
    if names:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        rotation = (
            f" With save_total_limit={save_total_limit}, the Trainer's rotation also deletes the oldest checkpoint-* "
            f"folders beyond {save_total_limit} there, the earlier run's included."
            if save_total_limit
            else ""
        )
        logger.warning(
            f"{output_dir} already holds {shown} of an earlier run, and this run, which does not resume it, "
            f"{'writes' if sure else 'may write (when the metric improves)'} checkpoints of the same names "
            f"({settings}): they will be overwritten, and any file this run does not write stays from the earlier "
            f"one.{rotation} To continue that run instead, pass resume_from_checkpoint (its checkpoint folder, True "
            "or 'last'); to keep it, give this run another output_dir."
        )
    return names


def states_to_resume(folder: str, rank: int, world_size: int, mode: str | None) -> list[dict] | None:
    """
    The GRPO state files this rank restores from `folder`: `[its own]` when the checkpoint was written by
    `world_size` ranks in `mode` (the exchange mode this run uses, `None` without compression), else those of every
    saved rank in rank order; `None` when the folder holds no GRPO state (e.g. a plain Trainer's checkpoint).

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: a file is unreadable or missing (the checkpoint is incomplete).
    """
    ranks = saved_ranks(folder)
    if not ranks:
        return None
    if rank in ranks:
        own = read_grpo_state(state_path(folder, rank))
        saved_mode = own["comm"]["mode"] if own["comm"] is not None else mode
        if _world_size_of(folder, own) == world_size and saved_mode == mode:
            return [own]
    if 0 not in ranks:
        raise CheckpointError(f"{folder} holds GRPO state files of ranks {ranks} but not of rank 0: it is incomplete.")
    first = read_grpo_state(state_path(folder, 0))
    saved_world_size = _world_size_of(folder, first)
    missing = [state_path(folder, r) for r in range(saved_world_size) if r not in ranks]
    if missing:
        raise CheckpointError(
            f"{folder} was written by {saved_world_size} ranks but lacks {', '.join(missing)}: the save was "
            "interrupted. Resume from an earlier checkpoint (resume_from_checkpoint='last' picks the newest complete "
            "one)."
        )
    return [first] + [read_grpo_state(state_path(folder, r)) for r in range(1, saved_world_size)]


def restore_grpo_state(
    folder: str,
    rank: int,
    world_size: int,
    importance,
    comm_state,
    numels: dict[str, int],
    compression: str | None = None,
) -> dict | None:
    """
    Restore the importance state ([`~grpo_hf.importance.ImportanceState`]) and the compression state
    ([`~grpo_hf.compression.GRPOCommState`] or `None`) of rank `rank` of `world_size` from `folder` (see the module
    docstring). Returns the state file's content it restored the importance state from, or `None`, with a warning,
    when the folder holds no GRPO state. `compression` (the run's `grpo_compression`, when known) lets a warning say
    why compression is off.

    Nothing it cannot carry over is dropped without a warning that names the checkpoint, what is dropped and why; none
    of it is refused: the model, optimizer and scheduler come from the Trainer's own resume, the importance state and
    scales are the same on every saved rank, and error-feedback residuals only hold what compression has not sent yet
    (a correction owed to later steps, not part of the model), so a run continues correctly without them.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the checkpoint is missing, incomplete, corrupt or belongs to another
            setup (groups, model, compression); the message names the file.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"resume_from_checkpoint={folder!r} is not a folder.")
    states = states_to_resume(folder, rank, world_size, comm_state.mode if comm_state is not None else None)
    if states is None:
        logger.warning(f"{folder} holds no GRPO state ({STATE_FILE.format(rank=rank)}); GRPO state starts fresh.")
        return None
    path = state_path(folder, rank if len(states) == 1 else 0)
    try:
        importance.load_state_dict(states[0]["importance"])
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    saved = SavedComms(
        folder=folder,
        path=path,
        rank=rank,
        world_size=world_size,
        comms=[state["comm"] for state in states],
        saved_world_size=_world_size_of(folder, states[0]),
        numels=numels,
        compression=compression,
        read_rank=lambda saved_rank: read_grpo_state(state_path(folder, saved_rank))["comm"],
        log=logger,
    )
    restore_comm_state(comm_state, saved)  # the transport that runs now restores, or what it cannot is dropped
    return states[0]


__all__ = [
    "LAST",
    "STATE_FILE",
    "STATE_VERSION",
    "check_grpo_setup",
    "check_grpo_state_files",
    "check_trainer_state",
    "incomplete_checkpoints",
    "last_complete_checkpoint",
    "missing_parts",
    "overwritten_checkpoints",
    "planned_checkpoint_steps",
    "read_grpo_state",
    "resolve_resume_checkpoint",
    "restore_grpo_state",
    "saved_ranks",
    "states_to_resume",
    "warn_overwritten_checkpoints",
    "write_grpo_state",
]
