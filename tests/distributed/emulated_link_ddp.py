"""
The emulated link under real DDP (run by tests/test_emulated_link.py under torchrun, `GRPO_HF_EMULATED_LINK_GBIT` set):
each step's backward pass, which ends with DDP's wait for its buckets, lasts at least the bytes this rank sends over the
link's speed, for DDP's all-reduce behind `benchmarks/emulated_link.py` and for `grpo_comm_hook` through its
`Communicator` (the link installed by `benchmarks.emulated_link.install`).

Usage: GRPO_HF_EMULATED_LINK_GBIT=0.04 torchrun --nproc_per_node 2 emulated_link_ddp.py OUT_DIR
"""

import sys
import time

import torch
import torch.distributed as dist
from _common import write_result
from testing_utils import end_worker
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.emulated_link import delayed_allreduce, install
from grpo_hf.compression import GRPOCommState, compression_plan, grpo_comm_hook
from grpo_hf.compression.traffic import allreduce_bytes


STEPS = 3


def backward_seconds(model: nn.Module) -> list[float]:
    """Per step, the backward pass's seconds: DDP waits for its buckets at its end."""
    seconds = []
    for _ in range(STEPS):
        model.zero_grad()
        loss = model(torch.randn(8, 512)).square().mean()
        start = time.perf_counter()
        loss.backward()
        seconds.append(time.perf_counter() - start)
    return seconds


def main():
    link = install()  # before GRPO's state makes its communicator
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    world_size = dist.get_world_size()
    results = {"world_size": world_size, "bytes_per_second": link.bytes_per_second}

    plain = DistributedDataParallel(nn.Linear(512, 512))  # 262,656 fp32 entries in one bucket
    plain.register_comm_hook(None, delayed_allreduce(world_size, link))
    numel = sum(p.numel() for p in plain.parameters())
    results["ddp"] = {"seconds": backward_seconds(plain), "bytes_per_step": allreduce_bytes(4 * numel, world_size)}

    model = nn.Linear(512, 512)
    state = GRPOCommState(compression_plan(model), dense_warmup_steps=0).bind(model)
    hooked = DistributedDataParallel(model)
    hooked.register_comm_hook(state, grpo_comm_hook)
    seconds = backward_seconds(hooked)  # every step compressed, messages of fixed size: the same bytes per step
    results["grpo"] = {"seconds": seconds, "bytes_per_step": state.totals()["bytes_sent"] / STEPS}

    write_result(sys.argv[1], results)
    end_worker()


if __name__ == "__main__":
    main()
