"""GRPOTrainer on the engines that need GPUs to run as users run them: the Trainer's FSDP2 (Accelerate's FSDP plugin)
and DeepSpeed ZeRO-2, each trained, checkpointed and resumed (called by `benchmarks/gpu_check.sh`).

    torchrun --nproc_per_node N -m benchmarks.gpu_engines fsdp2 OUT_DIR      # fsdp=True, fsdp_config={"version": 2}
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes N \\
        -m benchmarks.gpu_engines fsdp2-accelerate OUT_DIR                   # the accelerate config file's FSDP2
    torchrun --nproc_per_node N -m benchmarks.gpu_engines zero2 OUT_DIR      # --deepspeed recipes/accelerate/ds_zero2.json
    torchrun --nproc_per_node 4 -m benchmarks.gpu_engines fsdp2-replicas OUT_DIR   # 2 replicas x N/2 shards, sync every 4

From the repository root, as a module (it imports `tests.testing_utils`; `gpu_check.sh` runs the file with the root on
`PYTHONPATH`, which does the same).

Each mode trains a tiny Llama on random tokens for 12 steps (a checkpoint at step 6), resumes a second trainer from
that checkpoint, and prints one `PASS` / `FAIL` line per check (the engine GRPO detected, the model and optimizer it
trains, the per-group learning rates, the compressed reduce-scatter with more than one GPU, the resumed run equal to
the straight one), then the figures as one JSON line. Exit status 1 when a check fails. `zero2` also runs on CPU
(DeepSpeed's CPU accelerator); the FSDP2 modes need CUDA (Accelerate turns FSDP off on CPU).

`fsdp2-replicas` (at least 4 GPUs, an even number) is the sync every H steps between replica groups through the
Trainer's own path (issue 45): Accelerate's FSDP plugin with `parallelism_config=ParallelismConfig(dp_replicate_size=2,
dp_shard_size=N/2)` (HSDP, which GRPOTrainer turns into replica groups) and `grpo_sync_every=4`. It checks that FSDP2
shards each replica over its own GPUs only (1-D meshes), that the sync ran over the replicate groups with `θ_global`
in pinned CPU memory, that the replicas agree after the last step, and that the resume from checkpoint-6 (the Trainer's
DCP files, and GRPO's per-rank files for what differs between replicas) equals the straight run on every rank.
"""

import argparse
import json
import os
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

SEQ_LEN = 32
RATIOS = {"norms": 0.5, "embeddings": 2.0}
CHECKS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail="") -> None:
    CHECKS.append((name, bool(ok), str(detail)))


def dataset():
    import torch
    from datasets import Dataset

    ids = torch.randint(0, 128, (512, SEQ_LEN), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(mode: str, out_dir: str, **overrides):
    from grpo_hf import GRPOConfig

    kwargs = dict(
        output_dir=out_dir,
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=6,
        save_strategy="steps",
        save_steps=6,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        grpo_importance=True,
        grpo_lr_scale_warmup_steps=2,
        grpo_lr_ratios=RATIOS,
        grpo_log_groups=True,  # the checks read grpo/lr/<group>
        grpo_fsdp_error_feedback="worker-bf16",
    )
    if mode == "fsdp2":
        kwargs.update(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"})
    elif mode == "fsdp2-replicas":
        from accelerate import ParallelismConfig

        shards = int(os.environ["WORLD_SIZE"]) // 2
        kwargs.update(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
                      parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=shards),
                      grpo_sync_every=4, grpo_sync_fragments=2)  # fmt: skip
        kwargs.pop("grpo_fsdp_error_feedback")
    elif mode == "zero2":
        kwargs.update(deepspeed=str(ROOT / "grpo_hf" / "recipes" / "accelerate" / "ds_zero2.json"))
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def full_params(trainer):
    import torch

    params = []
    for p in trainer.model.parameters():
        params.append(
            p.full_tensor().detach().float().cpu() if hasattr(p, "full_tensor") else p.detach().float().cpu()
        )
    return torch.cat([p.reshape(-1) for p in params])


def train(mode: str, out_dir: str, resume=None):
    from grpo_hf import GRPOTrainer
    from tests.testing_utils import tiny_test_llama

    trainer = GRPOTrainer(
        model=tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN), args=make_args(mode, out_dir),
        train_dataset=dataset(),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def check_replicas(trainer) -> None:
    """Replica groups on GPUs: FSDP2 inside each replica only, the sync over the replicate groups, θ_global pinned."""
    import torch
    import torch.distributed as dist

    state, shards = trainer.grpo_comm_state, dist.get_world_size() // 2
    meshes = {(p.device_mesh.ndim, p.device_mesh.size()) for p in trainer.model.parameters()}
    check("FSDP2 shards each replica over its own GPUs only (1-D meshes, not HSDP)", meshes == {(1, shards)}, meshes)
    replicas = getattr(state, "replicas", None)
    check("the sync runs over the replicate groups", replicas is not None and (replicas.replicas, replicas.shards)
          == (2, shards) and state.totals()["syncs"] > 0, state)  # fmt: skip
    check("θ_global and the momentum in pinned CPU memory (grpo_sync_global_device='auto')",
          all(t.device.type == "cpu" and t.is_pinned() for f in state.fragments for t in f.theta))  # fmt: skip
    group = state.process_group
    same = []
    for p in trainer.model.parameters():
        local = p.to_local().detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        same.append(all(torch.equal(part, local) for part in parts))
    check("the replicas agree after the last step (it syncs every fragment)", all(same))


def run(mode: str, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    straight = train(mode, os.path.join(out_dir, "straight"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine = (
        "deepspeed" if mode == "zero2" else "fsdp2"
    )  # fsdp2: the Trainer's arguments; fsdp2-accelerate: the config
    check("engine", straight.grpo_engine == engine, straight.grpo_engine)
    named = dict(straight.model.named_parameters())
    if engine == "fsdp2":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        check("model is FSDPModule", isinstance(straight.model_wrapped, FSDPModule), type(straight.model_wrapped))
        check("DTensor parameters", all(isinstance(p, DTensor) for p in named.values()))
        check(
            "optimizer holds the sharded parameters",
            all(p is named[n] for g in straight.optimizer.param_groups for n, p in zip(g["param_names"], g["params"])),
        )
        check("groups follow the sharded parameters", all(p is named[n] for g in straight.grpo_groups for n, p in zip(g.param_names, g.params)))  # fmt: skip
        state = straight.grpo_comm_state
        if mode == "fsdp2-replicas":
            check_replicas(straight)
        elif world_size > 1:
            check("compressed reduce-scatter ran", state is not None and state.hook_calls > 0 and state.step == 12)
    else:
        check("ZeRO stage 2", straight.model_wrapped.zero_optimization_stage() == 2)
        check("compression off", straight.grpo_compression == "none" and straight.grpo_comm_state is None)
    groups = {g.get("grpo_group") for g in straight.optimizer.param_groups}
    check(
        "one optimizer group per GRPO group",
        groups == {g.name for g in straight.grpo_groups},
        sorted(map(str, groups)),
    )
    logs = [e for e in straight.state.log_history if "loss" in e]
    lr = logs[-1]
    check(
        "LR ratios and multipliers",
        lr["grpo/lr/norms"] < lr["grpo/lr/embeddings"],
        {k: v for k, v in lr.items() if k.startswith("grpo/lr/")},
    )
    multipliers = straight.grpo_callback.importance.multipliers
    gathered = [torch.empty_like(multipliers) for _ in range(world_size)]
    dist.all_gather(gathered, multipliers)
    check("multipliers identical on every rank", all(torch.equal(g, multipliers) for g in gathered))
    check(
        "finite losses", all(e["loss"] == e["loss"] and abs(e["loss"]) < 1e4 for e in logs), [e["loss"] for e in logs]
    )
    final = full_params(straight)
    checkpoint = os.path.join(out_dir, "straight", "checkpoint-6")
    check("GRPO state file per rank", os.path.isfile(os.path.join(checkpoint, f"grpo_state_rank{rank}.pt")))
    del straight
    resumed = train(mode, os.path.join(out_dir, "straight"), resume=checkpoint)
    again = full_params(resumed)
    check("resumed run equals the straight one", torch.equal(final, again), float((final - again).abs().max()))
    figures = {
        "mode": mode,
        "world_size": world_size,
        "max_param_gap_after_resume": float((final - again).abs().max()),
    }
    if resumed.grpo_comm_state is not None:
        figures["comm"] = {k: v for k, v in resumed.grpo_comm_state.totals().items() if isinstance(v, (int, float))}
    return figures


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["fsdp2", "fsdp2-accelerate", "zero2", "fsdp2-replicas"],
                        help="The engine and how it is set.")  # fmt: skip
    parser.add_argument("out_dir", help="Checkpoints and the trainers' output folders go here.")
    args = parser.parse_args()
    mode = args.mode
    figures = run(mode, args.out_dir)
    if dist.get_rank() == 0:
        for name, ok, detail in CHECKS:
            print(f"{'PASS' if ok else 'FAIL'} {mode}: {name}" + (f" ({detail})" if detail and not ok else ""))
        print(json.dumps(figures))
    failed = any(not ok for _, ok, _ in CHECKS)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
