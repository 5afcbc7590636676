"""A checkpoint's optimizer state against the one this run keeps: resumed only into the same layouts, else refused.

`grpo_optimizer_state` changes what the optimizer's state holds (one second moment per head or row instead of one per
entry, 8-bit first moments, none). Loading a checkpoint written with another setting would mix them: torch's AdamW
takes a `[rows, 1]` second moment without a word and fails at its first step, or broadcasts it. So a resume checks,
before any step: [`check_checkpoint_optimizer_state`] reads the param groups of the checkpoint's `optimizer.pt`
(memory-mapped: the state itself is not read) when `train(resume_from_checkpoint=...)` starts, and
[`~grpo_hf.optim.GroupedAdamW.load_state_dict`] compares every parameter's layout when the Trainer loads it.
"""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError


OPTIMIZER_FILE = "optimizer.pt"  # the Trainer's (transformers' OPTIMIZER_NAME)


def saved_state_setting(folder: str) -> str | None:
    """
    `"full"` when the checkpoint's optimizer kept its own state, `"grouped"` when it was
    [`~grpo_hf.optim.GroupedAdamW`] (its param groups hold `state_layouts`), `None` when the folder holds no
    `optimizer.pt` (an FSDP checkpoint shards it; DeepSpeed writes its own).

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
    return "grouped" if any("state_layouts" in group for group in groups) else "full"


def check_checkpoint_optimizer_state(folder: str, setting: str) -> None:
    """
    Refuse to resume `folder` with `grpo_optimizer_state=setting` when its optimizer kept another kind of state.

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: a full (AdamW) state resumed into a grouped one or the reverse; the message
            says which setting wrote it.
    """
    saved = saved_state_setting(folder)
    if saved is None or (saved == "full") == (setting == "full"):
        return
    written = "the optimizer's own full state ('full')" if saved == "full" else "GRPO's grouped state (not 'full')"
    raise CheckpointError(
        f"{folder}: its optimizer state was written with {written}, and this run asks for "
        f"grpo_optimizer_state={setting!r}. Resume with the setting that wrote it, or start a new run from the "
        "checkpoint's model (the optimizer state cannot be mixed)."
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


__all__ = ["check_checkpoint_optimizer_state", "check_layouts", "saved_state_setting"]
