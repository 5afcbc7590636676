"""
`GRPOTrainer` with `grpo_optimizer_state` presets under 2-process gloo DDP, GRPO's default codec on (run by
tests/test_optim_distributed.py under torchrun).

Per preset (`blocks<bits>`: `factored8` with `testing_utils.block_state_groups(bits)` as the group file): a straight
run of 12 steps and a run resumed from its checkpoint at step 6; per rank, whether DDP wrapped
the model, the bytes the codec sent, whether every parameter and every optimizer state tensor is bit-identical on
every rank, and digests of the parameters and of the optimizer state (straight and resumed).

Usage: torchrun --nproc_per_node 2 optimizer_state_ddp.py OUT_DIR PRESET [PRESET ...]
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, tensor_digest, worker_config, write_result
from datasets import Dataset
from testing_utils import block_state_groups, end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel

from grpo_hf import GRPOTrainer


def tokens(n=256, length=16):
    ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def train(args, resume=None) -> dict:
    model = tiny_test_llama(seed=0, tie_word_embeddings=False, intermediate_size=128)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=tokens())
    trainer.train(resume_from_checkpoint=resume)
    optimizer = trainer.optimizer.optimizer
    params = [p.detach() for p in trainer.model.parameters()]
    states = [
        value for p in trainer.model.parameters() for value in optimizer.state[p].values() if torch.is_tensor(value)
    ]
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "optimizer": type(optimizer).__name__,
        "layouts": sorted({layout for group in optimizer.param_groups for layout in group.get("state_layouts", [])}),
        "bytes_sent": trainer.grpo_comm_state.totals()["bytes_sent"],
        "global_step": trainer.state.global_step,
        "identical": all(same_on_all_ranks(t) for t in params + states),
        "digest": tensor_digest(params),
        "state_digest": tensor_digest(states),
    }
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    return record


def main():
    out_dir, presets = sys.argv[1], sys.argv[2:]
    results = {}
    for preset in presets:
        groups = {}
        if preset.startswith("blocks"):
            path = os.path.join(out_dir, f"{preset}.json")  # every rank writes the same file, atomically
            with open(f"{path}.{os.environ['RANK']}", "w") as handle:
                json.dump(block_state_groups(int(preset.removeprefix("blocks"))), handle)
            os.replace(f"{path}.{os.environ['RANK']}", path)
            groups = {"grpo_groups": path}
        args = worker_config(
            os.path.join(out_dir, preset), grpo_optimizer_state="factored8" if groups else preset,
            grpo_min_state_numel=1024, max_steps=12, save_strategy="steps", save_steps=6, grpo_min_compress_numel=256,
            **groups,
        )  # fmt: skip
        straight = train(args)
        resumed = train(args, resume=os.path.join(args.output_dir, "checkpoint-6"))
        results[preset] = {"straight": straight, "resumed": resumed}
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
