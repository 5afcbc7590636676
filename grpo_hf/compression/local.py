"""`compress_locally`: the compression of the DDP hook applied in a single process (the article's sparse updates).

Nothing is sent, so the bytes are those one of `state.simulated_world_size` workers would send, from the sizes of
this process's messages (the ring formulas of [`~grpo_hf.compression.traffic`], as in the hook). The gradients go
through the same codec and error feedback as under DDP: in `allreduce` mode twice (the worker's compression, then
the owner's), as each worker's contribution would.
"""

import time

from torch import nn

from .codec import all_finite
from .exchange import Collectives, track_dense_scales
from .hook import bucket_layout, exchange_bucket
from .state import GRPOCommState


def compress_locally(state: GRPOCommState, model: nn.Module) -> None:
    """
    Replace every `p.grad` by its compressed-and-decoded value, with error feedback. Call it after the backward of
    the last micro-batch, before clipping and `optimizer.step`. Warm-up steps and steps with NaN/Inf gradients leave
    the gradients untouched (the latter also the residuals).

    Args:
        state (`GRPOCommState`): the compression state (bound to `model` if it was not yet).
        model (`torch.nn.Module`): the model whose gradients to compress.
    """
    start = time.perf_counter()
    if not state.names:
        state.bind(model)
    world_size = state.simulated_world_size
    params = [(state.names.get(id(p)), p) for p in model.parameters() if p.requires_grad and p.grad is not None]
    names = [name for name, _ in params]
    grads = [p.grad.view(-1) for _, p in params]
    stats = state._step
    numel = sum(g.numel() for g in grads)
    stats.baseline(numel, world_size)
    warmup = state.warming_up
    comm = Collectives(state, world_size=1, rank=0)
    if not exchange_bucket(state, comm, grads, names, world_size):
        stats.dense(numel, world_size)
        if not all_finite(grads):  # a warm-up step: keep NaN/Inf out of the gradient scales
            state.mark_nonfinite()
        elif warmup:
            segments, members, _ = bucket_layout(state, names, [g.numel() for g in grads])
            track_dense_scales(state, segments, [[grads[i] for i in indices] for indices in members])
    stats.hook_ms += (time.perf_counter() - start) * 1000
    state.hook_calls += 1
    state.commit_step(dense=warmup)


__all__ = ["compress_locally"]
