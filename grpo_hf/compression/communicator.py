"""The way to the wire of every transport: [`Communicator`], [`ProcessGroupCommunicator`], [`Started`], and the hook
point of the benchmarks' emulated slow link ([`EMULATED_LINK`]).

Every collective of the three transports (the DDP hook, FSDP2's compressed reduce-scatter, the sync every H steps, and
the replica groups' own small collectives) goes through a [`Communicator`]. A transport is handed its communicator (a
constructor argument); it does not build it, as torchft's fragment takes its manager. The base class does what every
implementation needs the same way: the world size 1 shortcut (every call returns its input), the timing (the
communicator adds up its time spent communicating, waiting for other ranks included, in `comm_ms`, which the transport
moves into its step's statistics when it closes the step: [`Communicator.pop_comm_ms`]) and the emulated link. An
implementation only starts the collectives themselves (`_all_reduce`, `_all_gather_into`, `_all_to_all`,
`_broadcast`), tells its `world_size` and `rank`, makes a twin on a group of its own ([`Communicator.duplicate`]) and
answers [`Communicator.commit`]. Bytes are not counted here: the exchange counts them once, by the formulas of
`traffic.py`.

[`ProcessGroupCommunicator`] runs over a `torch.distributed` process group (today's, and the only implementation so
far). A fault-tolerant one (torchft's managed process group) answers [`Communicator.commit`] with whether every
collective since the last commit succeeded and enough replicas took part.

## An emulated slow link (a benchmark tool)

A benchmark that measures what a slow link costs (`benchmarks/bench_step_cost.py --link_gbit`) installs its link in
[`EMULATED_LINK`] before any communicator is made (`benchmarks/emulated_link.py`, which holds the link and delays the
baselines' DDP hooks on it too). Every collective of a [`Communicator`] made then with `emulated=True` (the default)
completes no earlier than the link would have carried the bytes this rank sends in it; the wait is in
`Started.wait()`, so that what runs between the start and the wait overlaps with it. Not a training setting: in
training it is `None`, and nothing waits. FSDP2's own collectives (its parameter all-gathers), and those inside a
replica group (the machine's own link), are not emulated.
"""

import time

import torch
import torch.distributed as dist

from .traffic import allgather_bytes, allreduce_bytes, alltoall_bytes


# The benchmarks' emulated slow link, or `None` (training): an object whose `reserve(nbytes)` puts `nbytes` on the link
# now and returns the `time.perf_counter()` time at which they have arrived. Read by each communicator when it is made.
EMULATED_LINK = None


def _sleep_until(deadline: float) -> None:
    """Sleep until `time.perf_counter()` reaches `deadline` (at once if it has)."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class Communicator:
    r"""
    The collectives of one group of ranks, timed; at world size 1 every call returns its input. Under a benchmark's
    emulated link (read from [`EMULATED_LINK`] when built, with `emulated=True`) each one also waits for the link.

    Subclasses give `world_size` and `rank`, and override the primitives `_all_reduce`, `_all_gather_into`,
    `_all_to_all` and `_broadcast` (each called only at world size 2 or more), [`duplicate`] and, where collectives can
    fail without raising, [`commit`].

    Args:
        emulated (`bool`, *optional*, defaults to `True`): whether its collectives wait for the emulated slow link
            (when a benchmark installed one); `False` for a machine's own fast link.

    Attributes:
        comm_ms (`float`): milliseconds spent in its collectives since the last [`pop_comm_ms`].
    """

    world_size: int
    rank: int

    def __init__(self, emulated: bool = True):
        self.emulated = emulated
        self.link = EMULATED_LINK if emulated else None
        self.comm_ms = 0.0

    # --- what an implementation provides ---
    @property
    def device(self) -> torch.device:
        """Where the small tensors this communicator reduces (flags) must live: the CPU unless the backend says so."""
        return torch.device("cpu")

    def commit(self) -> bool:
        """
        Whether every collective since the last commit succeeded, with enough ranks taking part: what a transport asks
        before it keeps the outcome of an exchange. Always `True` here: a failed collective raises.
        """
        return True

    # --- membership that changes (fault-tolerant replica groups); fixed here ---
    elastic = False  # whether the ranks may change between syncs (then `world_size` and `rank` are read at each)
    attempts = 1  # exchanges a sync tries before it is discarded (a failed one is tried again over the survivors)
    membership_changed = False  # whether the last quorum changed the ranks (owner residuals then start afresh)
    members: tuple[int, ...] | None = None  # the replica groups of the current quorum, by replica id (elastic only)

    def reconfigure(self, step: int, checksum=None) -> None:
        """After an exchange that did not [`commit`]: the ranks still alive, for the next attempt (nothing here)."""

    def next_interval(self, step: int, checksum=None) -> None:
        """At the start of an interval (trainer step `step`, after the step that synced): a new membership, at which
        late ranks join (`checksum()`: of this rank's global model, which the members compare when the ranks changed);
        nothing changes here."""

    def join(self, **kwargs) -> dict | None:
        """At train start: the first membership (fault-tolerant replica groups take their first quorum, and a late
        one heals from a live one: the state it received); nothing to join here (`None`)."""
        return None

    def shutdown(self) -> None:
        """At train end: leave the membership (a fault-tolerant group leaves its quorum); nothing here."""

    def duplicate(self) -> "Communicator":
        """A twin over the same ranks, on a group of its own (its collectives do not queue behind this one's).
        Collective: every rank calls it, in the same order."""
        raise NotImplementedError(f"{type(self).__name__} cannot make a twin of itself.")

    def _all_reduce(self, tensor: torch.Tensor, op) -> list:
        """Start an in-place all-reduce of `tensor`; the handles to wait for."""
        raise NotImplementedError

    def _all_gather_into(self, out: torch.Tensor, mine: torch.Tensor, tag: int) -> list:
        """Start the all-gather of the flat `mine` into the flat `out` (`world_size` equal parts, this rank's may be
        `mine` already); the handles to wait for."""
        raise NotImplementedError

    def _all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]):
        """`all_to_all_single` with uneven splits, blocking."""
        raise NotImplementedError

    def _broadcast(self, tensor: torch.Tensor, src: int) -> list:
        """Start the broadcast of `tensor` (in place) from the group rank `src`; the handles to wait for."""
        raise NotImplementedError

    # --- small agreements every caller needs (built on the collectives) ---
    def ordered_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the ranks, added in rank order: the same bits on every rank (an all-reduce may add
        in another order on each)."""
        if self.world_size == 1:
            return value
        parts = self.all_gather(value.contiguous())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def agree(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (one all-reduce of one integer): ranks that must choose alike (e.g. a
        compiled kernel or the eager one) ask this."""
        if self.world_size == 1:
            return bool(flag)
        return bool(self.all_reduce(torch.tensor([int(flag)], device=self.device), op=dist.ReduceOp.MIN).item())

    def barrier(self) -> None:
        """Every rank waits here until all have come (a small all-reduce)."""
        if self.world_size > 1:
            self.all_reduce(torch.zeros(1, device=self.device))

    # --- the collectives, timed ---
    def pop_comm_ms(self) -> float:
        """The milliseconds spent communicating since the last call (then cleared), for the step's statistics."""
        spent, self.comm_ms = self.comm_ms, 0.0
        return spent

    def _timed(self, start: float) -> None:
        self.comm_ms += (time.perf_counter() - start) * 1000

    def _on_link(self, nbytes: float) -> float | None:
        """When `nbytes` sent now arrive over the emulated link; `None` without one."""
        return None if self.link is None else self.link.reserve(nbytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """An in-place all-reduce of `tensor`; returns `tensor`."""
        return self.start_all_reduce(tensor, op).wait()

    def start_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> "Started":
        """An in-place all-reduce of `tensor`, under way; `wait()` returns `tensor`."""
        if self.world_size == 1:
            return Started(self, [], tensor)
        start = time.perf_counter()
        not_before = self._on_link(allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size))
        works = self._all_reduce(tensor, op)
        self._timed(start)
        return Started(self, works, tensor, not_before)

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
        works = self._all_gather_into(out, mine, tag)
        self._timed(start)
        return Started(self, works, out.view(self.world_size, *tensor.shape), not_before)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """`all_to_all_single` with uneven splits: `send_splits[j]` elements go to rank `j`."""
        if self.world_size == 1:
            return send
        start = time.perf_counter()
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        not_before = self._on_link(alltoall_bytes(send.numel() * send.element_size(), self.world_size))
        self._all_to_all(recv, send, recv_splits, send_splits)
        if not_before is not None:
            _sleep_until(not_before)
        self._timed(start)
        return recv

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`tensor` becomes the group rank `src`'s, in place (on the link: the tensor once, as a pipelined ring
        forwards it); returns `tensor`."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        not_before = self._on_link(tensor.numel() * tensor.element_size())
        works = self._broadcast(tensor, src)
        self._timed(start)
        return Started(self, works, tensor, not_before).wait()


class ProcessGroupCommunicator(Communicator):
    r"""
    A [`Communicator`] over a `torch.distributed` process group: nothing fails silently there ([`commit`] is always
    `True`). Its world size and rank are read from the group when first asked for after `torch.distributed` is
    initialized (1 and 0 before, or without it: every call then returns its input), so it may be made before
    `init_process_group`. On gloo, an all-gather of CPU tensors goes as point-to-point sends and receives (gloo's
    all-gather moves large tensors several times slower than its send/recv, benchmarks/LOG.md); the same bytes.

    Example:

    ```python
    >>> comm = ProcessGroupCommunicator()  # the default group
    >>> comm.all_reduce(torch.ones(3))  # tensor([W, W, W])
    ```

    Args:
        group (`torch.distributed.ProcessGroup`, *optional*): the group; the default one when `None`.
        emulated (`bool`, *optional*, defaults to `True`): see [`Communicator`].
        peers (`list[list[int]]`, *optional*): the global ranks of every group made alongside this one (this one's
            among them), in the order they were made: [`duplicate`] makes a twin of each, as `torch.distributed.new_group`
            asks (collectively, on every rank of the world). `None`: this group's ranks alone.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, emulated: bool = True, peers: list | None = None):
        super().__init__(emulated)
        self.group = group
        self.peers = peers
        self._sizes: tuple[int, int] | None = None  # (world size, rank), once torch.distributed is initialized
        self._point_to_point: bool | None = None

    def _read(self) -> tuple[int, int]:
        if self._sizes is None:
            if not (dist.is_available() and dist.is_initialized()):
                return 1, 0
            self._sizes = (dist.get_world_size(self.group), dist.get_rank(self.group))
        return self._sizes

    @property
    def world_size(self) -> int:
        return self._read()[0]

    @property
    def rank(self) -> int:
        return self._read()[1]

    @property
    def point_to_point(self) -> bool:
        """Whether an all-gather of CPU tensors goes as sends and receives (gloo)."""
        if self._point_to_point is None:
            self._point_to_point = self.world_size > 1 and dist.get_backend(self.group) == "gloo"
        return self._point_to_point

    @property
    def device(self) -> torch.device:
        """CUDA under NCCL (it reduces CUDA tensors only), else the CPU."""
        if self.world_size > 1 and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda")
        return torch.device("cpu")

    def global_ranks(self) -> list[int]:
        """The global ranks of the group, in group order."""
        return dist.get_process_group_ranks(self.group or dist.group.WORLD)

    def duplicate(self) -> "ProcessGroupCommunicator":
        """
        A twin over the same ranks on a process group of its own: NCCL runs one group's collectives in order, so that
        what the twin starts does not hold back this one's. Every rank makes every peer's twin (`peers`), in the same
        order; the twin keeps this one's link and peers.
        """
        peers = self.peers if self.peers is not None else [self.global_ranks()]
        mine, me = None, dist.get_rank()
        for members in peers:
            group = dist.new_group(members)
            if me in members:
                mine = group
        return ProcessGroupCommunicator(mine, emulated=self.emulated, peers=peers)

    def _all_reduce(self, tensor, op) -> list:
        return [dist.all_reduce(tensor, op=op, group=self.group, async_op=True)]

    def _all_gather_into(self, out, mine, tag) -> list:
        if self.point_to_point and mine.device.type == "cpu":  # each rank's part to every other: a ring's bytes
            parts = out.view(self.world_size, -1)
            if mine.data_ptr() != parts[self.rank].data_ptr():
                parts[self.rank].copy_(mine)
            works = []
            for peer in range(self.world_size):
                if peer != self.rank:
                    works.append(dist.isend(mine, group=self.group, group_dst=peer, tag=tag))
                    works.append(dist.irecv(parts[peer], group=self.group, group_src=peer, tag=tag))
            return works
        return [dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)]

    def _all_to_all(self, recv, send, recv_splits, send_splits) -> None:
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)

    def _broadcast(self, tensor, src) -> list:
        return [dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)]

    def __getstate__(self):
        """Pickled without its process group (it belongs to the process that made it): the default group after."""
        return {"emulated": self.emulated, "peers": self.peers}

    def __setstate__(self, state):
        self.__init__(None, state["emulated"], state["peers"])

    def __repr__(self) -> str:
        where = "default group" if self.group is None else "own group"
        return f"ProcessGroupCommunicator({where}, world_size={self.world_size}, rank={self.rank})"


class SoloCommunicator(Communicator):
    """One rank alone: every collective returns its input (what the one-process preview of the DDP hook exchanges
    through, whatever the world size around it)."""

    world_size, rank = 1, 0

    def __init__(self):
        super().__init__(emulated=False)

    def duplicate(self) -> "SoloCommunicator":
        return SoloCommunicator()


def process_rank(args=None) -> tuple[int, int]:
    """
    This process's rank and the world size: torch.distributed's when it is initialized (Accelerate's state reports
    process 0 on every rank of a DeepSpeed run on CPU), else the Trainer arguments' `process_index` and `world_size`
    (`0, 1` without them).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if args is None:
        return 0, 1
    return args.process_index, args.world_size


class Started:
    """
    A collective under way: [`wait`] returns its result; the time spent waiting counts as communication. Under an
    emulated link, `not_before` is when its bytes have crossed the link: [`wait`] returns no earlier.
    """

    def __init__(self, communicator: Communicator, works: list, result: torch.Tensor, not_before: float | None = None):
        self.communicator, self.works, self.result, self.not_before = communicator, works, result, not_before

    def wait(self) -> torch.Tensor:
        if self.works or self.not_before is not None:
            start = time.perf_counter()
            for work in self.works:
                work.wait()
            if self.not_before is not None:
                _sleep_until(self.not_before)
            self.works, self.not_before = [], None
            self.communicator._timed(start)
        return self.result


__all__ = [
    "EMULATED_LINK",
    "Communicator",
    "ProcessGroupCommunicator",
    "SoloCommunicator",
    "Started",
    "process_rank",
]
