"""
`GRPOTrainer` under 2-process gloo DDP (run by tests/test_distributed.py under torchrun).

Every scenario trains a tiny Llama built from its config on random tokens and records, per rank, whether the model
was wrapped in `DistributedDataParallel`, how often the hook ran, the optimizer steps, a digest of the parameters and
the compression metrics. Final parameters of the lossless comparison are saved for `assert_close` on the pytest side.

Usage: torchrun --nproc_per_node 2 trainer_ddp.py OUT_DIR [SCENARIO ...]   (default: all scenarios, then the hook
scenarios of hook_collectives.py in the same process group)
"""

import gc
import math
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, tensor_digest, worker_config, write_result
from datasets import Dataset
from testing_utils import end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel

from grpo_hf import GRPOTrainer


SEQ_LEN = 16


def tiny_llama():
    return tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(out_dir, name, **overrides):
    fields = dict(
        max_steps=10,
        logging_steps=5,
        grpo_min_compress_numel=256,
        grpo_dense_warmup_steps=2,
        grpo_importance=True,  # the multipliers are applied, so replicas could drift
        grpo_lr_scale_warmup_steps=2,  # importance multipliers are active in every scenario
    )
    return worker_config(os.path.join(out_dir, name), **{**fields, **overrides})


def train(args, model=None, resume=None):
    """Train, then return (record, trainer state parameters); frees the trainer so that gloo exits cleanly (free_memory, del, gc, destroy_process_group)."""
    model = model if model is not None else tiny_llama()
    initial = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(model=model, args=args, train_dataset=random_tokens())
    output = trainer.train(resume_from_checkpoint=resume)
    state = trainer.grpo_comm_state
    params = [p.detach().clone() for p in trainer.model.parameters()]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "compression": trainer.grpo_compression,
        "global_step": trainer.state.global_step,
        "hook_calls": state.hook_calls if state is not None else 0,
        "hook_steps": state.step if state is not None else 0,
        "identical": all(same_on_all_ranks(p) for p in params),
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "digest": tensor_digest(params),
        "changed": [not torch.equal(a, b) for a, b in zip(initial, params) if a.shape == b.shape],
        "losses": [entry["loss"] for entry in logs],
        "comm_logs": [
            {k: v for k, v in entry.items() if k.startswith("grpo/comm") or k in GRPO_KEYS} for entry in logs
        ],
        "totals": state.totals() if state is not None else {},
        "measured": {k: v for k, v in output.metrics.items() if k.startswith("grpo/")},
        "residual_names": sorted(state.residuals.values) if state is not None else [],
        "residual_digest": tensor_digest([state.residuals.values[n] for n in sorted(state.residuals.values)])
        if state
        else "",
    }
    named = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    return record, named


GRPO_KEYS = ("grpo/density", "grpo/sparsity")


def scenario_lossless(out_dir):
    """Plain DDP vs the hook with density 1 and 32 bits: same parameters."""
    plain, plain_params = train(make_args(out_dir, "plain", grpo_compression="none"))
    lossless, lossless_params = train(make_args(out_dir, "lossless", grpo_compression="sparse", grpo_density=1.0))
    if dist.get_rank() == 0:
        torch.save({"plain": plain_params, "lossless": lossless_params}, os.path.join(out_dir, "lossless_params.pt"))
    return {"plain": plain, "lossless": lossless}


def scenario_lossy(out_dir):
    """Both modes, defaults (quantize, 2-bit ternary), 20+ steps; accumulation and bf16 autocast."""
    allgather, _ = train(
        make_args(
            out_dir, "allgather", max_steps=20, grpo_comm_mode="allgather", bf16=True, ddp_find_unused_parameters=False
        )
    )
    allreduce, _ = train(
        make_args(out_dir, "allreduce", max_steps=20, grpo_comm_mode="allreduce", gradient_accumulation_steps=2)
    )
    return {"allgather": allgather, "allreduce": allreduce}


def scenario_resume(out_dir):
    """2N steps straight vs N steps + resume for N, lossy compression: bit-identical parameters and residuals."""
    results = {}
    for mode in ("allreduce", "allgather"):
        name = f"resume_{mode}"
        args = make_args(out_dir, name, max_steps=12, save_strategy="steps", save_steps=6, grpo_comm_mode=mode)
        straight, _ = train(args)
        checkpoint = os.path.join(args.output_dir, "checkpoint-6")
        resumed, _ = train(args, resume=checkpoint)
        results[mode] = {
            "straight": straight,
            "resumed": resumed,
            "checkpoint_state": os.path.isfile(os.path.join(checkpoint, f"grpo_state_rank{dist.get_rank()}.pt")),
        }
    return results


def scenario_lora(out_dir):
    """A PEFT LoRA model: only the adapters are in the buckets; residuals are keyed by their names."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    record, _ = train(
        make_args(out_dir, "lora", grpo_compression="sparse+quantize", grpo_min_compress_numel=64), model=model
    )
    return record


SCENARIOS = {
    "lossless": scenario_lossless,
    "lossy": scenario_lossy,
    "resume": scenario_resume,
    "lora": scenario_lora,
}


def main():
    out_dir, names = sys.argv[1], sys.argv[2:] or [*SCENARIOS, "hook"]
    results = {}
    for name in names:
        if name == "hook":  # the fake-bucket checks of hook_collectives.py, in this same process group
            import hook_collectives

            results["hook"] = hook_collectives.run_all()
        else:
            results[name] = SCENARIOS[name](out_dir)
    results["world_size"] = dist.get_world_size()
    results["nan_free"] = not any(math.isnan(loss) for r in _records(results) for loss in r.get("losses", []))
    write_result(out_dir, results)
    end_worker()


def _records(tree):
    if isinstance(tree, dict):
        if "digest" in tree:
            yield tree
        for value in tree.values():
            yield from _records(value)


if __name__ == "__main__":
    main()
