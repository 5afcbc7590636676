"""Compression state saved by `W` ranks, re-split for `W'` ranks: resuming with another world size or exchange mode.

What error feedback still owes the averaged gradient (hence the model) after an optimizer step is, per tensor,

    owed = mean_r residual_r + owner_residual

`residual_r` is rank `r`'s own error feedback, in units of its local gradient; `owner_residual` (all-reduce mode only)
is the error feedback the owner of each chunk keeps, already in units of the mean, assembled from the chunks every
rank owns ([`~grpo_hf.compression.layout.chunk_owner`], [`~grpo_hf.compression.layout.chunk_bounds`]). The next step
averages `grad_r + residual_r` over the ranks (and the owners add their residual), so `owed` is exactly what the
residuals add to the next averaged gradient.

Resharding gives every one of the `W'` new ranks `residual = owed` and no owner residual: the next average receives
`mean_r' owed = owed`, what the saved run would have added. Nothing is dropped; what changes is which rank holds it
(each rank then compresses `grad + owed`, so the steps after the change round differently from a run that kept its
world size). The step counters and the traffic totals are the same on every rank and are taken from rank 0.
"""

import torch

from ..errors import CheckpointError
from .layout import chunk_bounds, chunk_owner
from .spec import CodecSpec, num_blocks


STATE_VERSION = 2  # of the per-step hook's saved state ([`~grpo_hf.compression.GRPOCommState.state_dict`])


def owed_residuals(
    states: list[dict], numels: dict[str, int], plan: dict[str, CodecSpec | None]
) -> dict[str, torch.Tensor]:
    """
    Per tensor, what the error feedback of `W` ranks still owes the averaged gradient (fp32, `numel` entries).

    Args:
        states (`list[dict]`):
            [`~grpo_hf.compression.GRPOCommState.state_dict`] of ranks `0 .. W-1`, in rank order.
        numels (`dict[str, int]`):
            Elements of each tensor, by parameter name.
        plan (`dict[str, CodecSpec | None]`):
            The compression plan the states were written with (block sizes of the owner chunks).
    """
    world_size = len(states)
    names = sorted({name for s in states for key in ("residuals", "owner_residuals") for name in s.get(key, {})})
    owed = {}
    for name in names:
        if name not in numels or plan.get(name) is None:
            raise CheckpointError(
                f"the checkpoint holds residuals for {name!r}, which this run does not compress; resume with the same "
                "model, adapters and compression settings as the run that wrote it."
            )
        numel, block = numels[name], plan[name].block_size
        total = torch.zeros(num_blocks(numel, block) * block, dtype=torch.float64)
        for state in states:
            residual = state.get("residuals", {}).get(name)
            if residual is not None:
                total[:numel] += _vector(residual, numel, name, "residual")
        total /= world_size
        bounds = chunk_bounds(num_blocks(numel, block), world_size)
        for rank, state in enumerate(states):
            chunk = state.get("owner_residuals", {}).get(name)
            if chunk is None:
                continue
            start, end = bounds[(rank - chunk_owner(name, world_size)) % world_size]
            size = (end - start) * block
            total[start * block : end * block] += _vector(chunk, size, name, f"rank {rank}'s owner residual")
        owed[name] = total[:numel].float()
    return owed


def _vector(value: torch.Tensor, size: int, name: str, what: str) -> torch.Tensor:
    value = value.reshape(-1).double()
    if value.numel() != size:
        raise CheckpointError(
            f"the checkpoint's {what} of {name!r} has {value.numel()} entries where this model needs {size}; resume "
            "with the same model and compression settings as the run that wrote it."
        )
    return value


def reshard_comm_state(
    states: list[dict],
    numels: dict[str, int],
    plan: dict[str, CodecSpec | None],
    mode: str,
    world_size: int,
    rank: int,
) -> dict:
    """
    The [`~grpo_hf.compression.GRPOCommState.state_dict`] that rank `rank` of `world_size` ranks running in `mode`
    loads to continue the run saved in `states` (one per saved rank, in rank order; see the module docstring).

    Raises:
        [`~grpo_hf.errors.CheckpointError`]: the states disagree on their step (written at different steps) or do not
            fit the model.
    """
    first = states[0]
    for saved_rank, state in enumerate(states):
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(
                f"rank {saved_rank}'s compression state has version {state.get('version')}, expected "
                f"{STATE_VERSION}: it was written by another grpo_hf version."
            )
        if state["step"] != first["step"]:
            raise CheckpointError(
                f"the compression states of ranks 0 and {saved_rank} were written at different steps "
                f"({first['step']} and {state['step']}): the checkpoint mixes files of two saves. Resume from "
                "another checkpoint."
            )
    return {
        "version": STATE_VERSION,
        "mode": mode,
        "world_size": world_size,
        "rank": rank,
        "step": first["step"],
        "hook_calls": first.get("hook_calls", 0),
        "residuals": owed_residuals(states, numels, plan),
        "owner_residuals": {},
        "totals": dict(first.get("totals", {})),
    }


__all__ = ["STATE_VERSION", "owed_residuals", "reshard_comm_state"]
