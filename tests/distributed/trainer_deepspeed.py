"""
`GRPOTrainer` on DeepSpeed ZeRO 1/2/3 under 2-process gloo on CPU (run by tests/test_engines.py under torchrun).

DeepSpeed picks its CPU accelerator on a machine without a GPU and Accelerate initializes it on gloo, so the Trainer's
`deepspeed=` path runs here. Each scenario records, per rank, the learning rate each param group had when ZeRO
stepped it (a step hook registered after GRPO's), the importance multipliers, the GRPO log line about compression and
a digest of the parameters.

Usage: torchrun --nproc_per_node 2 trainer_deepspeed.py OUT_DIR [SCENARIO ...]   (default: all)
"""

import gc
import logging
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, tensor_digest, worker_config, write_result
from datasets import Dataset
from testing_utils import end_worker, tiny_test_llama

from grpo_hf import ConfigError, GRPOTrainer


SEQ_LEN = 16
RATIOS = {"norms": 0.5, "embeddings": 2.0}


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def ds_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }


def make_args(out_dir, name, stage, **overrides):
    fields = dict(
        use_cpu=False,  # DeepSpeed picks the device itself
        deepspeed=ds_config(stage),
        max_steps=8,
        logging_steps=4,
        grpo_importance=True,
        grpo_lr_scale_warmup_steps=2,
        grpo_lr_scale_min=0.5,
        grpo_lr_scale_max=2.0,
        grpo_lr_ratios=RATIOS,
    )
    return worker_config(os.path.join(out_dir, name), **{**fields, **overrides})


class Counter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class WatchedTrainer(GRPOTrainer):
    """Records each param group's learning rate when ZeRO steps it (a hook after GRPO's own)."""

    def create_optimizer(self, model=None):
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if created:
            self.seen_lrs = []
            optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: self.seen_lrs.append(
                    {g["grpo_group"]: g["lr"] for g in opt.param_groups if g["params"]}
                )
            )
        return optimizer


def train(out_dir, name, stage, **overrides):
    counter = Counter()
    logging.getLogger("grpo_hf").addHandler(counter)
    trainer = WatchedTrainer(
        model=tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN),
        args=make_args(out_dir, name, stage, **overrides),
        train_dataset=random_tokens(),
    )
    trainer.train()
    logging.getLogger("grpo_hf").removeHandler(counter)
    engine = trainer.model_wrapped
    record = {
        "engine": trainer.grpo_engine,
        "wrapper": type(engine).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "compression": trainer.grpo_compression,
        "comm_state": trainer.grpo_comm_state is not None,
        "optimizer_groups": sorted({g.get("grpo_group") for g in trainer.optimizer.param_groups}),
        "global_step": trainer.state.global_step,
        "seen_lrs": trainer.seen_lrs,
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "importance_steps": trainer.grpo_callback.importance.steps,
        "compression_off_lines": sum("gradient compression is off" in m for m in counter.messages),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    if stage < 3:  # ZeRO 1/2 keep full parameters on every rank
        params = [p.detach().clone() for p in trainer.model.parameters()]
        record["params_identical"] = same_on_all_ranks(torch.cat([p.reshape(-1) for p in params]))
        record["digest"] = tensor_digest(params)
    trainer.accelerator.free_memory()
    del trainer, engine
    gc.collect()
    return record


def scenario_zero(out_dir):
    return {f"zero{stage}": train(out_dir, f"zero{stage}", stage) for stage in (1, 2, 3)}


def scenario_refused(out_dir):
    """An explicit compression setting under DeepSpeed: one ConfigError at construction."""
    try:
        GRPOTrainer(
            model=tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN),
            args=make_args(out_dir, "refused", 2, grpo_compression="quantize"),
            train_dataset=random_tokens(),
        )
    except ConfigError as err:
        return {"error": str(err)}
    return {"error": None}


SCENARIOS = {"zero": scenario_zero, "refused": scenario_refused}


def main():
    torch.set_num_threads(1)
    out_dir, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    results = {name: SCENARIOS[name](out_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
