"""
`GRPOTrainer(model_init=...)` under 2-process gloo DDP with compression (run by tests/test_distributed.py under
torchrun): a plain `train()`, then a two-trial optuna `hyperparameter_search`. Each time the Trainer builds a fresh
model, GRPO must bind its groups, optimizer and compression hook to that model; each rank records, per training, that
the model was wrapped in DDP, that the hook ran on every optimizer step, that every parameter of the built model moved
and that the ranks hold bit-identical parameters.

Usage: torchrun --nproc_per_node 2 model_init_ddp.py OUT_DIR
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, write_result
from datasets import Dataset
from testing_utils import end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from grpo_hf import GRPOConfig, GRPOTrainer


SEQ_LEN = 16


def random_tokens(n=128, seed=1):
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=torch.Generator().manual_seed(seed)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


class Builder:
    """`model_init`: a fresh tiny Llama per call, remembered with its initial parameters."""

    def __init__(self):
        self.built = []

    def __call__(self, trial=None):
        model = tiny_test_llama(seed=len(self.built), max_position_embeddings=SEQ_LEN)
        self.built.append((model, {n: p.detach().clone() for n, p in model.named_parameters()}))
        return model


class RecordTraining(TrainerCallback):
    """At the end of each training: what DDP, the hook and the optimizer did to the model `model_init` built."""

    def __init__(self, trainer, builder):
        self.trainer, self.builder, self.records = trainer, builder, []

    def on_train_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        model, initial = self.builder.built[-1]
        optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        self.records.append(
            {
                "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
                "trains_built_model": trainer.model is model,
                "optimizer_holds_built_model": optimized == {id(p) for p in model.parameters()},
                "global_step": state.global_step,
                "hook_steps": trainer.grpo_comm_state.step,
                "hook_calls": trainer.grpo_comm_state.hook_calls,
                "all_moved": all(not torch.equal(p, initial[n]) for n, p in model.named_parameters()),
                "identical": all(same_on_all_ranks(p) for p in model.parameters()),
                "learning_rate": args.learning_rate,
            }
        )


def main():
    out_dir = sys.argv[1]
    builder = Builder()
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "run"),
        use_cpu=True,  # required: without it both ranks train alone, without DDP
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        grpo_compression="quantize",
        grpo_min_compress_numel=256,
    )
    trainer = GRPOTrainer(
        model_init=builder, args=args, train_dataset=random_tokens(), eval_dataset=random_tokens(32, seed=2)
    )
    recorder = RecordTraining(trainer, builder)
    trainer.add_callback(recorder)
    trainer.train()
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-3, log=True)},
        backend="optuna",
        n_trials=2,
        direction="minimize",
    )
    write_result(
        out_dir,
        {
            "world_size": dist.get_world_size(),
            "models_built": len(builder.built),
            "trainings": recorder.records,
            "best_objective": best.objective if dist.get_rank() == 0 else None,
        },
    )
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    end_worker()


if __name__ == "__main__":
    main()
