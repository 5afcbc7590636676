"""
The sync every H steps between replica groups, FSDP2 inside each, through `GRPOTrainer` under gloo on CPU (run by
tests/test_replica_groups_distributed.py): `torchrun --nproc_per_node 4` gives 2 replicas × 2 shards, 6 processes 3 × 2
(owner reduction). The model is sharded before the Trainer with `grpo_hf.shard_replica_groups`, the CPU launch of
docs/engines.md; its vocabulary of 129 rows leaves the embedding's shards uneven (65 and 64 rows).

Scenarios, each recording per rank what the pytest side asserts:

- `sync`: H=4, 2 fragments, ramp, 4-bit Δ (the defaults), importance multipliers applied. Every collective is counted
  by the process group it runs on: nothing crosses the replicate dimension between syncs. `θ_global` is bit-identical
  across the replicas after every step, the local shards differ between syncs; bytes per step by the formulas on the
  local sizes; the multipliers are the same within a replica at every step and on every rank after every sync.
- `reference`: fp32 Δ (`grpo_compression="none"`), one fragment, importance off: every sync against the DiLoCo
  formula computed in-process from the replicas' local shards (bit for bit), and the whole run against an in-process
  DDP-DiLoCo reference (`R` whole models, each stepping on the mean gradient of its `S` ranks' batches, recorded from
  the run) within fp32 rounding.
- `resume`: 12 steps straight (checkpoints at 6, mid-interval: the replicas differ) against the run resumed from
  checkpoint-6: local shards, `θ_global`, optimizer states and residuals bit for bit, each replica its own.
- `nan`: a NaN written into one rank's shard right before a sync: every rank of every replica drops that sync and
  restarts from `θ_global`.
- `accum`: gradient accumulation (2 micro-batches), 3 fragments, H=3.
- `delay`: `grpo_sync_delay=1`: the exchanges run in groups of their own behind one step.
- `shards`: `OuterSyncState` on raw FSDP2 (no Trainer) with a parameter of one row, whose second shard is empty: the
  bytes of every sync by the formulas on the local sizes.
- `resume_ternary`, `resume_2` (launched on their own): `resume` with `grpo_sync_bits="ternary"` / `"2"`, the sync's
  own codes, whose rows on the uneven local shards end in padding.
- `dcp`: torch DCP's dedupe of "replicated" shards, shown: two replicas' different local shards saved with `dcp.save`
  come back as one replica's; GRPO's per-rank files keep them apart (the `resume` scenario).

Usage: torchrun --nproc_per_node 4 replica_groups.py OUT_DIR REPLICAS [SCENARIO ...]   (default: all)
"""

import functools
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist
from _common import random_tokens, tensor_digest, worker_config, write_result
from testing_utils import end_worker, tiny_test_llama
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer, shard_replica_groups
from grpo_hf.compression.codes import code_for
from grpo_hf.compression.layout import chunk_bounds, chunk_owner
from grpo_hf.compression.outer_sync import OWNER_MIN_WORLD_SIZE, OuterSyncState, fragments_due, pack_fragments
from grpo_hf.compression.replicas import local_optimizer_state
from grpo_hf.compression.traffic import FLAG_BYTES, allgather_bytes, allreduce_bytes, alltoall_bytes
from grpo_hf.optim.moments import local_tensor


SEQ_LEN, VOCAB = 16, 129
REPLICAS = 2  # set from the command line


def make_args(out_dir, name, **overrides):
    fields = dict(
        max_steps=10,
        logging_steps=10,  # the Trainer gathers the loss over every process when it logs: only at the last step
        grpo_importance=True,
        grpo_lr_scale_warmup_steps=2,
        grpo_min_compress_numel=256,
        grpo_sync_every=4,
        grpo_sync_fragments=2,
    )
    return worker_config(os.path.join(out_dir, name), **{**fields, **overrides})


def build_model():
    return shard_replica_groups(tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN, vocab_size=VOCAB), REPLICAS)


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def same_on(tensor: torch.Tensor, group) -> bool:
    """Whether `tensor` is bit-identical on every rank of `group`."""
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    gathered = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, raw, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


# ----------------------------------------------------------------------------------------------------------------
# Every collective counted by the process group it runs on
# ----------------------------------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast", "isend", "irecv", "send", "recv", "barrier", "reduce", "gather", "scatter",
               "all_gather_object", "broadcast_object_list", "reduce_scatter")  # fmt: skip


class CountingCollectives:
    """
    Wraps torch.distributed's collectives (FSDP2, GRPO and the Trainer call them through `torch.distributed`) and counts
    the calls on a process group that spans several replicas (the default group included), while `active`.
    """

    def __init__(self, replicas: int, shards: int):
        self.shards, self.crossing, self.active, self.originals = shards, 0, False, {}
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                ranks = range(dist.get_world_size()) if group is None else group_ranks(group)
                if len({rank // self.shards for rank in ranks}) > 1:  # replica r holds ranks r*S .. r*S + S - 1
                    self.crossing += 1
            return original(*args, **kwargs)

        return counted

    def remove(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


# ----------------------------------------------------------------------------------------------------------------
# What a run records after every step
# ----------------------------------------------------------------------------------------------------------------


class Recorder(TrainerCallback):
    """
    Per optimizer step: the fragments due, the bytes, the collectives crossing replicas, whether `θ_global` and the
    local shards agree across the replicate group, the multipliers; before the sync (`on_optimizer_step` runs before
    GRPO's) the local shards and `θ_global`, for the exact DiLoCo formula.
    """

    def __init__(self, counting: CountingCollectives | None = None, keep_pre_sync: bool = False, poison=None):
        self.counting, self.keep_pre_sync, self.poison = counting, keep_pre_sync, poison
        self.state = self.trainer = None
        self.rows = []
        self.pre_sync = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self._crossing = 0
        if self.counting:  # from here to the end of training, but while this callback looks
            self.counting.active = True

    def on_step_begin(self, args, state, control, **kwargs):
        self._bytes = self.state.totals()["bytes_sent"]

    def on_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if self.poison is not None and step == self.poison and dist.get_rank() == dist.get_world_size() - 1:
            with torch.no_grad():
                local_tensor(next(iter(self.state.params.values()))).view(-1)[0] = float("nan")
        if self.keep_pre_sync:
            active = self._pause()
            replicate = self.state.process_group
            gathered = []
            for fragment in self.state.fragments:
                delta = fragment.take_delta()[0]  # θ_global − θ_local, as the sync takes it (the dense row: fp32 Δ)
                parts = [torch.empty_like(delta) for _ in range(dist.get_world_size(replicate))]
                dist.all_gather(parts, delta, group=replicate)  # every replica's Δ
                gathered.append((fragment.theta[0].clone(), parts))
            self.pre_sync[step] = gathered
            self._resume(active)

    def _pause(self):
        active = self.counting.active if self.counting else False
        if self.counting:
            self.counting.active = False
        return active

    def _resume(self, active):
        if self.counting:
            self.counting.active = active

    def on_step_end(self, args, state, control, **kwargs):
        crossing = (self.counting.crossing - self._crossing) if self.counting else 0  # since the last step's end
        active = self._pause()
        comm = self.state
        replicate = comm.process_group
        shard_group = comm.replicas.shard_group
        importance = self.trainer.grpo_callback.importance
        params = [local_tensor(p.detach()) for p in comm.params.values()]
        row = {
            "step": state.global_step,
            "bytes": comm.totals()["bytes_sent"] - self._bytes,
            "crossing": crossing,
            "global_identical": all(same_on(theta, replicate) for f in comm.fragments for theta in f.theta),
            "local_identical": all(same_on(p, replicate) for p in params),
            "fragments_identical": [
                all(same_on(local_tensor(comm.params[n].detach()), replicate) for n in f.names) for f in comm.fragments
            ],  # fmt: skip
            "multipliers_in_replica": same_on(importance.multipliers, shard_group),
            "multipliers_everywhere": same_on(importance.multipliers, None),
            "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "global_digest": tensor_digest([t for f in comm.fragments for t in f.theta]),
        }
        self.rows.append(row)
        if self.keep_pre_sync and state.global_step in self.pre_sync:
            row["formula_exact"] = self._formula_exact(self.pre_sync.pop(state.global_step))
        if self.counting:
            self._crossing = self.counting.crossing
        self._resume(active)

    def _formula_exact(self, gathered) -> list[bool]:
        """Per fragment: `θ_global` after this step against θ_g − (Δ_0 + ... + Δ_{R−1}) / R, `Δ_r = θ_g − θ_r` taken
        from every replica right before the sync, bit for bit (outer lr 1, momentum 0), where the fragment synced;
        `None` where it did not."""
        out = []
        for fragment, (theta, deltas) in zip(self.state.fragments, gathered):
            if fragment.last_sync != self.state.step:
                out.append(None)
                continue
            mean = deltas[0].clone()
            for delta in deltas[1:]:
                mean += delta
            expected = theta.add(mean.div_(len(deltas)), alpha=-1.0)
            out.append(torch.equal(expected, fragment.theta[0]))
        return out


def sync_bytes(state: OuterSyncState, due: list[int], groups: int, share: bool) -> float:
    """
    The bytes a step sends between replicas, by the formulas on the local sizes: per synced fragment its flag, its
    dense row's fp32 all-reduce and its codec rows' messages (all-gathered at 2 replicas; from 3, blocking, through
    owners); at a sync step the importance state's share (`G` float64 values).
    """
    world_size, sent = state.world_size, 0.0
    for f in due:
        fragment = state.fragments[f]
        sent += allreduce_bytes(FLAG_BYTES, world_size)
        if fragment.rows[0].length:
            sent += allreduce_bytes(4 * fragment.rows[0].length, world_size)
        for index in fragment.codec_rows:
            row = fragment.rows[index]
            code, block = code_for(row.spec), row.spec.block_size
            if world_size < OWNER_MIN_WORLD_SIZE:
                sent += allgather_bytes(code.message_nbytes(row.length // block), world_size)
                continue
            counts = [0] * world_size
            for name, numel in zip(row.names, row.numels):
                shift = chunk_owner(name, world_size)
                for j, (start, end) in enumerate(chunk_bounds(-(-numel // block), world_size)):
                    counts[(j + shift) % world_size] += end - start
            sizes = [code.message_nbytes(count) for count in counts]
            sent += alltoall_bytes(sum(sizes), world_size) + allgather_bytes(max(sizes), world_size)
    if due and share:
        sent += allreduce_bytes(8 * groups, world_size)
    return sent


def describe(trainer, recorder: Recorder) -> dict:
    """What every scenario records of a finished run."""
    state, model = trainer.grpo_comm_state, trainer.model
    replicate_ranks = group_ranks(state.process_group)
    shard_ranks = group_ranks(state.replicas.shard_group)
    meshes = {tuple(sorted(p.device_mesh.mesh.reshape(-1).tolist())) for p in model.parameters()}
    steps = [row["step"] for row in recorder.rows]
    due = [fragments_due(s, state.every, len(state.fragments), state.ramp) for s in steps]
    if steps and steps[-1] == trainer.args.max_steps:
        due[-1] = list(range(len(state.fragments)))
    groups = len(trainer.grpo_groups)
    optimizer = local_optimizer_state(trainer.optimizer)["state"]
    return {
        "engine": trainer.grpo_engine,
        "is_fsdp": isinstance(trainer.model_wrapped, FSDPModule) and isinstance(model, FSDPModule),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "meshes": [list(m) for m in meshes],
        "mesh_ndim": sorted({p.device_mesh.ndim for p in model.parameters()}),
        "shard_ranks": shard_ranks,
        "replicate_ranks": replicate_ranks,
        "replicas": state.replicas.replicas,
        "shards": state.replicas.shards,
        "sync_world_size": state.world_size,
        "exchange": state.exchange,
        "outer_sync": isinstance(state, OuterSyncState),
        "global_step": trainer.state.global_step,
        "rows": recorder.rows,
        "due": due,
        "expected_bytes": [sync_bytes(state, d, groups, state.exchange) for d in due],
        "totals": state.totals(),
        "local_numels": {n: local_tensor(p).numel() for n, p in state.params.items()},
        "full_numels": {n: p.numel() for n, p in state.params.items()},
        "residual_names": sorted(n for f in state.fragments for n in f.state_by_name()["residuals"]),
        "owner_residual_names": sorted(n for f in state.fragments for n in f.state_by_name()["owner_residuals"]),
        "local_digest": tensor_digest([local_tensor(p) for p in state.params.values()]),
        "global_digest": tensor_digest([t for f in state.fragments for t in f.theta]),
        "residual_digest": tensor_digest([r for f in state.fragments for r in f.residuals if r is not None]),
        "optimizer_digest": tensor_digest(
            [t for i in sorted(optimizer) for t in optimizer[i].values() if torch.is_tensor(t)]
        ),  # fmt: skip
        "multipliers": trainer.grpo_callback.importance.multipliers.tolist(),
        "average_tokens_across_devices": trainer.args.average_tokens_across_devices,
        "nonfinite_syncs": state.totals().get("nonfinite_syncs", 0),
    }


def train(out_dir, name, recorder=None, resume=None, collator=None, **overrides):
    recorder = recorder or Recorder()
    args = make_args(out_dir, name, **overrides)
    trainer = GRPOTrainer(
        model=build_model(), args=args, train_dataset=random_tokens(512, SEQ_LEN), callbacks=[recorder],
        data_collator=collator,
    )  # fmt: skip
    recorder.state, recorder.trainer = trainer.grpo_comm_state, trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder


def finish(trainer) -> None:
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()


# ----------------------------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------------------------


def scenario_sync(out_dir):
    counting = CountingCollectives(REPLICAS, dist.get_world_size() // REPLICAS)
    try:
        trainer, recorder = train(out_dir, "sync", recorder=Recorder(counting))
    finally:
        counting.remove()
    record = describe(trainer, recorder)
    saved = os.path.join(out_dir, "sync", "final")
    trainer.save_model(saved)  # θ_global: the model a user publishes
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        weights = load_file(os.path.join(saved, "model.safetensors"))
        record["saved_shapes"] = {k: list(v.shape) for k, v in weights.items()}
    full = {n: p.full_tensor().detach() for n, p in trainer.model.named_parameters()}
    record["saved_is_global"] = dist.get_rank() != 0 or all(
        torch.equal(weights[n], full[n]) for n in full if n in weights
    )
    finish(trainer)
    return record


class RecordingCollator:
    """The Trainer's batches as they come, per step (the in-process reference replays them)."""

    def __init__(self):
        self.batches = []

    def __call__(self, features):
        ids = torch.tensor([f["input_ids"] for f in features])
        self.batches.append(ids)
        return {"input_ids": ids, "labels": ids.clone()}


def reference_run(batches: list[list[torch.Tensor]], steps: int, every: int, lr: float, max_grad_norm: float):
    """
    DDP-DiLoCo in one process: `R` whole models, replica `r` stepping AdamW on the mean of its `S` ranks' gradients
    (each rank's own batch, its loss the mean over its tokens), clipped as the Trainer clips; after the steps the
    schedule says, `θ_global −= mean_r(θ_global − θ_r)` and every replica restarts from it.
    """
    shards = dist.get_world_size() // REPLICAS
    replicas = [tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN, vocab_size=VOCAB) for _ in range(REPLICAS)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) for m in replicas]
    theta = [p.detach().clone() for p in replicas[0].parameters()]
    for step in range(steps):
        for r, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            grads = []
            for s in range(shards):
                ids = batches[r * shards + s][step]
                model.zero_grad()
                model(input_ids=ids, labels=ids).loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *parts in zip(model.parameters(), *grads):
                p.grad = torch.stack(parts).mean(0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
        if fragments_due(step + 1, every, 1, True) or step + 1 == steps:
            with torch.no_grad():
                for i, params in enumerate(zip(*(m.parameters() for m in replicas))):
                    mean = sum((theta[i] - p for p in params[1:]), theta[i] - params[0]) / len(params)
                    theta[i] = theta[i] - mean
                    for p in params:
                        p.copy_(theta[i])
    return theta


def scenario_reference(out_dir):
    collator = RecordingCollator()
    trainer, recorder = train(out_dir, "reference", recorder=Recorder(keep_pre_sync=True), collator=collator,
                              grpo_compression="none", grpo_sync_fragments=1, grpo_importance=False,
                              max_steps=8)  # fmt: skip
    record = describe(trainer, recorder)
    full = [p.full_tensor().detach() for p in trainer.model.parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, collator.batches)
    args = trainer.args
    if dist.get_rank() == 0:
        expected = reference_run(everyone, args.max_steps, args.grpo_sync_every, args.learning_rate,
                                 args.max_grad_norm)  # fmt: skip
        gaps = [float((a - b).abs().max()) for a, b in zip(full, expected)]
        record["reference_max_abs_diff"] = max(gaps)
        record["reference_max_abs_param"] = max(float(b.abs().max()) for b in expected)
    finish(trainer)
    return record


def scenario_resume(out_dir, name="resume", **extra):
    fields = dict(max_steps=12, save_strategy="steps", save_steps=6, save_only_model=True, **extra)
    straight, recorder = train(out_dir, name, **fields)
    record = {"straight": describe(straight, recorder)}
    record["straight"]["code_names"] = sorted({code_for(s).name for s in straight.grpo_comm_state.plan.values() if s})
    finish(straight)
    checkpoint = os.path.join(out_dir, name, "checkpoint-6")
    resumed, recorder = train(out_dir, f"{name}_resumed", resume=checkpoint, **fields)
    record["resumed"] = describe(resumed, recorder)
    record["state_file"] = os.path.exists(os.path.join(checkpoint, f"grpo_state_rank{dist.get_rank()}.pt"))
    finish(resumed)
    return record


def scenario_nan(out_dir):
    # one fragment, H=4: syncs after steps 1 and 3 (the ramp), 7 and 10 (the last); the NaN lands right before 7's
    trainer, recorder = train(out_dir, "nan", recorder=Recorder(poison=7), grpo_sync_fragments=1)
    record = describe(trainer, recorder)
    finish(trainer)
    return record


def scenario_accum(out_dir):
    trainer, recorder = train(out_dir, "accum", gradient_accumulation_steps=2, grpo_sync_every=3,
                              grpo_sync_fragments=3, max_steps=9, logging_steps=9)  # fmt: skip
    record = describe(trainer, recorder)
    finish(trainer)
    return record


def scenario_delay(out_dir):
    trainer, recorder = train(out_dir, "delay", grpo_sync_delay=1, grpo_sync_ramp=False, max_steps=9, logging_steps=9)
    state = trainer.grpo_comm_state
    record = describe(trainer, recorder)
    twin = getattr(state.exchange_communicator, "group", None)  # the exchanges' own process group (delay > 0)
    record["own_exchange_group"] = twin is not None
    record["exchange_group_ranks"] = group_ranks(twin) if twin is not None else []
    finish(trainer)
    return record


def scenario_shards(out_dir):
    """Raw FSDP2 with a one-row parameter (its second shard empty), a few local steps and syncs; bytes by formula."""
    from grpo_hf.compression import compression_plan
    from grpo_hf.grouping import assign_groups, load_group_spec

    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN, vocab_size=VOCAB)
    norm = model.model.norm
    norm.register_parameter("extra", torch.nn.Parameter(torch.randn(1, 300)))  # its shards: 1 row and 0 rows
    norm.register_forward_hook(lambda module, args, out: out + 1e-3 * module.extra.mean())  # used in the forward
    shard_replica_groups(model, REPLICAS)
    groups = assign_groups(model, load_group_spec("semantic"))
    plan = compression_plan(model, groups, compression="quantize", bits=4, min_numel=256)
    units = [(g.name, g.param_names, [p.numel() for p in g.params]) for g in groups]
    state = OuterSyncState(plan, pack_fragments(units, 2), every=2, replicas=model.grpo_replica_groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state.attach(model, model, optimizer)
    sent, expected, due_steps = [], [], []
    for step in range(1, 7):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        ids = torch.randint(0, 128, (4, SEQ_LEN), generator=gen)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        due = fragments_due(step, 2, 2, True)
        sent.append(state.end_step())
        expected.append(sync_bytes(state, due, len(groups), share=False))
        due_steps.append(due)
    extra = model.model.norm.extra
    return {
        "extra_local_rows": local_tensor(extra).shape[0],
        "extra_fragment": next(f.index for f in state.fragments if "model.norm.extra" in f.names),
        "sent": sent,
        "expected": expected,
        "due": due_steps,
        "global_identical": all(same_on(t, state.process_group) for f in state.fragments for t in f.theta),
        "finite": all(bool(torch.isfinite(local_tensor(p)).all()) for p in model.parameters()),
    }


def scenario_dcp(out_dir):
    """DCP's dedupe of shards it believes replicated: each replica saves its own values of the same DTensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    shards = dist.get_world_size() // REPLICAS
    mesh = init_device_mesh("cpu", (REPLICAS, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    replica = mesh.get_local_rank("dp_replicate")
    local = torch.full((4, 3), float(replica))  # every replica's shards hold its own index
    value = DTensor.from_local(local, mesh["dp_shard"], [Shard(0)])
    folder = os.path.join(out_dir, "dcp")
    dcp.save({"value": value}, checkpoint_id=folder)
    loaded = {"value": DTensor.from_local(torch.full((4, 3), -1.0), mesh["dp_shard"], [Shard(0)])}
    dcp.load(loaded, checkpoint_id=folder)
    return {"replica": replica, "loaded": float(loaded["value"].to_local()[0, 0])}


SCENARIOS = {
    "sync": scenario_sync,
    "reference": scenario_reference,
    "resume": scenario_resume,
    "nan": scenario_nan,
    "accum": scenario_accum,
    "delay": scenario_delay,
    "shards": scenario_shards,
    "dcp": scenario_dcp,
    "resume_ternary": lambda out_dir: scenario_resume(out_dir, "resume_ternary", grpo_sync_bits="ternary"),
    "resume_2": lambda out_dir: scenario_resume(out_dir, "resume_2", grpo_sync_bits="2"),
}
ALONE = ("resume_ternary", "resume_2")  # launched by their own test fixture, not by default


def main():
    global REPLICAS
    torch.set_num_threads(1)
    logging.getLogger("grpo_hf").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    out_dir, REPLICAS, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:] or [s for s in SCENARIOS if s not in ALONE]
    results = {name: SCENARIOS[name](out_dir) for name in names}
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
