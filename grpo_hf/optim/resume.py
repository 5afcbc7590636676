"""A checkpoint's optimizer state against the one this run keeps: resumed only into the same layouts, else refused.

`grpo_optimizer_state` changes what the optimizer's state holds (one second moment per head or row instead of one per
entry, 8-bit first moments, none). Loading a checkpoint written with another setting would mix them: torch's AdamW
takes a `[rows, 1]` second moment without a word and fails at its first step, or broadcasts it. So a resume checks,
before any step and before the Trainer loads anything: [`check_checkpoint_optimizer_state`] reads the param groups of
the checkpoint's `optimizer.pt` (memory-mapped: the state itself is not read) when `train(resume_from_checkpoint=...)`
starts and compares the kind of state and every parameter's layout with this run's; [`check_param_groups`] compares
the param groups themselves (their number and GRPO groups: torch's own check would only say "a different number of
parameter groups") right before the Trainer loads the optimizer; and [`~grpo_hf.optim.GroupedAdamW.load_state_dict`]
compares the layouts once more when it is loaded.
"""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError


OPTIMIZER_FILE = "optimizer.pt"  # the Trainer's (transformers' OPTIMIZER_NAME)


def saved_param_groups(folder: str) -> list[dict] | None:
    """
    The param groups of the checkpoint's `optimizer.pt` (read memory-mapped: the state itself is not read), `None`
    when the folder holds none (an FSDP checkpoint shards it; DeepSpeed writes its own).

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: `optimizer.pt` is there but unreadable.
    """
    path = os.path.join(folder, OPTIMIZER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # torch raises several types for a damaged file
        raise CheckpointError(
            f"{path}: cannot read the optimizer's state ({type(error).__name__}: {error})."
        ) from None
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    return [group for group in groups if isinstance(group, dict)]


def check_checkpoint_optimizer_state(folder: str, setting: str, layouts: dict[str, str] | None = None) -> None:
    """
    Refuse to resume `folder` with `grpo_optimizer_state=setting` when its optimizer kept another kind of state, or,
    given `layouts` (this run's layout of every parameter, by name), kept a parameter in another layout.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: a full (AdamW) state resumed into a grouped one or the reverse, or a
            parameter kept in another layout; the message says which setting wrote it.
    """
    groups = saved_param_groups(folder)
    if groups is None:
        return
    saved = "grouped" if any("state_layouts" in group for group in groups) else "full"
    if (saved == "full") != (setting == "full"):
        written = "the optimizer's own full state ('full')" if saved == "full" else "GRPO's grouped state (not 'full')"
        raise CheckpointError(
            f"{folder}: its optimizer state was written with {written}, and this run asks for "
            f"grpo_optimizer_state={setting!r}. Resume with the setting that wrote it, or start a new run from the "
            "checkpoint's model (the optimizer state cannot be mixed)."
        )
    if saved == "full" or layouts is None:
        return
    for index, group in enumerate(groups):
        for name, theirs in zip(group.get("param_names") or [], group.get("state_layouts") or []):
            ours = layouts.get(name)
            if ours is not None and str(ours) != theirs:
                raise CheckpointError(
                    f"{folder}: its optimizer state keeps {name} (param group {index}) as {theirs!r}, and this run as "
                    f"{str(ours)!r} (grpo_optimizer_state={setting!r}): it was written with another "
                    "grpo_optimizer_state, grpo_min_state_numel or group file. Resume with the settings that wrote "
                    "it, or start a new run from the checkpoint's model."
                )


def _describe(groups: list[dict]) -> str:
    tags = [group.get("grpo_group") for group in groups]
    if not any(tags):
        return f"{len(groups)} param groups"
    return f"{len(groups)} param groups ({', '.join(str(tag) for tag in tags)})"


def check_param_groups(folder: str, param_groups: list[dict]) -> None:
    """
    Refuse to load the checkpoint's optimizer state into an optimizer whose param groups (`param_groups`, this run's)
    differ from the saved ones in number, in GRPO group (`grpo_group`) or in parameters (`param_names`): torch would
    raise a bare "loaded state dict has a different number of parameter groups", or load one group's moments into
    another's parameters. Called right before the Trainer loads the optimizer.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the param groups differ; the message names the first difference.
    """
    saved = saved_param_groups(folder)
    if saved is None:
        return
    advice = (
        " It was written with other grpo_groups, another group file, grpo_lr_preset, weight-decay setting or model. "
        "Resume with the settings that wrote it, or start a new run from the checkpoint's model."
    )
    if len(saved) != len(param_groups):
        raise CheckpointError(
            f"{folder}: its optimizer state holds {_describe(saved)}, and this run's optimizer "
            f"{_describe(param_groups)}.{advice}"
        )
    for index, (theirs, ours) in enumerate(zip(saved, param_groups)):
        if theirs.get("grpo_group") != ours.get("grpo_group"):
            raise CheckpointError(
                f"{folder}: its optimizer's param group {index} is GRPO group {theirs.get('grpo_group')!r}, this "
                f"run's is {ours.get('grpo_group')!r} ({_describe(saved)} against {_describe(param_groups)}).{advice}"
            )
        names, our_names = theirs.get("param_names"), ours.get("param_names")
        if names is not None and our_names is not None and list(names) != list(our_names):
            differ = sorted(set(names) ^ set(our_names))
            raise CheckpointError(
                f"{folder}: its optimizer's param group {index} ({theirs.get('grpo_group') or 'untagged'}) holds "
                f"{len(names)} parameters, this run's {len(our_names)}"
                + (f" ({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} in one only)" if differ else "")
                + f".{advice}"
            )


def check_layouts(saved_groups: list[dict], groups: list[dict]) -> None:
    """
    Refuse a [`~grpo_hf.optim.GroupedAdamW`] state dict whose param groups keep other layouts than `groups` (the
    optimizer's own), before `torch.optim.Optimizer.load_state_dict` copies anything.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: a group without layouts (another optimizer's state) or with other ones.
    """
    for index, (saved, group) in enumerate(zip(saved_groups, groups)):
        layouts = saved.get("state_layouts")
        if layouts is None:
            raise CheckpointError(
                "the optimizer state being loaded has no state layouts (it is another optimizer's, e.g. AdamW's full "
                "state): resume it with grpo_optimizer_state='full', or start a new run from its model."
            )
        if list(layouts) != list(group["state_layouts"]):
            diff = (
                next(i for i, (a, b) in enumerate(zip(layouts, group["state_layouts"])) if a != b)
                if len(layouts) == len(group["state_layouts"])
                else 0
            )
            name = (group.get("param_names") or [f"parameter {diff}"])[diff]
            theirs = layouts[diff] if diff < len(layouts) else "-"
            raise CheckpointError(
                f"the optimizer state being loaded keeps {name} (param group {index}) as {theirs!r}, and this run as "
                f"{group['state_layouts'][diff]!r}: it was written with another grpo_optimizer_state, "
                "grpo_min_state_numel or group file. Resume with the settings that wrote it."
            )


__all__ = [
    "check_checkpoint_optimizer_state",
    "check_layouts",
    "check_param_groups",
    "saved_param_groups",
]
