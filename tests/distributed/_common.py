"""Helpers shared by the scripts that `tests/test_distributed.py` runs under `torchrun` (not collected by pytest)."""

import hashlib
import json
import os

import torch
import torch.distributed as dist


class FakeBucket:
    """A `GradBucket` stand-in: one flat buffer holding the gradients of `params` in order."""

    def __init__(self, params, grads, index=0, last=True, dtype=torch.float32):
        self.params = list(params)
        self.buf = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
        self.idx = index
        self.last = last

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def gradients(self):
        out, offset = [], 0
        for p in self.params:
            out.append(self.buf[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def is_last(self):
        return self.last

    def index(self):
        return self.idx


def tensor_digest(tensors) -> str:
    """sha256 of the raw bytes of `tensors`, in order."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is bit-identical on every rank (compared as raw bytes)."""
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    gathered = [torch.empty_like(raw) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, raw)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def write_result(out_dir: str, results: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
