"""
`grpo_comm_hook` with real gloo collectives (run by tests/test_distributed.py under torchrun, any world size).

Fake buckets let the script know each rank's local gradient exactly, so it can check, per step and mode:
- bit-identical results on every rank;
- error-feedback conservation: `sum_r (grad_r + old_residual_r - new_residual_r) == W * averaged_gradient`, up to the
  bf16 rounding of the residuals;
- dense parameters are plain means; warm-up steps are plain means;
- a NaN/Inf on one rank: every rank sends that bucket dense and keeps all residuals of the step;
- bf16 buckets come back bf16 and identical.
Then a real `DistributedDataParallel` bf16 model with an unused branch (find_unused_parameters=True) trains with the
hook in each mode and its replicas must stay identical.

Usage: torchrun --nproc_per_node W hook_collectives.py OUT_DIR  (trainer_ddp.py also runs `run_all` at W = 2)
"""

import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, tensor_digest, write_result
from testing_utils import FakeBucket, end_worker
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from grpo_hf.compression import CodecSpec, GRPOCommState, grpo_comm_hook
from grpo_hf.compression.layout import chunk_bounds, chunk_owner


SHAPES = {"attn": (40, 30), "mlp": (1000,), "norm": (64,), "emb": (33, 7)}
BUCKETS = [("attn", "norm"), ("mlp", "emb")]  # buckets mix compressed and dense tensors


def make_params():
    return nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()})


def local_grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    scale = 10.0 ** (step % 3 - 1)  # magnitudes vary between steps
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def held_back(state, name, numel, block=128):
    """
    What error feedback keeps of a tensor on this rank, in units of the sum over ranks: its residual plus `W` times the
    owner residual of the chunk it owns (the owner's residual is in units of the mean).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(-(-numel // block) * block)
    mine = state.residuals.values.get(name)
    if mine is not None:
        total[:numel] += mine
    owned = state.owner_residuals.values.get(name)
    if owned is not None:
        start, end = chunk_bounds(-(-numel // block), world)[(rank - chunk_owner(name, world)) % world]
        total[start * block : end * block] += world * owned
    return total[:numel]


def run_fake(mode, density, bits, steps=6, warmup=1, dtype=torch.float32, inject_step=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    params = make_params()
    plan = {
        "attn": CodecSpec(density, bits),
        "mlp": CodecSpec(density, bits),
        "emb": CodecSpec(min(1.0, density * 2), 8),
        "norm": None,
    }
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=warmup).bind(params)
    checks = {"identical": True, "conservation_max_err": 0.0, "dense_mean_max_err": 0.0, "warmup_max_err": 0.0}
    nonfinite = {}
    for step in range(steps):
        grads = local_grads(step, rank)
        if step == inject_step and rank == world - 1:
            grads["mlp"][3] = float("inf")
        old = {n: held_back(state, n, params[n].numel()) for n in SHAPES}
        outputs, handed = {}, []
        for index, names in enumerate(BUCKETS):
            bucket = FakeBucket(
                [params[n] for n in names],
                [grads[n] for n in names],
                index=index,
                last=index == len(BUCKETS) - 1,
                dtype=dtype,
            )
            handed.append((names, bucket, grpo_comm_hook(state, bucket)))  # as DDP: no wait between buckets
        for names, bucket, future in handed:  # every future completes once the last bucket is handed over
            assert future.wait() is bucket.buffer()
            for n, g in zip(names, bucket.gradients()):
                outputs[n] = g.detach().clone()
        for n in SHAPES:
            checks["identical"] &= same_on_all_ranks(outputs[n])
            assert outputs[n].dtype == dtype
        if step == inject_step:
            nonfinite = {
                "inf_in_output": bool(torch.isinf(outputs["mlp"]).any()),
                "residuals_unchanged": all(
                    torch.equal(held_back(state, n, params[n].numel()), old[n]) for n in SHAPES
                ),
                "dense_steps": state.totals()["dense_steps"],
            }
            continue
        mean = {}
        for n in SHAPES:
            g = grads[n].to(dtype).to(torch.float32).reshape(-1)
            total = g.clone()
            dist.all_reduce(total)
            mean[n] = total / world
            new = held_back(state, n, params[n].numel())
            # what this rank put in minus what it kept, summed over ranks == what all ranks received
            flow = (g.double() + old[n].double() - new.double()).reshape(-1)
            dist.all_reduce(flow)
            out = outputs[n].to(torch.float64).reshape(-1)
            err = float((flow - world * out).abs().max() / (flow.abs().max() + 1e-12))
            checks["conservation_max_err"] = max(checks["conservation_max_err"], err)
        dense_err = float((outputs["norm"].float().reshape(-1) - mean["norm"]).abs().max())
        checks["dense_mean_max_err"] = max(checks["dense_mean_max_err"], dense_err)
        if step < warmup:
            for n in SHAPES:
                err = float((outputs[n].float().reshape(-1) - mean[n]).abs().max())
                checks["warmup_max_err"] = max(checks["warmup_max_err"], err)
    stats = state.totals()
    return {
        **checks,
        "nonfinite": nonfinite,
        "steps": state.step,
        "hook_calls": state.hook_calls,
        "world_size": state.world_size,
        "density": stats["density"],
        "bytes_sent": stats["bytes_sent"],
        "bytes_dense_fp32": stats["bytes_dense_fp32"],
        "dense_steps": stats["dense_steps"],
        "residual_norm": float(sum(r.float().norm() for r in state.residuals.values.values())),
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.unused = nn.Linear(64, 64)

    def forward(self, x):
        return self.body(x)


def run_ddp(mode, dtype=torch.bfloat16, steps=6):
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net().to(dtype)
    plan = {n: (CodecSpec(0.25, 4) if p.dim() == 2 else None) for n, p in net.named_parameters()}
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=2).bind(net)
    ddp = DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, grpo_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        loss = ddp(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [p.detach() for p in net.parameters()]
    return {
        "is_ddp": isinstance(ddp, DistributedDataParallel),
        "hook_calls": state.hook_calls,
        "steps": state.step,
        "identical": all(same_on_all_ranks(p) for p in params),
        "digest": tensor_digest(params),
        "dtype": str(params[0].dtype),
        "residuals": sorted(state.residuals.values),
    }


def run_all() -> dict:
    """Every scenario in both modes; needs an initialized gloo process group."""
    results = {"world_size": dist.get_world_size()}
    isend, sent = dist.isend, []

    def counted_isend(*args, **kwargs):  # gloo's all-gathers go as send/recv pairs (see hook.Collectives)
        sent.append(kwargs.get("group_dst"))
        return isend(*args, **kwargs)

    dist.isend = counted_isend
    for mode in ("allreduce", "allgather"):
        for density, bits in ((0.1, 4), (0.3, 8), (0.2, 16), (0.15, 32), (1.0, 4), (1.0, 2), (0.2, 2)):
            results[f"fake/{mode}/{density}/{bits}"] = run_fake(mode, density, bits)
        results[f"fake_bf16/{mode}"] = run_fake(mode, 0.15, 4, dtype=torch.bfloat16)
        results[f"nonfinite/{mode}"] = run_fake(mode, 0.15, 4, inject_step=3)
        results[f"ddp_bf16/{mode}"] = run_ddp(mode)
    dist.isend = isend
    results["send_peers"] = sorted(set(sent))
    return results


def main():
    dist.init_process_group("gloo")
    write_result(sys.argv[1], {"hook": run_all(), "world_size": dist.get_world_size()})
    end_worker()


if __name__ == "__main__":
    main()
