"""Every byte formula of grpo_hf: what one rank sends per collective under the ring model, and the dense baselines."""


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of an `nbytes` message: `2 (W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of an `nbytes` message per rank: `(W - 1) * nbytes`."""
    _check_world_size(world_size)
    return float((world_size - 1) * nbytes)


def broadcast_bytes(nbytes: float, world_size: int) -> float:
    """Average bytes per rank to broadcast `nbytes` (W - 1 ranks receive it once): `(W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return (world_size - 1) / world_size * nbytes


def alltoall_bytes(nbytes: float, world_size: int) -> float:
    """Average bytes per rank of an all-to-all of `nbytes`-byte buffers split over `W` ranks: `(W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return (world_size - 1) / world_size * nbytes


def dense_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> float:
    """The uncompressed baseline: one ring all-reduce of `numel` gradient entries of `element_size` bytes."""
    return allreduce_bytes(element_size * numel, world_size)


__all__ = ["allgather_bytes", "allreduce_bytes", "alltoall_bytes", "broadcast_bytes", "dense_allreduce_bytes"]
