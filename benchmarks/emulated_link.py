"""The emulated slow link for the collectives that do not go through GRPO's `Collectives` (`bench_step_cost.py --link_gbit`).

GRPO's own collectives wait for the link in `grpo_hf/compression/collectives.py` ([`~grpo_hf.compression.collectives.EmulatedLink`],
turned on by `GRPO_HF_EMULATED_LINK_GBIT`). The baselines send through DDP: its built-in all-reduce, or torch's
`fp16_compress_hook` / `powerSGD_hook`. Here a DDP comm hook is wrapped so that its future completes no earlier than
the same link carries the bytes the hook sends (ring model): the hook returns at once, as before, and DDP waits for
the future at the end of the backward pass, so the link's time lands on the step unless the backward overlaps it, as
on a real link. The same [`EmulatedLink`] object serves both, so that every collective of a process shares one link.

Registering a Python hook in place of DDP's built-in all-reduce (`default_hooks.allreduce_hook`, the same collective)
adds a little Python per bucket to the plain Trainer's step; only under `--link_gbit`.
"""

import threading
import time
from collections.abc import Callable

import torch


def delayed(hook: Callable, sent_bytes: Callable, link) -> Callable:
    """
    `hook` (a DDP communication hook) behind an emulated link: its future completes once the hook's own future has and
    `link` has carried `sent_bytes(state, bucket)` bytes put on it when the hook was called.

    Args:
        hook (`Callable`): the DDP comm hook, `hook(state, bucket) -> torch.futures.Future`.
        sent_bytes (`Callable`): `sent_bytes(state, bucket) -> float`, what this rank sends for the bucket, computed
            before the hook runs (PowerSGD's counts depend on its iteration, which the hook advances).
        link ([`~grpo_hf.compression.collectives.EmulatedLink`]): the link, shared with GRPO's collectives.

    Returns:
        `Callable`: the wrapped hook. Its future is completed from a timer thread, never from the caller's: a future
        already done when the hook returns (torch's hooks wait inside `suite.torch_hook_trainer`) does not put the
        wait on the backward pass.
    """

    def wrapper(state, bucket):
        deadline = link.reserve(sent_bytes(state, bucket))
        arrived = torch.futures.Future()

        def on_done(future: torch.futures.Future) -> None:
            try:
                value = future.value()
            except Exception as error:  # the collective failed: DDP sees the error, not a hang
                arrived.set_exception(error)
                return
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                arrived.set_result(value)
            else:
                threading.Timer(remaining, arrived.set_result, args=(value,)).start()

        hook(state, bucket).add_done_callback(on_done)
        return arrived

    return wrapper


def delayed_allreduce(world_size: int, link) -> Callable:
    """DDP's own all-reduce (torch's `allreduce_hook`, the built-in hook in Python) behind `link`: the plain Trainer."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from grpo_hf.compression.traffic import allreduce_bytes

    def sent_bytes(state, bucket) -> float:
        buffer = bucket.buffer()
        return allreduce_bytes(buffer.numel() * buffer.element_size(), world_size)

    return delayed(default_hooks.allreduce_hook, sent_bytes, link)
