"""The collectives of a transport, timed, with an emulated slow link for benchmarks: [`Collectives`] and [`Started`].

Every collective of the three transports (the DDP hook, FSDP2's compressed reduce-scatter, the sync every H steps) goes
through [`Collectives`]: it adds the time spent communicating to the transport's
[`~grpo_hf.compression.traffic.StepStats`] and, under an [`EmulatedLink`], waits for the link.

## An emulated slow link (a benchmark tool)

With the environment variable `GRPO_HF_EMULATED_LINK_GBIT` set (e.g. `1`) when the process starts, every collective of
[`Collectives`] completes no earlier than the link would have carried the bytes this rank sends in it
([`EmulatedLink`]); the wait is in `Started.wait()`, so that what runs between the start and the wait overlaps with it.
`benchmarks/bench_step_cost.py --link_gbit` sets it, and delays the baselines' DDP hooks the same way
(`benchmarks/emulated_link.py`). Not a training setting. FSDP2's own collectives (its parameter all-gathers) are not
emulated.
"""

import os
import threading
import time

import torch
import torch.distributed as dist

from .traffic import allgather_bytes, allreduce_bytes, alltoall_bytes


LINK_ENV = "GRPO_HF_EMULATED_LINK_GBIT"


class EmulatedLink:
    r"""
    A slow link between the ranks, emulated on a fast one (loopback) so that a benchmark measures what the link costs,
    overlap included, instead of adding `bytes / speed` to a step measured without it.

    One transfer at a time, as one network interface sends: a collective started at `t` with `nbytes` to send (what
    this rank sends under the ring model of [`~grpo_hf.compression.traffic`], the same count as
    `grpo/comm/bytes_sent`) arrives at `max(t, end of the transfers already on the link) + nbytes / bytes_per_second`.
    Its handle's wait blocks until then, and until the real collective is done. Latency is not emulated, only
    bandwidth; so the emulated wire time of a step is its `bytes_sent` divided by the speed, the projection's figure.

    A benchmark tool, not a training setting: it is turned on by the environment variable `GRPO_HF_EMULATED_LINK_GBIT`
    (Gbit/s), read once when this module is imported, rather than by a `GRPOConfig` field. The variable reaches every
    rank of a `torchrun` launch and any training script unchanged, with no code in the workers; and a setting read
    once costs nothing per collective when it is off ([`EMULATED_LINK`] is then `None`). `benchmarks/` delays the
    collectives that do not go through [`Collectives`] (DDP's own all-reduce, torch's hooks) on the same object.

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


EMULATED_LINK: EmulatedLink | None = EmulatedLink.from_environment()


class Collectives:
    """
    The collectives of one process group, timed; at world size 1 every call returns its input. Under an
    [`EmulatedLink`] (read from [`EMULATED_LINK`] when built) each one also waits for the link.

    Args:
        state: the transport's state: its `process_group`, `world_size`, `rank` and `stats` (the
            [`~grpo_hf.compression.traffic.StepStats`] the time spent communicating is added to).
        world_size (`int`, *optional*) and rank (`int`, *optional*): instead of the state's.
        group (`torch.distributed.ProcessGroup`, *optional*): instead of the state's (the same ranks in the same order).
    """

    def __init__(self, state, world_size: int | None = None, rank: int | None = None, group=None):
        self.group = state.process_group if group is None else group
        self.world_size = state.world_size if world_size is None else world_size
        self.rank = state.rank if rank is None else rank
        self.stats = state.stats
        self.link = EMULATED_LINK
        # gloo's all-gather moves large tensors several times slower than its send/recv (benchmarks/LOG.md)
        self.point_to_point = self.world_size > 1 and dist.get_backend(self.group) == "gloo"

    def _timed(self, start: float) -> None:
        self.stats.comm_ms += (time.perf_counter() - start) * 1000

    def _on_link(self, nbytes: float) -> float | None:
        """When `nbytes` sent now arrive over the emulated link; `None` without one."""
        return None if self.link is None else self.link.reserve(nbytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return self.start_all_reduce(tensor, op).wait()

    def start_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> "Started":
        """An in-place all-reduce of `tensor`, under way; `wait()` returns `tensor`."""
        if self.world_size == 1:
            return Started(self, [], tensor)
        start = time.perf_counter()
        not_before = self._on_link(allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size))
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        self._timed(start)
        return Started(self, [work], tensor, not_before)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, tag: int = 0) -> torch.Tensor:
        """
        `[W, *tensor.shape]`: every rank's `tensor`, in rank order (equal sizes on every rank), written into `out`
        (`W * tensor.numel()` entries) when given; `tensor` may be this rank's part of `out` (gathered in place).
        """
        return self.start_all_gather(tensor, out, tag).wait()

    def start_all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, tag: int = 0) -> "Started":
        """[`all_gather`], under way; `wait()` returns its result. `tag` tells apart send/recv pairs under way at once."""
        if self.world_size == 1:
            return Started(self, [], tensor.unsqueeze(0) if out is None else out.view(1, *tensor.shape))
        start = time.perf_counter()
        if out is None:
            out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        mine = tensor.contiguous().view(-1)
        not_before = self._on_link(allgather_bytes(mine.numel() * mine.element_size(), self.world_size))
        if self.point_to_point and mine.device.type == "cpu":  # each rank's part to every other: a ring's bytes
            parts = out.view(self.world_size, -1)
            if mine.data_ptr() != parts[self.rank].data_ptr():
                parts[self.rank].copy_(mine)
            works = []
            for peer in range(self.world_size):
                if peer != self.rank:
                    works.append(dist.isend(mine, group=self.group, group_dst=peer, tag=tag))
                    works.append(dist.irecv(parts[peer], group=self.group, group_src=peer, tag=tag))
        else:
            works = [dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)]
        self._timed(start)
        return Started(self, works, out.view(self.world_size, *tensor.shape), not_before)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """`all_to_all_single` with uneven splits: `send_splits[j]` elements go to rank `j`."""
        if self.world_size == 1:
            return send
        start = time.perf_counter()
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        not_before = self._on_link(alltoall_bytes(send.numel() * send.element_size(), self.world_size))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        if not_before is not None:
            EmulatedLink.wait_until(not_before)
        self._timed(start)
        return recv


class Started:
    """
    A collective under way: [`wait`] returns its result; the time spent waiting counts as communication. Under an
    [`EmulatedLink`], `not_before` is when its bytes have crossed the link: [`wait`] returns no earlier.
    """

    def __init__(self, collectives: Collectives, works: list, result: torch.Tensor, not_before: float | None = None):
        self.collectives, self.works, self.result, self.not_before = collectives, works, result, not_before

    def wait(self) -> torch.Tensor:
        if self.works or self.not_before is not None:
            start = time.perf_counter()
            for work in self.works:
                work.wait()
            if self.not_before is not None:
                EmulatedLink.wait_until(self.not_before)
            self.works, self.not_before = [], None
            self.collectives._timed(start)
        return self.result


__all__ = ["EMULATED_LINK", "LINK_ENV", "Collectives", "EmulatedLink", "Started"]
