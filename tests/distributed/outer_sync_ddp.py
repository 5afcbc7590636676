"""
`GRPOTrainer` with `grpo_sync_every > 1` under 2-process gloo DDP (run by tests/test_distributed_outer_sync.py).

Scenarios, each recording per rank what the pytest side asserts:

- `sync`: H=4, 2 fragments, ramp, 4-bit Δ, importance multipliers applied: DDP wrapped the model, the local-gradient
  hook ran, the replicas differ between syncs (the inner steps exchange nothing) and are bit-identical after every
  sync of both fragments and at the end; bytes per step against the formulas.
- `resume`: 12 steps straight (checkpoints at 6, mid-interval) against the run resumed from checkpoint-6.
- `localsgd`: one sync at outer lr 1, momentum 0, fp32 Δ against accelerate's `LocalSGD` on the same local models.
- `control`: `grpo_sync_outer_only`: DDP's all-reduce every step (replicas identical at every step) plus the outer step.
- `accum`: gradient accumulation, clipping, a cosine schedule and LR ratios, with a sync every 3 steps.
- `delay`: `sync` with `grpo_sync_delay=1` and `grpo_sync_mix=0.5`: each fragment's exchange runs behind one step;
  `θ_global` bit-identical on every rank after every step, bytes per step by the formulas (counted at the start).
- `delay_resume`: `resume` with `grpo_sync_delay=1` and no ramp: checkpoint-6 holds fragment 0's exchange in flight.
- `moments` (launched on its own): `sync` with `grpo_sync_moments="both"`: after every sync of a fragment every rank
  holds the same `exp_avg` and `exp_avg_sq` of its parameters; bytes per step with one fp32 all-reduce per moment.
- `moments_resume` (launched on its own): `resume` with `grpo_sync_moments="both"`.
- `resume_ternary`, `resume_2` (launched on their own): `resume` with `grpo_sync_bits="ternary"` / `"2"`, the sync's
  own codes (trits, four 2-bit levels); the straight run also records the replicas after every sync and the bytes.
- `sparse` (launched on its own, on 2 and 4 processes): `sync` with the sparse code (SparseLoCo: 16 of every 256
  entries, 2-bit values, residual decay 0.95), all-gathered whatever the world size.
- `sparse_resume` (launched on its own): `resume` with the sparse code.

Usage: torchrun --nproc_per_node 2 outer_sync_ddp.py OUT_DIR [SCENARIO ...]
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
from grpo_hf.compression.codes import code_for
from grpo_hf.compression.layout import chunk_bounds, chunk_owner
from grpo_hf.compression.outer_sync import (
    OWNER_MIN_WORLD_SIZE,
    SYNC_MOMENTS,
    OuterSyncState,
    fragments_due,
    ramp_points,
)
from grpo_hf.compression.traffic import allgather_bytes, allreduce_bytes, alltoall_bytes
from grpo_hf.optim.moments import moment_tensors


SEQ_LEN = 16


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(out_dir, name, **overrides):
    fields = dict(
        max_steps=14,
        logging_steps=5,
        grpo_min_compress_numel=256,
        grpo_importance=True,  # the multipliers are applied: the ranks must agree on them between syncs
        grpo_lr_scale_warmup_steps=2,
        grpo_sync_every=4,
        grpo_sync_fragments=2,  # the codes of Δ are GRPOConfig's defaults (grpo_sync_bits)
    )
    return worker_config(os.path.join(out_dir, name), **{**fields, **overrides})


class Replicas(TrainerCallback):
    """After every optimizer step (the sync included): whether the ranks hold identical parameters, and the bytes."""

    def __init__(self):
        self.identical, self.fragments, self.bytes, self.global_identical, self.in_flight = [], [], [], [], []
        self.moments = []  # with grpo_sync_moments: per fragment, whether its optimizer moments agree across ranks
        self.state = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = self.state.totals()["bytes_sent"] if self.state is not None else 0.0

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        params = [p.detach() for p in model.parameters()]
        self.identical.append(all(same_on_all_ranks(p) for p in params))
        if self.state is not None:
            self.bytes.append(self.state.totals()["bytes_sent"] - self._before)
            named = dict(model.named_parameters())
            self.fragments.append(
                [
                    all(same_on_all_ranks(named[f].detach()) for f in fragment.names)
                    for fragment in self.state.fragments
                ]
            )
            global_params = self.state.global_params
            self.global_identical.append(all(same_on_all_ranks(global_params[n]) for n in sorted(global_params)))
            in_flight = self.state.in_flight
            self.in_flight.append(None if in_flight is None else [in_flight.fragment, in_flight.due])
            keys = SYNC_MOMENTS[self.state.moments]
            if keys:
                self.moments.append(
                    [
                        all(
                            same_on_all_ranks(moment)
                            for n in fragment.names
                            for key in keys
                            for moment in moment_tensors(optimizer, named[n], key)
                        )  # fmt: skip
                        for fragment in self.state.fragments
                    ]
                )


def by_name(state: OuterSyncState, key: str) -> dict:
    """What the fragments keep under `key` (`global`, `momentum`, `residuals`, `owner_residuals`), by parameter name."""
    return {name: value for fragment in state.fragments for name, value in fragment.state_by_name()[key].items()}


def codec_bytes(state: OuterSyncState, index: int, world_size: int, blocking: bool = True) -> float:
    """
    The bytes of a fragment's codes in one sync: the all-gather of every rank's message, or from OWNER_MIN_WORLD_SIZE
    ranks (blocking syncs, codes that owners reduce) the all-to-all of each owner's blocks (each tensor's blocks cut into
    `W` chunks, chunk `j` owned by rank `(j + crc32(name)) % W`) plus the all-gather of the owners' messages, padded to
    the longest.
    """
    sent = 0.0
    for row in state.fragments[index].rows[1:]:  # the codec rows (the first is sent dense)
        spec, slots, length = row.spec, zip(row.names, row.offsets, row.numels), row.length
        code, block = code_for(spec), spec.block_size
        if world_size < OWNER_MIN_WORLD_SIZE or not blocking or not code.owner_reducible:
            sent += allgather_bytes(code.message_nbytes(length // block), world_size)
            continue
        counts = [0] * world_size
        for name, _, numel in slots:
            shift = chunk_owner(name, world_size)
            for j, (start, end) in enumerate(chunk_bounds(-(-numel // block), world_size)):
                counts[(j + shift) % world_size] += end - start
        sizes = [code.message_nbytes(count) for count in counts]
        sent += alltoall_bytes(sum(sizes), world_size) + allgather_bytes(max(sizes), world_size)
    return sent


def expected_bytes(state: OuterSyncState, due: list[int], groups: int, world_size: int, blocking: bool,
                   moments: int = 0) -> float:  # fmt: skip
    """The bytes a step sends by the formulas of the module docstring: norms, and per synced fragment its flag and
    messages, and `moments` fp32 all-reduces of its entries (grpo_sync_moments)."""
    sent = allreduce_bytes(8 * groups, world_size)
    for f in due:
        sent += allreduce_bytes(8, world_size)  # the fragment's NaN/Inf flag
        fragment = state.fragments[f]
        sent += codec_bytes(state, f, world_size, blocking)
        sent += allreduce_bytes(4 * sum(fragment.rows[0].numels), world_size)
        sent += moments * allreduce_bytes(4 * fragment.numel, world_size)
    return sent


def train(args, resume=None):
    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    initial = [p.detach().clone() for p in model.parameters()]
    replicas = Replicas()
    trainer = GRPOTrainer(model=model, args=args, train_dataset=random_tokens(), callbacks=[replicas])
    state = trainer.grpo_comm_state
    replicas.state = state
    trainer.train(resume_from_checkpoint=resume)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    optimizer_state = trainer.optimizer.state_dict()["state"]
    moments = [t for i in sorted(optimizer_state) for t in optimizer_state[i].values() if torch.is_tensor(t)]
    steps = list(range(trainer.state.global_step - len(replicas.identical) + 1, trainer.state.global_step + 1))
    due = [fragments_due(s, state.every, len(state.fragments), state.ramp) for s in steps]
    last = steps and steps[-1] == args.max_steps
    if last:
        due[-1] = list(range(len(state.fragments)))  # the last step syncs every fragment
    # which syncs block: all without delay; with one, the ramp's, the last step's and those of several fragments
    ramp_end = max(ramp_points(state.every), default=0) if state.ramp else 0
    blocking = [state.delay == 0 or len(d) != 1 or s <= ramp_end or s == args.max_steps for s, d in zip(steps, due)]
    world_size = dist.get_world_size()
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "global_step": trainer.state.global_step,
        "hook_calls": state.hook_calls,
        "exchange": state.exchange,
        "own_exchange_group": getattr(state.exchange_communicator, "group", None) is not None,
        "steps": steps,
        "due": due,
        "identical_after_step": replicas.identical,
        "identical_fragments": replicas.fragments,
        "global_identical_after_step": replicas.global_identical,
        "in_flight_after_step": replicas.in_flight,
        "bytes_per_step": replicas.bytes,
        "expected_bytes": [
            expected_bytes(state, d, len(trainer.grpo_groups), world_size, b, len(SYNC_MOMENTS[state.moments]))
            for d, b in zip(due, blocking)
        ],
        "expected_bytes_without_moments": [
            expected_bytes(state, d, len(trainer.grpo_groups), world_size, b) for d, b in zip(due, blocking)
        ],
        "moments_identical_fragments": replicas.moments,
        "codec_bytes": [codec_bytes(state, f, world_size) for f in range(len(state.fragments))],
        "codec_numel": [sum(sum(row.numels) for row in fragment.rows[1:]) for fragment in state.fragments],
        "identical": all(same_on_all_ranks(p) for p in params),
        "global_is_params": all(torch.equal(p, state.global_params[n]) for n, p in trainer.model.named_parameters()),
        "multipliers_identical": same_on_all_ranks(trainer.grpo_callback.importance.multipliers),
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
        "digest": tensor_digest(params),
        "global_digest": tensor_digest([state.global_params[n] for n in sorted(state.global_params)]),
        "momentum_digest": tensor_digest([value for _, value in sorted(by_name(state, "momentum").items())]),
        "optimizer_digest": tensor_digest(moments),
        "residual_names": sorted(by_name(state, "residuals")),
        "residual_digest": tensor_digest([value for _, value in sorted(by_name(state, "residuals").items())]),
        "owner_residual_names": sorted(by_name(state, "owner_residuals")),
        "owner_residual_digest": tensor_digest(
            [value for _, value in sorted(by_name(state, "owner_residuals").items())]
        ),
        "changed": [not torch.equal(a, b) for a, b in zip(initial, params)],
        "losses": [entry["loss"] for entry in logs],
        "comm_logs": [{k: v for k, v in e.items() if k.startswith("grpo/comm") or k == "grpo/density"} for e in logs],
        "totals": state.totals(),
        "cost_comm_bytes": trainer.cost_callback.counted_metrics().get("cost/comm_bytes"),
        "last_sync": state.last_sync,
        "fragment_numels": [fragment.numel for fragment in state.fragments],
        "code_bits": sorted({spec.bits for spec in state.plan.values() if spec is not None}),
        "code_names": sorted({code_for(spec).name for spec in state.plan.values() if spec is not None}),
    }
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    return record


def scenario_sync(out_dir):
    return train(make_args(out_dir, "sync"))


def scenario_resume(out_dir, name="resume", **fields):
    args = make_args(out_dir, name, max_steps=12, save_strategy="steps", save_steps=6, **fields)
    straight = train(args)
    checkpoint = os.path.join(args.output_dir, "checkpoint-6")
    resumed = train(args, resume=checkpoint)
    return {"straight": straight, "resumed": resumed}


def scenario_localsgd(out_dir):
    """Our sync at outer lr 1 without momentum (fp32 Δ) against accelerate's LocalSGD averaging of the same models."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    ours = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    names = [n for n, _ in ours.named_parameters()]
    state = OuterSyncState({n: None for n in names}, [names], every=1, outer_lr=1.0, outer_momentum=0.0, ramp=False)
    state.bind(ours)
    with torch.no_grad():  # the local steps: each rank moves its own way
        generator = torch.Generator().manual_seed(100 + dist.get_rank())
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2)
    theirs = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    theirs.load_state_dict(ours.state_dict())
    local_sgd = LocalSGD(Accelerator(cpu=True), theirs, local_sgd_steps=1)
    state.end_step()
    local_sgd.step()  # local_sgd_steps=1: averages every parameter's .data
    diffs = [float((a - b).detach().abs().max()) for a, b in zip(ours.parameters(), theirs.parameters())]
    scale = max(float(p.detach().abs().max()) for p in theirs.parameters())
    return {
        "max_abs_diff": max(diffs),
        "max_abs_param": scale,
        "identical": all(same_on_all_ranks(p) for p in ours.parameters()),
        "syncs": state.totals()["syncs"],
        "bytes": state.totals()["bytes_sent"],
        "numel": sum(p.numel() for p in ours.parameters()),
        "digest": tensor_digest(list(ours.parameters())),
    }


def scenario_control(out_dir):
    return train(make_args(out_dir, "control", grpo_sync_outer_only=True, grpo_compression="none", max_steps=10))


def scenario_accum(out_dir):
    return train(
        make_args(
            out_dir, "accum", max_steps=9, grpo_sync_every=3, grpo_sync_fragments=3, grpo_sync_ramp=False,
            gradient_accumulation_steps=2, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=2,
            grpo_lr_ratios={"norms": 0.5}, grpo_sync_bits="8", grpo_sync_global_dtype="bfloat16",
        )
    )  # fmt: skip


def scenario_delay(out_dir):
    return train(make_args(out_dir, "delay", grpo_sync_delay=1, grpo_sync_mix=0.5))


def scenario_delay_resume(out_dir):
    args = make_args(out_dir, "delay_resume", max_steps=12, save_strategy="steps", save_steps=6, grpo_sync_delay=1,
                     grpo_sync_ramp=False)  # fmt: skip
    straight = train(args)
    resumed = train(args, resume=os.path.join(args.output_dir, "checkpoint-6"))
    saved = torch.load(os.path.join(args.output_dir, "checkpoint-6", f"grpo_state_rank{dist.get_rank()}.pt"),
                       weights_only=True)["comm"]["in_flight"]  # fmt: skip
    return {"straight": straight, "resumed": resumed, "saved_in_flight": [saved["fragment"], saved["due"]]}


def scenario_moments(out_dir):
    return train(make_args(out_dir, "moments", grpo_sync_moments="both"))


def scenario_moments_resume(out_dir):
    args = make_args(out_dir, "moments_resume", max_steps=12, save_strategy="steps", save_steps=6,
                     grpo_sync_moments="both")  # fmt: skip
    straight = train(args)
    resumed = train(args, resume=os.path.join(args.output_dir, "checkpoint-6"))
    return {"straight": straight, "resumed": resumed}


SPARSE = dict(grpo_sync_density=16 / 256, grpo_sync_chunk=256, grpo_sync_error_decay=0.95)  # SparseLoCo's, small


def scenario_sparse(out_dir):
    return train(make_args(out_dir, "sparse", **SPARSE))


def scenario_sparse_resume(out_dir):
    args = make_args(out_dir, "sparse_resume", max_steps=12, save_strategy="steps", save_steps=6, **SPARSE)
    straight = train(args)
    resumed = train(args, resume=os.path.join(args.output_dir, "checkpoint-6"))
    return {"straight": straight, "resumed": resumed}


SCENARIOS = {
    "localsgd": scenario_localsgd,
    "sync": scenario_sync,
    "resume": scenario_resume,
    "control": scenario_control,
    "accum": scenario_accum,
    "delay": scenario_delay,
    "delay_resume": scenario_delay_resume,
    "moments": scenario_moments,
    "moments_resume": scenario_moments_resume,
    "resume_ternary": lambda out_dir: scenario_resume(out_dir, "resume_ternary", grpo_sync_bits="ternary"),
    "resume_2": lambda out_dir: scenario_resume(out_dir, "resume_2", grpo_sync_bits="2"),
    "sparse": scenario_sparse,
    "sparse_resume": scenario_sparse_resume,
}
# launched by their own test fixtures, not by default
ALONE = ("moments", "moments_resume", "resume_ternary", "resume_2", "sparse", "sparse_resume")


def main():
    out_dir, names = sys.argv[1], sys.argv[2:] or [name for name in SCENARIOS if name not in ALONE]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Accelerate takes it over
    results = {name: SCENARIOS[name](out_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    results["nan_free"] = not any(
        math.isnan(loss) for r in results.values() if isinstance(r, dict) for loss in r.get("losses", [])
    )
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
