"""Helpers shared by the scripts that `tests/test_distributed.py` runs under `torchrun` (not collected by pytest).

The fake DDP bucket and the launcher live in `tests/testing_utils.py`, for the benchmarks too.
"""

import hashlib
import json
import os

import torch
import torch.distributed as dist


def worker_config(output_dir: str, **fields):
    """
    The `GRPOConfig` the worker scripts start from: DDP on the CPU (gloo; `use_cpu=True` is required, without it each
    rank trains alone), 4 rows per rank, learning rate 3e-3 held constant, no checkpoints, seed 0, no reports; `fields`
    win.
    """
    from grpo_hf import GRPOConfig

    values = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return GRPOConfig(**{**values, **fields})


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


def random_tokens(n: int, seq_len: int, vocab: int = 128, seed: int = 1):
    """`n` rows of `seq_len` random token ids below `vocab` (the same on every rank), labels equal to the inputs."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def write_result(out_dir: str, results: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
