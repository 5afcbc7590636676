"""`W` ranks as threads of one process, for the tests of the exchange and the sync (`tests/test_codes.py`,
`tests/test_outer_sync.py`): every collective of a [`ThreadCommunicator`] meets the other threads at a barrier.

Example:

```python
>>> from thread_ranks import ThreadRanks
>>> means = ThreadRanks(3).run(lambda comm: comm.all_reduce(torch.ones(2)))  # each rank's result, in rank order
```
"""

import threading

import torch
import torch.distributed as dist

from grpo_hf.compression.communicator import Communicator


class ThreadRanks:
    """
    `world_size` ranks, each in its own thread: [`run`] calls `work(communicator)` on every rank and returns their
    results in rank order; the first error of a rank is raised (the others are released from the barrier).
    `splits[rank]` is what rank `rank` last sent to each rank in an all-to-all (its `send_splits`).
    """

    def __init__(self, world_size):
        self.world_size, self.barrier, self.held = world_size, threading.Barrier(world_size), [None] * world_size
        self.splits = [None] * world_size

    def run(self, work):
        out, errors = [None] * self.world_size, []

        def one(rank):
            try:
                out[rank] = work(ThreadCommunicator(self, rank))
            except BaseException as error:  # (the other ranks would wait forever at the barrier)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return out


class ThreadCommunicator(Communicator):
    """One rank of [`ThreadRanks`], through the door a real communicator comes in by."""

    def __init__(self, threads, rank):
        super().__init__(emulated=False)
        self.threads, self.rank, self.world_size = threads, rank, threads.world_size

    def duplicate(self):
        """A twin over the same threads: every collective completes at once, in the order each rank calls it, so the
        twin's and this one's cannot interleave differently on two ranks."""
        return ThreadCommunicator(self.threads, self.rank)

    def _meet(self, value):
        self.threads.held[self.rank] = value
        self.threads.barrier.wait()
        everyone = list(self.threads.held)
        self.threads.barrier.wait()
        return everyone

    def _all_reduce(self, tensor, op):
        stacked = torch.stack(self._meet(tensor.clone()))
        tensor.copy_(stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0))
        return []

    def _all_gather_into(self, out, mine, tag):
        everyone = self._meet(mine.clone())
        out.view(self.world_size, -1).copy_(torch.stack(everyone))
        return []

    def _all_to_all(self, recv, send, recv_splits, send_splits):
        self.threads.splits[self.rank] = list(send_splits)
        parts = self._meet(torch.split(send.clone(), send_splits))
        recv.copy_(torch.cat([parts[r][self.rank] for r in range(self.world_size)]))

    def _broadcast(self, tensor, src):
        tensor.copy_(self._meet(tensor.clone())[src])
        return []


__all__ = ["ThreadCommunicator", "ThreadRanks"]
