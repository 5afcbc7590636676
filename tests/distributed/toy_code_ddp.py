"""
A code added as a user adds one (`tests/toy_code.py`, one registration line below) trains through `GRPOConfig` alone
under 2-process gloo DDP (run by tests/test_toy_code.py):

- `hook`: `grpo_bits="sign"`: DDP wraps the model, GRPO's comm hook runs at every step and sends the toy code's
  messages (bytes by the all-gather's formula), and every rank holds the same parameters after every step.
- `sync`: `grpo_sync_every=2`, `grpo_sync_bits="sign"`: the sync every H steps sends `Δ` in the toy code, and after
  the last step (which syncs) every rank holds the same parameters.

Usage: torchrun --nproc_per_node 2 toy_code_ddp.py OUT_DIR [SCENARIO ...]
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from _common import random_tokens, same_on_all_ranks, worker_config, write_result
from testing_utils import end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel
from toy_code import SignCode
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.compression.codes import code_for, register


register(SignCode)  # the one line that adds the code

SEQ_LEN = 16


class Identical(TrainerCallback):
    """After every optimizer step: whether every rank holds the same parameters."""

    def __init__(self):
        self.after_step = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step.append(all(same_on_all_ranks(p.detach()) for p in model.parameters()))


def train(out_dir: str, name: str, **fields) -> dict:
    values = dict(max_steps=6, logging_steps=1, grpo_min_compress_numel=256, grpo_dense_warmup_steps=2)
    args = worker_config(os.path.join(out_dir, name), **{**values, **fields})
    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    initial = [p.detach().clone() for p in model.parameters()]
    identical = Identical()
    trainer = GRPOTrainer(model=model, args=args, train_dataset=random_tokens(64, SEQ_LEN), callbacks=[identical])
    trainer.train()
    state = trainer.grpo_comm_state
    specs = {spec for spec in trainer.grpo_plan.values() if spec is not None}
    totals = state.totals()
    return {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "transport": type(state).__name__,
        "codes": sorted(type(code_for(spec)).__name__ for spec in specs),
        "hook_calls": state.hook_calls,
        "bytes_sent": totals["bytes_sent"],
        "syncs": totals.get("syncs", 0),
        "identical_after_step": identical.after_step,
        "moved": [not torch.equal(a, b) for a, b in zip(initial, trainer.model.parameters())],
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }


SCENARIOS = {
    "hook": lambda out: train(out, "hook", grpo_compression="quantize", grpo_bits="sign"),
    "sync": lambda out: train(out, "sync", grpo_sync_every=2, grpo_sync_ramp=False, grpo_sync_bits="sign"),
}


def main():
    out_dir, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Accelerate takes it over
    results = {name: SCENARIOS[name](out_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    results["nan_free"] = not any(
        math.isnan(loss) for r in results.values() if isinstance(r, dict) for loss in r["losses"]
    )
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
