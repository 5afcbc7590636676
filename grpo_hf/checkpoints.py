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

import contextlib
import json
import logging
import math
import os
import re

import torch

from .compression.transport import SavedComms, restore_comm_state, sends_every
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


# --- the settings a checkpoint was written with, against this run's (see docs/reliability.md, "Resuming") ----------

# What a compressed run sends: refused on resume when the checkpoint and this run both compress at every step (a
# compression state of "allgather", "allreduce" or FSDP2's mode in both), or both sync every H steps. Its
# error-feedback residuals hold what the checkpoint's codec has not sent yet (in gradient units: correct for another
# codec too), but the run would then be neither codec's: its bytes, its report, its card and the benchmark rows it
# is read against all describe one codec per run.
STEP_CODEC_SETTINGS = (
    "grpo_compression",
    "grpo_bits",
    "grpo_density",
    "grpo_min_compress_numel",
    "grpo_fsdp_error_feedback",
)
SYNC_CODEC_SETTINGS = (
    "grpo_sync_every",
    "grpo_sync_bits",
    "grpo_sync_density",
    "grpo_sync_chunk",
    "grpo_sync_fragments",
    "grpo_sync_delay",
    "grpo_sync_outer_only",
)
# Refused whatever the codec: the saved importance state holds smoothed scores of the checkpoint's score.
STATE_SETTINGS = ("grpo_importance_score",)
# Checked by their effect ([`check_grpo_setup`], the optimizer-state check): refused when the groups, ratios or
# optimizer-state layouts differ, applied and said when only the setting's spelling does.
EFFECT_CHECKED_SETTINGS = (
    "grpo_groups",
    "grpo_lr_ratios",
    "grpo_lr_preset",
    "grpo_optimizer_state",
    "grpo_min_state_numel",
)
# Where a launch reaches its peers: another address on resume is not a change of the run.
UNCOMPARED_SETTINGS = ("grpo_ft_lighthouse", "grpo_ft_hostname")
RUN_SUMMARY = "grpo_run.json"  # `grpo_hf.model_card.RUN_SUMMARY_FILE`: GRPOTrainer.save_model writes it in checkpoints
SCHEDULER_FILE = "scheduler.pt"


def _settings_family(args) -> str | None:
    """What a run of `args` will have, from its settings alone (before its trainer is built)."""
    from .compression.plan import resolve_compression

    distributed = getattr(args, "world_size", 1) > 1 or bool(getattr(args, "grpo_fault_tolerance", False))
    if getattr(args, "grpo_sync_every", 1) > 1:
        return "sync" if distributed else None
    compression = resolve_compression(getattr(args, "grpo_compression", "auto"), distributed)
    return "step" if compression != "none" else None


def _normal(value):
    """A setting's value as comparable JSON text (a JSON string of a dict reads as the dict)."""
    from .provenance import jsonable

    if isinstance(value, str) and value[:1] in "{[":
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    return json.dumps(jsonable(value), sort_keys=True)


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _summary_recipe(folder: str) -> dict:
    """The recipe of the checkpoint's run summary (`{}` without one)."""
    return (_read_json(os.path.join(folder, RUN_SUMMARY)) or {}).get("recipe") or {}


def checkpoint_settings(folder: str) -> dict | None:
    """
    The `grpo_*` and `cost_*` settings of the run that wrote the checkpoint `folder`, from the run summary GRPOTrainer
    saves in each checkpoint (`grpo_run.json`); `None` without one (a plain Trainer's checkpoint, an older one).
    """
    settings = _summary_recipe(folder).get("grpo")
    return settings if isinstance(settings, dict) else None


def checkpoint_learning_rate(folder: str) -> float | None:
    """
    The peak learning rate of the checkpoint's schedule, which a resume continues (the Trainer restores its optimizer
    and scheduler): the largest `base_lrs` of its `scheduler.pt`, else the `learning_rate` of its `grpo_run.json`;
    `None` when neither says.
    """
    path = os.path.join(folder, SCHEDULER_FILE)
    if os.path.isfile(path):
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            rates = [float(v) for v in saved.get("base_lrs") or []]
            if rates:
                return max(rates)
        except Exception:  # noqa: BLE001  (a scheduler of another kind, or an unreadable file: ask the summary)
            pass
    rate = (_summary_recipe(folder).get("training") or {}).get("learning_rate")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def _saved_family(folder: str) -> str | None:
    if 0 not in saved_ranks(folder):
        return None
    comm = read_grpo_state(state_path(folder, 0), mmap=True).get("comm")
    return sends_every(comm.get("mode")) if isinstance(comm, dict) else None


def describe_codec(settings: dict | None, family: str | None) -> str:
    """
    What a run of `settings` (`grpo_*` values, as in `grpo_run.json`) sent, in words: `"quantize, 8 bits"`, `"sparse,
    density 0.15"`, `"sync every 16 steps, 4-bit codes"`, `"nothing compressed"` (`family`: see [`~grpo_hf.compression.transport.sends_every`]).
    """
    settings = settings or {}
    if family is None:
        return "nothing compressed"
    if family == "sync":
        text = f"sync every {settings.get('grpo_sync_every')} steps, {settings.get('grpo_sync_bits')}-bit codes"
        density = settings.get("grpo_sync_density")
        return text + (f", top {density:g} of every {settings.get('grpo_sync_chunk')}" if density not in (None, 1, 1.0) else "")  # fmt: skip
    kind = settings.get("grpo_compression")
    kind = "quantize" if kind in (None, "auto") else kind
    parts = [kind]
    if "sparse" in kind:
        parts.append(f"density {settings.get('grpo_density')}")
    if "quantize" in kind:
        parts.append(f"{settings.get('grpo_bits')} bits")
    if settings.get("grpo_scale_gradients"):  # (a checkpoint written before the scales were removed)
        parts.append("scaled by exp_avg_sq")
    return ", ".join(parts)


def _relevant(name: str, saved: dict, ours: dict) -> bool:
    """Whether a codec setting matters for the codec of either run (the density only of a sparse code, ...)."""
    either = (saved, ours)
    if name == "grpo_density":
        return any("sparse" in str(s.get("grpo_compression")) for s in either)
    if name == "grpo_bits":
        return any("sparse" != str(s.get("grpo_compression")) for s in either)
    if name == "grpo_sync_chunk":
        return any(s.get("grpo_sync_density") not in (None, 1, 1.0) for s in either)
    return True


def resume_changes(folder: str, args, comm_mode: str | None = "estimate") -> dict:
    """
    How this run (`args`) differs from the run that wrote the checkpoint `folder`, per setting (the table of
    docs/reliability.md, "Resuming"), without raising or warning: what [`check_resume_settings`] refuses or says, and
    what a report of the resumed run states.

    Args:
        folder (`str`): the checkpoint.
        args: this run's arguments (`GRPOConfig`, or a plain `TrainingArguments`: then only the learning rate).
        comm_mode (`str` or `None`, *optional*): the mode of this run's compression state (`None`: none); by default
            estimated from `args` ([`_settings_family`]).

    Returns:
        `dict`: `checkpoint`, `step` (its global step), `settings` (the checkpoint's `grpo_*` / `cost_*` values,
        `None` when it has no run summary), `refused` and `applied` (`{name: [checkpoint's, this run's]}`),
        `learning_rate` (`{"schedule": the checkpoint's peak, "requested": args.learning_rate, "checkpoint": the
        learning_rate the checkpoint's run was given}`), `codec`
        (`{"checkpoint": ..., "run": ...}`, [`describe_codec`]), `removed` (`{"name=value": why}`: what the
        checkpoint's run used that this version removed and this run would have to continue).
    """
    from .config import grpo_field_names

    saved = checkpoint_settings(folder)
    ours_family = _settings_family(args) if comm_mode == "estimate" else sends_every(comm_mode)
    saved_family = _saved_family(folder)
    names = [n for n in grpo_field_names() if hasattr(args, n) and n not in UNCOMPARED_SETTINGS]
    ours = {n: getattr(args, n) for n in names}
    refused, applied = {}, {}
    for name in names if saved is not None else []:
        if name not in saved or _normal(saved[name]) == _normal(ours[name]):
            continue
        pair = [saved[name], json.loads(_normal(ours[name]))]
        codec = (STEP_CODEC_SETTINGS if saved_family == ours_family == "step" else ()) + (
            SYNC_CODEC_SETTINGS if saved_family == ours_family == "sync" else ()
        )
        if name == "grpo_compression" and saved_family == ours_family == "step":
            same_kind = {str(v).replace("auto", "quantize") for v in pair}
            target = applied if len(same_kind) == 1 else refused
        elif name in STATE_SETTINGS or (name in codec and _relevant(name, saved, ours)):
            target = refused
        else:
            target = applied
        target[name] = pair
    rate = checkpoint_learning_rate(folder)
    requested = getattr(args, "learning_rate", None)
    removed = _removed_settings(saved or {}, saved_family == ours_family == "step")
    training = _summary_recipe(folder).get("training") or {}
    step = (_read_json(os.path.join(folder, TRAINER_STATE_FILE)) or {}).get("global_step")
    return {
        "checkpoint": os.fspath(folder),
        "step": step if isinstance(step, int) else None,
        "settings": saved,
        "refused": refused,
        "applied": applied,
        "removed": removed,
        "learning_rate": {"schedule": rate, "requested": requested, "checkpoint": training.get("learning_rate")},
        "codec": {
            "checkpoint": describe_codec(saved, saved_family) if saved is not None else None,
            "run": describe_codec(ours, ours_family) if names else None,
        },
    }


def _removed_settings(saved: dict, both_compress: bool) -> dict[str, str]:
    """
    What the checkpoint's run (its `grpo_run.json` settings, `saved`) used that this version removed, `{"name=value":
    why}`: gradient scales while both runs compress at every step (its codec cannot go on), an optimizer state preset
    (its state cannot be loaded into another layout).
    """
    from .choices import SCALES_REMOVED
    from .optim.layout import REMOVED_PRESETS

    removed = {}
    if both_compress and saved.get("grpo_scale_gradients") is True:
        removed["grpo_scale_gradients=True"] = SCALES_REMOVED
    state = saved.get("grpo_optimizer_state")
    if state in REMOVED_PRESETS:
        removed[f"grpo_optimizer_state={state!r}"] = REMOVED_PRESETS[state]
    return removed


def check_resume_settings(folder: str, args, comm_mode: str | None = "estimate", warn: bool = True) -> dict:
    """
    Refuse, or apply and say once, what differs between this run's settings and the checkpoint's
    ([`resume_changes`]): a setting this version removed that the checkpoint's run used (one error saying why), a
    codec setting while both runs compress alike, or the importance score, is one
    [`~grpo_hf.errors.CheckpointError`] naming every such setting (before the Trainer loads anything); every other
    changed `grpo_*` / `cost_*` setting applies from the next step, and with `warn` (on the main process) one
    warning names them all, and another `learning_rate` than the checkpoint's run was given: the Trainer will not use
    it (it continues the checkpoint's schedule).
    A checkpoint without a run summary (`grpo_run.json`) is not compared (but for its learning rate).

    Returns:
        `dict`: [`resume_changes`]'s record.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: naming each refused setting, both values and the ways out.
    """
    changes = resume_changes(folder, args, comm_mode)
    step = changes["step"]
    if changes["removed"]:
        said = " ".join(f"{setting}: {why}" for setting, why in changes["removed"].items())
        raise CheckpointError(
            f"{folder} was written with settings this version no longer runs. {said} Resume it with the grpo_hf "
            "version that wrote it, or start a new run (another output_dir) from the checkpoint's model."
        )
    if changes["refused"]:
        listed = "; ".join(f"{n} {_shown(a)} -> {_shown(b)}" for n, (a, b) in changes["refused"].items())
        flags = " ".join(f"--{n} {a}" for n, (a, _) in changes["refused"].items())
        codec = [n for n in changes["refused"] if n not in STATE_SETTINGS]
        why = []
        if codec:
            why.append(
                f"its error-feedback residuals hold what its codec ({changes['codec']['checkpoint']}) has not sent "
                "yet, and a run's bytes, report and card describe one codec"
            )
        if any(n in STATE_SETTINGS for n in changes["refused"]):
            why.append("its importance state holds smoothed scores of the checkpoint's grpo_importance_score")
        raise CheckpointError(
            f"{folder} was written with other settings than this run's ({listed}; checkpoint -> this run): "
            + "; ".join(why)
            + f". Resume with the checkpoint's values ({flags})"
            + (
                ", resume without compression (grpo_compression='none': its residuals are dropped, with a warning)"
                if codec
                else ""
            )  # fmt: skip
            + ", or start a new run (another output_dir) from the checkpoint's model."
        )
    if warn and getattr(args, "process_index", 0) == 0:
        parts = []
        if changes["applied"]:
            listed = "; ".join(f"{n} {_shown(a)} -> {_shown(b)}" for n, (a, b) in changes["applied"].items())
            parts.append(
                f"Resuming {folder} with settings other than the ones that wrote it, applied from step "
                f"{(step or 0) + 1}: {listed}."
            )
        rate, requested, before = (changes["learning_rate"].get(k) for k in ("schedule", "requested", "checkpoint"))
        # said when this run asks for another rate than the one that wrote the checkpoint (or, without its summary,
        # than its schedule's): a rate given the same way as before was said when it was first changed
        asked = before if isinstance(before, (int, float)) else rate
        if rate is not None and requested is not None and not math.isclose(asked, requested, rel_tol=1e-9):
            parts.append(
                f"learning_rate={requested:g} is not used: the Trainer restores the checkpoint's optimizer and "
                f"scheduler, so the learning rate follows the checkpoint's schedule (peak {rate:g}). To train at "
                f"{requested:g}, start a new run (another output_dir) from the checkpoint's model."
            )
        if parts:
            logger.warning(" ".join(parts))
    return changes


def tied_missing_keys(model, keys) -> dict[str, str]:
    """
    The keys of `keys` (missing from a loaded checkpoint) whose parameter is the same tensor as another parameter
    of `model` that is not missing (tied weights: `lm_head.weight` of a model whose output layer is its input
    embeddings): `{missing: the name it is tied to}`. safetensors saves a shared tensor once, so the Trainer's resume
    reports such a key as missing although the checkpoint restores it through its twin.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    missing, tied = set(keys), {}
    for same in names.values():
        present = [n for n in same if n not in missing]
        for name in same:
            if name in missing and present:
                tied[name] = present[0]
    return tied


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


def warn_overwritten_checkpoints(
    output_dir: str, steps: list[int], sure: bool, settings: str, save_total_limit: int | None = None
) -> list[str]:
    """
    Warn, naming them, about the `checkpoint-<step>` folders of `output_dir` that a run writing checkpoints at `steps`
    (described by `settings`) will overwrite, and how to avoid it; returns their names. The Trainer writes into an
    existing folder without a word (so does the library: only the `grpo-hf` commands refuse such a folder).
    """
    wanted = {f"checkpoint-{step}" for step in steps}
    names = [name for name in map(os.path.basename, checkpoint_folders(output_dir)) if name in wanted]
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
    "EFFECT_CHECKED_SETTINGS",
    "LAST",
    "STATE_FILE",
    "STATE_SETTINGS",
    "STATE_VERSION",
    "STEP_CODEC_SETTINGS",
    "SYNC_CODEC_SETTINGS",
    "UNCOMPARED_SETTINGS",
    "check_grpo_setup",
    "check_grpo_state_files",
    "check_resume_settings",
    "check_trainer_state",
    "checkpoint_learning_rate",
    "checkpoint_settings",
    "describe_codec",
    "incomplete_checkpoints",
    "last_complete_checkpoint",
    "missing_parts",
    "planned_checkpoint_steps",
    "read_grpo_state",
    "resolve_resume_checkpoint",
    "restore_grpo_state",
    "resume_changes",
    "saved_ranks",
    "states_to_resume",
    "tied_missing_keys",
    "warn_overwritten_checkpoints",
    "write_grpo_state",
]
