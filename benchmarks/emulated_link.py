"""The emulated slow link of the benchmarks (`bench_step_cost.py --link_gbit`): [`EmulatedLink`], turned on by the
environment variable `GRPO_HF_EMULATED_LINK_GBIT` ([`install`]), for GRPO's collectives and for DDP's.

GRPO's own collectives go through a `Communicator` (`grpo_hf/compression/communicator.py`), whose hook point
`EMULATED_LINK` [`install`] sets: each then completes no earlier than the link has carried its bytes. The baselines
send through DDP: its built-in all-reduce, or torch's `fp16_compress_hook` / `powerSGD_hook`. Here a DDP comm hook is
wrapped ([`delayed`]) so that its future completes no earlier than the same link carries the bytes the hook sends (ring
model): the hook returns at once, as before, and DDP waits for the future at the end of the backward pass, so the
link's time lands on the step unless the backward overlaps it, as on a real link. The same [`EmulatedLink`] object
serves both, so that every collective of a process shares one link.

Registering a Python hook in place of DDP's built-in all-reduce (`default_hooks.allreduce_hook`, the same collective)
adds a little Python per bucket to the plain Trainer's step; only under `--link_gbit`.
"""

import os
import threading
import time
from collections.abc import Callable

import torch


LINK_ENV = "GRPO_HF_EMULATED_LINK_GBIT"


class EmulatedLink:
    r"""
    A slow link between the ranks, emulated on a fast one (loopback) so that a benchmark measures what the link costs,
    overlap included, instead of adding `bytes / speed` to a step measured without it.

    One transfer at a time, as one network interface sends: a collective started at `t` with `nbytes` to send (what
    this rank sends under the ring model of `grpo_hf.compression.traffic`, the same count as `grpo/comm/bytes_sent`)
    arrives at `max(t, end of the transfers already on the link) + nbytes / bytes_per_second`. Its handle's wait
    blocks until then, and until the real collective is done. Latency is not emulated, only bandwidth; so the emulated
    wire time of a step is its `bytes_sent` divided by the speed, the projection's figure.

    Args:
        gbit (`float`): the link's speed in Gbit/s (10^9 bits per second), above 0.
    """

    def __init__(self, gbit: float):
        if not gbit > 0:
            raise ValueError(f"the emulated link's speed must be above 0 Gbit/s, got {gbit}.")
        self.gbit = gbit
        self.bytes_per_second = gbit * 1e9 / 8
        self.free_at = 0.0  # `time.perf_counter()` at which the transfers already on the link are done
        self._lock = threading.Lock()  # DDP may call a hook on the autograd engine's threads

    @classmethod
    def from_environment(cls) -> "EmulatedLink | None":
        """The link `GRPO_HF_EMULATED_LINK_GBIT` asks for; `None` when it is unset or empty."""
        value = os.environ.get(LINK_ENV, "").strip()
        if not value:
            return None
        try:
            return cls(float(value))
        except ValueError as err:
            raise ValueError(f"{LINK_ENV}={value!r}: use a speed in Gbit/s above 0, e.g. 1 or 10 ({err}).") from None

    def reserve(self, nbytes: float) -> float:
        """Put `nbytes` on the link now; returns the `time.perf_counter()` time at which they have arrived."""
        with self._lock:
            self.free_at = max(time.perf_counter(), self.free_at) + nbytes / self.bytes_per_second
            return self.free_at

    @staticmethod
    def wait_until(deadline: float) -> None:
        """Sleep until `time.perf_counter()` reaches `deadline` (at once if it has)."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def install() -> EmulatedLink | None:
    """
    The link `GRPO_HF_EMULATED_LINK_GBIT` asks for ([`EmulatedLink.from_environment`]), made the one GRPO's
    communicators wait for (`grpo_hf.compression.communicator.EMULATED_LINK`; `None` clears it). Call it in the worker
    before the trainer (or any GRPO state) is built: a communicator reads the link when it is made.
    """
    from grpo_hf.compression import communicator

    communicator.EMULATED_LINK = EmulatedLink.from_environment()
    return communicator.EMULATED_LINK


def delayed(hook: Callable, sent_bytes: Callable, link) -> Callable:
    """
    `hook` (a DDP communication hook) behind an emulated link: its future completes once the hook's own future has and
    `link` has carried `sent_bytes(state, bucket)` bytes put on it when the hook was called.

    Args:
        hook (`Callable`): the DDP comm hook, `hook(state, bucket) -> torch.futures.Future`.
        sent_bytes (`Callable`): `sent_bytes(state, bucket) -> float`, what this rank sends for the bucket, computed
            before the hook runs (PowerSGD's counts depend on its iteration, which the hook advances).
        link ([`EmulatedLink`]): the link, shared with GRPO's collectives.

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
