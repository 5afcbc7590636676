"""
Faults under 2-process gloo DDP (run by tests/test_reliability.py under torchrun): NaN and Inf gradients on one rank
for one step, and resuming a checkpoint written by another world size.

- `nonfinite/<setting>`: rank 1 corrupts one gradient at chosen optimizer steps (a NaN in a compressed tensor, an Inf
  in a compressed tensor, a NaN in a tensor sent dense, and a NaN during the dense warm-up). After every step each
  rank records digests of its parameters, optimizer state, importance state and compression state, so that the test
  can check that exactly the corrupted steps changed nothing, and that every other step did.
- `resume_w1`: resumes at world size 2 the checkpoint a single process wrote (path given on the command line) and
  records what each rank restored before its first step.

Usage: torchrun --nproc_per_node 2 faults_ddp.py OUT_DIR [W1_CHECKPOINT]
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
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer


SEQ_LEN = 16
COMPRESSED = "model.layers.0.mlp.gate_proj.weight"  # 2048 entries: compressed (grpo_min_compress_numel=256)
DENSE = "model.layers.1.input_layernorm.weight"  # 32 entries: always sent dense
# optimizer step (1-based) -> (parameter, value) that rank 1 writes into one entry of its local gradient
INJECTIONS = {1: (COMPRESSED, math.nan), 5: (COMPRESSED, math.nan), 8: (COMPRESSED, math.inf), 10: (DENSE, math.nan)}
SETTINGS = {
    "allgather": dict(grpo_compression="quantize", grpo_comm_mode="allgather"),
    "allreduce": dict(grpo_compression="quantize", grpo_comm_mode="allreduce", save_strategy="steps", save_steps=6),
    "none": dict(grpo_compression="none"),
}


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(output_dir, **overrides):
    fields = dict(
        max_steps=12,
        logging_steps=4,
        grpo_min_compress_numel=256,
        grpo_dense_warmup_steps=2,
        grpo_importance=True,  # the multipliers are applied, so replicas could drift
        grpo_lr_scale_warmup_steps=2,
    )
    return worker_config(output_dir, **{**fields, **overrides})


def state_digests(trainer) -> dict:
    """Digests of everything a step may change, on this rank."""
    comm = trainer.grpo_comm_state
    importance = trainer.grpo_callback.importance
    optimizer_state = [
        value for state in trainer.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    ]
    stores = {}
    if comm is not None:
        for key in ("residuals", "owner_residuals"):
            values = getattr(comm, key).values
            stores[key] = tensor_digest([values[n] for n in sorted(values)])
            stores[f"{key}_finite"] = all(bool(torch.isfinite(v).all()) for v in values.values())
    return {
        "params": tensor_digest([p for _, p in trainer.model.named_parameters()]),
        "optimizer": tensor_digest(optimizer_state),
        "importance": tensor_digest([importance.smoothed, importance.update_counts, importance.multipliers]),
        "importance_finite": bool(
            torch.isfinite(importance.smoothed).all() and torch.isfinite(importance.multipliers).all()
        ),
        **stores,
    }


class Recorder(TrainerCallback):
    """Digests before training and after every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.steps: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps = [state_digests(self.trainer)]
        self.begin = {"global_step": state.global_step}
        if self.trainer.grpo_comm_state is not None:
            comm = self.trainer.grpo_comm_state
            self.begin["residuals"] = {n: v.tolist() for n, v in comm.residuals.values.items()}
        self.begin["importance"] = self.trainer.grpo_callback.importance.smoothed.tolist()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state_digests(self.trainer))


def build(output_dir, **overrides):
    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    recorder = Recorder()
    trainer = GRPOTrainer(model=model, args=make_args(output_dir, **overrides), train_dataset=random_tokens())
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    return trainer, recorder


def inject(trainer, rank: int) -> None:
    """Rank 1 writes the planned NaN/Inf into one entry of one local gradient at the planned steps."""
    if rank != 1:
        return
    params = dict(trainer.model.named_parameters())
    for name in {name for name, _ in INJECTIONS.values()}:

        def corrupt(grad, name=name):
            planned = INJECTIONS.get(trainer.state.global_step + 1)
            if planned is None or planned[0] != name:
                return grad
            grad = grad.clone()
            grad.view(-1)[3] = planned[1]
            return grad

        params[name].register_hook(corrupt)


def finish(trainer) -> None:
    trainer.accelerator.free_memory()
    gc.collect()


def scenario_nonfinite(out_dir, setting):
    trainer, recorder = build(os.path.join(out_dir, f"nonfinite_{setting}"), **SETTINGS[setting])
    inject(trainer, dist.get_rank())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    comm = trainer.grpo_comm_state
    params = [p.detach() for p in trainer.model.parameters()]
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "global_step": trainer.state.global_step,
        "steps": recorder.steps,
        "identical": all(same_on_all_ranks(p) for p in params),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
        "losses": [entry["loss"] for entry in logs],
        "logged_nonfinite_steps": [entry.get("grpo/nonfinite_steps") for entry in logs],
        "nonfinite_steps": trainer.grpo_callback.nonfinite_steps,
        "comm_totals": comm.totals() if comm is not None else {},
        "hook_calls": comm.hook_calls if comm is not None else 0,
        "importance_steps": trainer.grpo_callback.importance.steps,
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
    }
    finish(trainer)
    return record


def scenario_resume_w1(out_dir, checkpoint):
    """Resume at world size 2 a checkpoint written by one process."""
    trainer, recorder = build(
        os.path.join(out_dir, "resume_w1"), grpo_compression="quantize", grpo_comm_mode="allgather", max_steps=10
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    params = [p.detach() for p in trainer.model.parameters()]
    comm = trainer.grpo_comm_state
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "begin": recorder.begin,
        "global_step": trainer.state.global_step,
        "identical": all(same_on_all_ranks(p) for p in params),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
        "residuals_finite": all(bool(torch.isfinite(v).all()) for v in comm.residuals.values.values()),
        "comm_world_size": comm.world_size,
        "comm_step": comm.step,
    }
    finish(trainer)
    return record


def main():
    out_dir = sys.argv[1]
    results = {"nonfinite": {setting: scenario_nonfinite(out_dir, setting) for setting in SETTINGS}}
    if len(sys.argv) > 2:
        results["resume_w1"] = scenario_resume_w1(out_dir, sys.argv[2])
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
