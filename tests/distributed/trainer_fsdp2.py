"""
`GRPOTrainer` on FSDP2 under 2-process gloo, through the Trainer (run by tests/test_engines.py under torchrun).

On a machine without a GPU, Accelerate turns its FSDP plugin off (`use_cpu=True` gives MULTI_CPU and DDP), so the
Trainer's `fsdp` / `fsdp_config` path cannot run here. transformers' own FSDP2 path can: a model loaded with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` is sharded with `fully_shard` at load time
and the Trainer trains it as it is (no DDP wrapper). GRPOTrainer then meets what it meets behind Accelerate's plugin:
an `FSDPModule` with `DTensor` parameters at its first training step, gradients reduce-scattered by FSDP2.

Usage: torchrun --nproc_per_node 2 trainer_fsdp2.py OUT_DIR [SCENARIO ...]   (default: all)
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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from grpo_hf import GRPOTrainer
from grpo_hf.compression.fsdp import FSDPCommState, fsdp_units


SEQ_LEN = 16


def load_sharded(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(fsdp_size=2))


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(out_dir, name, **overrides):
    fields = dict(
        max_steps=8,
        logging_steps=4,
        grpo_importance=True,
        grpo_lr_scale_warmup_steps=2,
        grpo_lr_scale_min=0.5,
        grpo_lr_scale_max=2.0,
        grpo_lr_ratios={"norms": 0.5},
        grpo_log_groups=True,  # the test reads grpo/lr/<group>
    )
    return worker_config(os.path.join(out_dir, name), **{**fields, **overrides})


def train(model_dir, args, resume=None):
    model = load_sharded(model_dir)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=random_tokens())
    trainer.train(resume_from_checkpoint=resume)
    named = dict(trainer.model.named_parameters())
    full = [p.full_tensor().detach().clone() for p in trainer.model.parameters()]
    state = trainer.grpo_comm_state
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    record = {
        "engine": trainer.grpo_engine,
        "is_fsdp": isinstance(trainer.model_wrapped, FSDPModule),
        "all_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "groups_follow_model": all(
            p is named[n] for g in trainer.grpo_groups for n, p in zip(g.param_names, g.params)
        ),
        "optimizer_groups": sorted(g["grpo_group"] for g in trainer.optimizer.param_groups),
        "optimizer_holds_model_params": all(
            p is named[n] for g in trainer.optimizer.param_groups for n, p in zip(g["param_names"], g["params"])
        ),
        "global_step": trainer.state.global_step,
        "compression": trainer.grpo_compression,
        "fsdp_comm": isinstance(state, FSDPCommState),
        "hook_calls": state.hook_calls if state is not None else 0,
        "units": len(fsdp_units(trainer.model)),
        "comm_steps": state.step if state is not None else 0,
        "totals": state.totals() if state is not None else {},
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "params_identical": same_on_all_ranks(torch.cat([p.reshape(-1) for p in full])),
        "digest": tensor_digest(full),
        "residual_digest": tensor_digest([state.residuals[k] for k in sorted(state.residuals)]) if state else "",
        "logs": [{k: v for k, v in e.items() if k.startswith(("grpo/lr/", "grpo/comm/", "cost/comm"))} for e in logs],
        "losses": [entry["loss"] for entry in logs],
    }
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return record


def scenario_groups(out_dir, model_dir):
    """Uncompressed FSDP2: groups, LR ratios and importance multipliers through the Trainer."""
    return train(model_dir, make_args(out_dir, "groups", grpo_compression="none"))


def scenario_compressed(out_dir, model_dir):
    """
    The default compression under FSDP2 ('auto': 8-bit reduce-scatter), with worker error feedback and gradient
    accumulation (FSDP2 reduce-scatters once per optimizer step).
    """
    args = make_args(out_dir, "compressed", grpo_fsdp_error_feedback="worker-bf16", gradient_accumulation_steps=2)
    return train(model_dir, args)


def scenario_checkpoint(out_dir, model_dir):
    """
    Checkpoints carry each rank's GRPO state. transformers cannot resume a model sharded at load time (it refuses
    optimizer checkpoints for it), so the Trainer saves the model only and GRPO's state files are restored into a
    fresh trainer; tests/distributed/fsdp2_pieces.py resumes the whole run (DCP) bit for bit.
    """
    from grpo_hf.checkpoints import read_grpo_state

    args = make_args(
        out_dir, "checkpoint", save_strategy="steps", save_steps=4, save_only_model=True,
        grpo_fsdp_error_feedback="worker-bf16",
    )  # fmt: skip
    record = train(model_dir, args)
    rank = dist.get_rank()
    checkpoint = os.path.join(args.output_dir, "checkpoint-8")
    saved = read_grpo_state(os.path.join(checkpoint, f"grpo_state_rank{rank}.pt"))
    trainer = GRPOTrainer(model=load_sharded(model_dir), args=args, train_dataset=random_tokens())
    restored = trainer.grpo_callback.load_checkpoint(checkpoint, rank, dist.get_world_size())
    state = trainer.grpo_comm_state
    result = {
        "trained": record,
        "saved_mode": saved["comm"]["mode"],
        "saved_world_size": saved["world_size"],
        "saved_rank": saved["rank"],
        "restored": restored,
        "restored_step": state.step,
        "restored_residual_digest": tensor_digest([state.residuals[k] for k in sorted(state.residuals)]),
        "restored_multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
    }
    del trainer
    gc.collect()
    return result


SCENARIOS = {"groups": scenario_groups, "compressed": scenario_compressed, "checkpoint": scenario_checkpoint}


def main():
    torch.set_num_threads(1)
    logging.getLogger("grpo_hf").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    out_dir, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    model_dir = os.path.join(out_dir, "tiny_llama")
    if dist.get_rank() == 0:
        tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN).save_pretrained(model_dir)
    dist.barrier()
    results = {name: SCENARIOS[name](out_dir, model_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
