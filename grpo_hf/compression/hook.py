"""`grpo_comm_hook`: the DDP communication hook that sends each bucket's gradients compressed, with error feedback.

It replaces DDP's dense all-reduce (register it on the DDP model, see [`GRPOCommState`]). Per bucket: the tensors
sent dense (`spec is None`: norms, biases, tensors below `grpo_min_compress_numel`) go through one fp32 all-reduce;
the others are grouped into one segment per spec ([`~grpo_hf.compression.layout`]) and exchanged by
[`~grpo_hf.compression.exchange`] in `state.mode`. During the first `dense_warmup_steps` optimizer steps, and for a
step in which a rank sees a NaN or an Inf, the bucket is all-reduced dense in its own dtype, as DDP would.

Example:

```python
>>> from grpo_hf.compression import GRPOCommState, compression_plan, grpo_comm_hook

>>> state = GRPOCommState(compression_plan(model), mode="allgather").bind(model)  # the unwrapped model
>>> ddp_model.register_comm_hook(state, grpo_comm_hook)
>>> ...  # train; every logging step:
>>> state.pop_stats()["grpo/comm/ratio_fp32"]
```

## Bytes per rank and optimizer step (ring model, [`~grpo_hf.compression.traffic`]; `grpo/comm/bytes_sent`)

- `allgather`: `(W - 1) * (16 + s_max)` for the messages (`s_max` the longest rank's, every message padded to it)
  plus `2 (W - 1) / W * 4 n_dense` for the dense tensors. Grows with `W`: for few workers.
- `allreduce`: `(W - 1) / W * S` for the all-to-all of the compressed blocks (`S` this rank's messages) plus
  `(W - 1) * s_owner` for the all-gather of the owners' messages (about `S / W` each) plus the dense tensors: about
  `2 S` whatever `W`.
- Warm-up and non-finite steps: `2 (W - 1) / W` times the bucket's bytes in its dtype.

## Non-finite gradients

A NaN or an Inf in any gradient of any rank, in any bucket, makes the whole optimizer step non-finite on every rank
(a flag in the first collective of a compressed bucket; the all-reduced buffer itself for a dense one): the affected
buckets are all-reduced raw, so the NaN/Inf reaches every rank's gradients, and the residuals, owner residuals and
gradient scales staged for the step are discarded. [`~grpo_hf.GRPOTrainer`] then skips the optimizer step.

The baselines `grpo/comm/bytes_dense_fp32` / `_fp16` are a plain all-reduce of every gradient at 4 / 2 bytes per
entry; `ratio_* = baseline / bytes_sent` (higher is better).

## Warnings

- Call [`GRPOCommState.bind`] with the model before the first backward, and `register_comm_hook` once per DDP
  object (a second call raises). Use one state per DDP model.
- The plan, `mode` and `dense_warmup_steps` must be identical on every rank: the collectives' sizes derive from them.
- Collectives run synchronously inside the hook, in the same order on every rank (torch's `powerSGD_hook`, which
  chains collectives in future callbacks, was seen to desynchronize at `W = 4` on gloo). The price: a bucket's
  communication does not overlap with the rest of the backward pass.
- Memory per compressed entry and rank: the fp32 residual (twice, while a step's new one is staged) and, with
  gradient scales, the fp32 EMA of its square (twice as well); in `allreduce` mode also the residual of the owned
  blocks (`1 / W` of the entries, twice).
- Sparse gradients (`nn.Embedding(sparse=True)`), FSDP and DeepSpeed are not supported.
"""

import time

import torch
import torch.distributed as dist

from .codec import all_finite
from .exchange import (
    Collectives,
    allgather_segments,
    allreduce_segments,
    dense_entries,
    track_dense_scales,
)
from .layout import plan_segments
from .state import GRPOCommState
from .traffic import allreduce_bytes


def bucket_layout(state: GRPOCommState, names: list[str | None], numels: list[int]):
    """The segments of a bucket and the indices of its dense entries (cached per layout: DDP keeps its buckets)."""
    key = tuple(names)
    layout = state._segments.get(key)
    if layout is None:
        specs = [state.spec_for(name) for name in names]
        entries = [(name, numel, spec) for name, numel, spec in zip(names, numels, specs) if spec is not None]
        dense = [i for i, spec in enumerate(specs) if spec is None]
        members = {}
        for i, spec in enumerate(specs):
            if spec is not None:
                members.setdefault(spec, []).append(i)
        layout = (plan_segments(entries), list(members.values()), dense)
        state._segments[key] = layout
    return layout


def exchange_bucket(
    state: GRPOCommState, comm: Collectives, grads: list[torch.Tensor], names, count_as: int, buffer=None
) -> bool:
    """
    Average `grads` (flat gradient tensors of one bucket, written in place; `buffer` the flat tensor they are views
    of, when there is one) over the ranks, compressed as the plan says. Returns `False` when the step must go dense
    (warm-up or a NaN/Inf on some rank); nothing was written then.
    """
    segments, members, dense = bucket_layout(state, names, [g.numel() for g in grads])
    if state.warming_up or not segments:
        return False
    seg_grads = [[grads[i] for i in indices] for indices in members]
    exchange = allgather_segments if state.mode == "allgather" else allreduce_segments
    # The flag covers the dense entries too: a NaN anywhere in the step must leave every residual unchanged.
    finite = all_finite([buffer] if buffer is not None else grads)  # one pass over the bucket when it is flat
    if not exchange(state, comm, segments, seg_grads, count_as, finite):
        state.mark_nonfinite()
        return False
    dense_entries(comm, state._step, [grads[i] for i in dense], count_as)
    return True


def grpo_comm_hook(state: GRPOCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""
    DDP communication hook: the bucket's gradients averaged over the ranks, compressed with error feedback as
    `state.plan` and `state.mode` say (see the module docstring).

    The module does not use `from __future__ import annotations`: DDP's `register_comm_hook` compares this
    function's annotations with `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` as objects.

    Args:
        state (`GRPOCommState`): plan, residuals and statistics; [`GRPOCommState.bind`] must have been called.
        bucket (`torch.distributed.GradBucket`): the bucket of flattened gradients DDP hands to the hook.

    Returns:
        A completed `torch.futures.Future` holding `bucket.buffer()`, which now holds the averaged gradients.
    """
    start = time.perf_counter()
    if not state.names:
        raise RuntimeError("grpo_comm_hook: call `state.bind(model)` before the first backward pass.")
    buffer = bucket.buffer()
    state.hook_calls += 1
    names = [state.names.get(id(p)) for p in bucket.parameters()]
    if None in names:
        state._warn_once("unknown", "a DDP bucket holds a parameter that `bind` did not see; it is sent dense.")
    stats = state._step
    stats.baseline(buffer.numel(), state.world_size)
    comm = Collectives(state)
    grads = [g.view(-1) for g in bucket.gradients()]
    warmup = state.warming_up
    if not exchange_bucket(state, comm, grads, names, state.world_size, buffer):
        comm.all_reduce(buffer).div_(state.world_size)
        stats.bytes_sent += allreduce_bytes(buffer.numel() * buffer.element_size(), state.world_size)
        stats.kept += buffer.numel()
        if not all_finite([buffer]):  # the same answer on every rank: the buffer is the all-reduced one
            state.mark_nonfinite()  # a warm-up step or a dense bucket: keep NaN/Inf out of the scales and residuals
        elif warmup:
            segments, members, _ = bucket_layout(state, names, [g.numel() for g in grads])
            track_dense_scales(state, segments, [[grads[i] for i in indices] for indices in members])
    stats.hook_ms += (time.perf_counter() - start) * 1000
    if bucket.is_last():
        state.commit_step(dense=warmup)
    return _completed_future(buffer)


def _completed_future(tensor: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future(devices=[tensor.device]) if tensor.device.type != "cpu" else torch.futures.Future()
    future.set_result(tensor)
    return future


__all__ = ["GRPOCommState", "grpo_comm_hook"]
