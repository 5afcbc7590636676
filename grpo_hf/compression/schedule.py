"""The schedule of the sync every H steps (pure functions): the ramp, each fragment's offset, the fragments due after a
step. [`~grpo_hf.compression.outer_sync.OuterSyncState`] follows it; `outer_sync.py`'s module docstring says why.
"""

from ..choices import DEFAULT_SYNC_RAMP


def ramp_points(every: int) -> list[int]:
    """
    The steps after which every fragment syncs while the interval ramps up: intervals 1, 2, 4, … below `every`, so
    `[1, 3, 7, 15]` for `every=16` and `[]` for `every <= 1`.
    """
    points, interval, step = [], 1, 0
    while interval < every:
        step += interval
        points.append(step)
        interval *= 2
    return points


def fragment_offsets(every: int, fragments: int) -> list[int]:
    """Step of each fragment's first sync after the ramp, counted from its end: `ceil((f + 1) * every / fragments)`."""
    return [-(-(f + 1) * every // fragments) for f in range(fragments)]


def fragments_due(step: int, every: int, fragments: int = 1, ramp: bool = DEFAULT_SYNC_RAMP) -> list[int]:
    """
    The fragments that sync after optimizer step `step` (1 for the first step of training).

    Args:
        step (`int`): optimizer steps taken, this one included.
        every (`int`): `H`, the steps between two syncs of one fragment.
        fragments (`int`, *optional*, defaults to `1`): `F`; fragment `f` syncs at offset `ceil((f + 1) H / F)` of
            every interval, so that fragment `F - 1` syncs when one fragment would.
        ramp (`bool`, *optional*, defaults to `True`): first sync every fragment after steps 1, 3, 7, …
            ([`ramp_points`]), then start the intervals of `H`.
    """
    points = ramp_points(every) if ramp else []
    if points and step <= points[-1]:
        return list(range(fragments)) if step in points else []
    since = step - (points[-1] if points else 0)
    return [f for f, offset in enumerate(fragment_offsets(every, fragments)) if (since - offset) % every == 0]


__all__ = ["fragment_offsets", "fragments_due", "ramp_points"]
