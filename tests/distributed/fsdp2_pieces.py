"""
GRPO's pieces on raw FSDP2 (`fully_shard`) under 2-process gloo, wired as Accelerate's FSDP2 path wires them (run by
tests/test_engines.py under torchrun).

Accelerate's `prepare` builds the optimizer on the original parameters, shards the model with `fully_shard` (new
`DTensor` parameters, same names) and swaps the optimizer's parameters by name; GRPOTrainer then points its groups at
the sharded parameters and installs the compressed reduce-scatter. Each scenario does the same by hand, trains a tiny
Llama on per-rank random tokens, and records per rank what tests/test_engines.py asserts.

Usage: torchrun --nproc_per_node 2 fsdp2_pieces.py OUT_DIR [SCENARIO ...]   (default: all)
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, tensor_digest, write_result
from testing_utils import end_worker, shard_like_accelerate, tiny_test_llama
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from grpo_hf.callbacks import GRPOCallback
from grpo_hf.checkpoints import write_grpo_state
from grpo_hf.compression.codes import code_for
from grpo_hf.compression.fsdp import FSDPCommState, install_compressed_reduce_scatter
from grpo_hf.compression.spec import CodecSpec
from grpo_hf.grouping import assign_groups, load_group_spec, lr_ratios
from grpo_hf.importance import ImportanceState


SEQ_LEN, BATCH, VOCAB = 16, 4, 128
RATIOS = {"norms": 0.5, "embeddings": 2.0}


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)


class Run:
    """A sharded tiny Llama with GRPO's optimizer groups, importance callback and (optionally) compression."""

    def __init__(self, bits=None, error_feedback="none", importance=True, dense_warmup_steps=0):
        model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
        self.original_ids = {n: id(p) for n, p in model.named_parameters()}
        groups = assign_groups(model, load_group_spec("semantic"))
        ratios = lr_ratios(groups, RATIOS)
        # as GRPOTrainer.create_optimizer: one param group per GRPO group, on the parameters before sharding
        optimizer = torch.optim.AdamW(
            [{"params": g.params, "param_names": g.param_names, "grpo_group": g.name} for g in groups], lr=3e-3
        )
        shard_like_accelerate(model)
        # as Accelerate's fsdp2_switch_optimizer_parameters: the new parameters, by name
        named = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [named[name] for name in group["param_names"]]
        importance_state = ImportanceState(
            names=[g.name for g in groups],
            numels=[g.numel for g in groups],
            lower=[0.5] * len(groups),
            upper=[2.0] * len(groups),
            scaled=[True] * len(groups),
            warmup_steps=1,
        )
        self.callback = GRPOCallback(groups, importance_state, apply_multipliers=importance, lr_ratios=ratios)
        self.callback.follow(model)  # what GRPOTrainer does at its first training step
        self.state = None
        if bits is not None:
            self.state = FSDPCommState(bits=bits, error_feedback=error_feedback, dense_warmup_steps=dense_warmup_steps)
            self.units = install_compressed_reduce_scatter(model, self.state)
            self.callback.comm_state = self.state
        self.model, self.optimizer, self.groups = model, optimizer, groups
        self.losses, self.lrs, self.norms_check, self.coherence_check = [], [], [], []

    def backward(self, step: int, poison: bool = False) -> None:
        ids = batch(step, dist.get_rank())
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        (loss * float("nan") if poison else loss).backward()

    def step(self, step: int, poison: bool = False) -> None:
        self.backward(step, poison)
        self.norms_check.append(self.check_norms())
        self.coherence_check.append(self.check_coherence())  # collectives: every rank, poisoned or not
        self.callback.on_pre_optimizer_step(None, None, None, optimizer=self.optimizer)
        self.lrs.append({g["grpo_group"]: g["lr"] for g in self.optimizer.param_groups})
        self.optimizer.step()
        self.callback.on_optimizer_step(None, None, None, optimizer=self.optimizer)
        self.optimizer.zero_grad()

    def check_norms(self) -> float:
        """Largest relative gap between the callback's group norms and norms of the gathered full gradients."""
        norms = self.callback.group_grad_norms()
        reference = []
        for group in self.groups:
            full = [p.grad.full_tensor().double() for p in group.params if p.grad is not None]
            reference.append(float(torch.sqrt(sum((g * g).sum() for g in full))) if full else 0.0)
        reference = torch.tensor(reference, dtype=torch.float64)
        if not torch.isfinite(norms).all():
            return float("nan")
        return float(((norms - reference).abs() / reference.clamp(min=1e-30)).max())

    def check_coherence(self) -> float:
        """Largest gap between the callback's gradient-momentum cosines and those of the gathered full tensors."""
        cosines = self.callback.group_coherence(self.optimizer)
        reference = []
        for group in self.groups:
            pairs = [
                (p.grad.full_tensor().double(), self.optimizer.state[p]["exp_avg"].full_tensor().double())
                for p in group.params
                if p.grad is not None and "exp_avg" in self.optimizer.state.get(p, {})
            ]
            if not pairs:
                reference.append(1.0)
                continue
            dot = sum((g * m).sum() for g, m in pairs)
            gg, mm = sum((g * g).sum() for g, _ in pairs), sum((m * m).sum() for _, m in pairs)
            reference.append(float(dot / (gg.sqrt() * mm.sqrt())))
        return float((cosines - torch.tensor(reference, dtype=torch.float64)).abs().max())

    def full_params(self) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in self.model.parameters()]

    def eval_loss(self) -> float:
        with torch.no_grad():
            ids = batch(10_000, 0)  # the same held-out batch on every rank
            return float(self.model(input_ids=ids, labels=ids).loss)

    def record(self) -> dict:
        params = self.full_params()
        named = dict(self.model.named_parameters())
        record = {
            "is_fsdp": isinstance(self.model, FSDPModule),
            "all_dtensor": all(isinstance(p, DTensor) for p in self.model.parameters()),
            "params_replaced": all(id(p) != self.original_ids[n] for n, p in named.items()),
            "groups_follow_model": all(p is named[n] for g in self.groups for n, p in zip(g.param_names, g.params)),
            "optimizer_holds_model_params": all(
                p is named[n] for g in self.optimizer.param_groups for n, p in zip(g["param_names"], g["params"])
            ),
            "losses": self.losses,
            "lrs": self.lrs,
            "norm_gap": self.norms_check,
            "coherence_gap": self.coherence_check,
            "multipliers": self.callback.importance.multipliers.tolist(),
            "multipliers_identical": same_on_all_ranks(self.callback.importance.multipliers),
            "params_identical": same_on_all_ranks(torch.cat([p.reshape(-1) for p in params])),
            "digest": tensor_digest(params),
            "eval_loss": self.eval_loss(),
            "nonfinite_steps": self.callback.nonfinite_steps,
        }
        if self.state is not None:
            totals = self.state.totals()
            record.update(
                units=self.units,
                hook_calls=self.state.hook_calls,
                comm_steps=self.state.step,
                bytes_sent=totals["bytes_sent"],
                bytes_dense_fp32=totals["bytes_dense_fp32"],
                residual_nbytes=self.state.residual_nbytes(),
                residual_digest=tensor_digest([self.state.residuals[k] for k in sorted(self.state.residuals)]),
            )
        return record

    def free(self) -> None:
        del self.model, self.optimizer
        gc.collect()


def train(steps: int, **kwargs) -> tuple[Run, dict]:
    run = Run(**kwargs)
    for step in range(steps):
        run.step(step)
    return run, run.record()


def scenario_lossless(out_dir):
    """The built-in reduce-scatter vs the compressed one at 32 bits: gradients and parameters match (assert_close)."""
    results, saved = {}, {}
    for name, bits in (("builtin", None), ("fp32", 32)):
        run = Run(bits=bits, importance=False)
        run.backward(0)
        saved[name] = {"grads": {n: p.grad.to_local().clone() for n, p in run.model.named_parameters()}}
        run.optimizer.zero_grad()
        for step in range(6):
            run.step(step)
        saved[name]["params"] = {n: p.to_local().detach().clone() for n, p in run.model.named_parameters()}
        results[name] = run.record()
        run.free()
    torch.save(saved, os.path.join(out_dir, f"lossless_rank{dist.get_rank()}.pt"))
    return results


def scenario_groups(out_dir):
    """Uncompressed FSDP2 with importance scaling on: per-group learning rates, norms and multipliers."""
    run, record = train(8, bits=None, importance=True)
    run.free()
    return record


def scenario_compressed(out_dir):
    """8 and 4 bits, with and without error feedback: ranks agree, bytes as the formula, residual memory."""
    results = {}
    world_size = dist.get_world_size()
    for bits, feedback in ((8, "none"), (8, "worker-bf16"), (4, "worker-bf16"), (4, "worker-int8")):
        steps = 8
        run, record = train(steps, bits=bits, error_feedback=feedback, importance=True)
        # residual keys are "<unit>:<flat size>": the bytes of every step follow from the flat sizes
        sizes = [int(key.rsplit(":", 1)[1]) for key in run.state.residuals]
        record["flat_sizes"] = sizes
        record["bytes_expected"] = steps * sum(
            (world_size - 1) * code_for(CodecSpec(bits=bits)).row_nbytes(n // world_size) for n in sizes
        )
        record["residual_entries"] = sum((world_size - 1) * (n // world_size) for n in sizes)
        results[f"q{bits}-{feedback}"] = record
        run.free()
    return results


def scenario_nonfinite(out_dir):
    """A NaN loss on rank 1 at step 3: both ranks skip that step, parameters and residuals stay as they were."""
    run = Run(bits=8, error_feedback="worker-bf16", importance=True)
    for step in range(3):
        run.step(step)
    before = run.full_params()
    residuals = tensor_digest([run.state.residuals[k] for k in sorted(run.state.residuals)])
    run.step(3, poison=dist.get_rank() == 1)
    after = run.full_params()
    record = {
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        "residuals_unchanged": residuals
        == tensor_digest([run.state.residuals[k] for k in sorted(run.state.residuals)]),
        "nonfinite_steps": run.callback.nonfinite_steps,
        "comm_nonfinite": run.state.totals()["nonfinite_steps"],
    }
    run.step(4)
    record["params_identical"] = same_on_all_ranks(torch.cat([p.reshape(-1) for p in run.full_params()]))
    record["moved_after"] = not all(torch.equal(a, b) for a, b in zip(after, run.full_params()))
    run.free()
    return record


def scenario_resume(out_dir):
    """6 steps straight vs 3 steps, checkpoint (DCP + GRPO state files), fresh objects, 3 steps: bit-identical."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kwargs = dict(bits=8, error_feedback="worker-bf16", importance=True)
    straight, straight_record = train(6, **kwargs)
    straight.free()
    first = Run(**kwargs)
    for step in range(3):
        first.step(step)
    folder = os.path.join(out_dir, "checkpoint-3")
    model_sd, optim_sd = get_state_dict(first.model, first.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    write_grpo_state(folder, rank, first.callback.state_dict(world_size, rank))
    first.free()
    dist.barrier()
    second = Run(**kwargs)
    model_sd, optim_sd = get_state_dict(second.model, second.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(second.model, second.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restored = second.callback.load_checkpoint(folder, rank, world_size)
    for step in range(3, 6):
        second.step(step)
    record = second.record()
    second.free()
    return {
        "restored": restored,
        "straight": straight_record,
        "resumed": record,
        "state_file": os.path.isfile(os.path.join(folder, f"grpo_state_rank{rank}.pt")),
    }


SCENARIOS = {
    "lossless": scenario_lossless,
    "groups": scenario_groups,
    "compressed": scenario_compressed,
    "nonfinite": scenario_nonfinite,
    "resume": scenario_resume,
}


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out_dir, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    results = {name: SCENARIOS[name](out_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
