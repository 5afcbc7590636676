"""Replica groups in the benchmarks (issue 45): `R` replicas × `S` shards on `R·S` gloo processes, the model sharded
before the Trainer (the CPU path of docs/engines.md), against HSDP on the same processes.

Rows, by name (`S` = the launch's world size / `R`), for `benchmarks/suite.py comm --world_size R·S` and
`benchmarks/bench_step_cost.py`:

- `hsdp<R>`: HSDP, the per-step baseline: FSDP2 on the 2-D mesh `(dp_replicate, dp_shard)`, a reduce-scatter inside
  each replica and an fp32 all-reduce of the shards over the replicas at every step (GRPOTrainer, compression off).
- `rg<R>-<sync row>`, e.g. `rg2-sync32`: replica groups, FSDP2 over each replica's shards
  (`grpo_hf.shard_replica_groups`) and the sync every H steps over the replicate dimension, with the settings of the
  suite's sync row (`benchmarks.suite.sync_row`: `sync32` is GRPOConfig's defaults at H=32, `sync32-d1` overlaps).

Bytes count the replicate dimension only (the shard dimension is a machine's own link): HSDP's all-reduce of this rank's
local shard of every gradient, `2 (R − 1) / R × 4 n_local` per step (`bf16` HSDP: half), and the sync's own count
(`grpo/comm/bytes_sent`). Under `bench_step_cost.py --link_gbit` the emulated link carries the replicate dimension only:
the sync's collectives (GRPO's `Communicator`) and HSDP's all-reduce (an all-reduce hook on every FSDP2 unit waits for
it); FSDP2's reduce-scatters and all-gathers inside a replica run at loopback speed.
"""

import re


ROW = re.compile(r"(?:hsdp(?P<hsdp>\d+)|rg(?P<replicas>\d+)-(?P<sync>.+))")


def replica_row(name: str, sync_row) -> dict | None:
    """
    `{"name", "kind", "replicas", "overrides"}` of a replica-group row (`kind`: `"hsdp"` or `"replicas"`); `None` for
    another row. `sync_row` maps a sync row's name to its GRPOConfig fields (the suite's).
    """
    match = ROW.fullmatch(name)
    if match is None:
        return None
    if match["hsdp"]:
        return {
            "name": name,
            "kind": "hsdp",
            "replicas": int(match["hsdp"]),
            "overrides": {"grpo_compression": "none"},
        }
    overrides = sync_row(match["sync"])
    if overrides is None:
        raise ValueError(f"{name}: {match['sync']!r} is not a row of the sync every H steps (e.g. rg2-sync32).")
    return {"name": name, "kind": "replicas", "replicas": int(match["replicas"]), "overrides": overrides}


def shard_hsdp(model, replicas: int):
    """
    HSDP on a model before the Trainer, as Accelerate's `ParallelismConfig(dp_replicate_size=R)` shards it on GPUs:
    `fully_shard` on the 2-D mesh over the same modules as `grpo_hf.shard_replica_groups`, and the model marked the
    same way (sharded before the Trainer, as HSDP: the Trainer defers the replicate all-reduce to a step's last
    micro-batch).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    from grpo_hf.compression.replicas import REPLICATE_DIM, SHARD_DIM

    shards = dist.get_world_size() // replicas
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_distributed_loading_by_transformers = True
    model.config.distributed_config = DistributedConfig(fsdp_size=shards, dp_replicate_size=replicas)
    return model


def shard_for_row(model, row: dict):
    """The model of a replica-group row, sharded before the Trainer (rows of other kinds: as it is)."""
    from grpo_hf import shard_replica_groups

    if row.get("kind") == "hsdp":
        return shard_hsdp(model, row["replicas"])
    if row.get("kind") == "replicas":
        return shard_replica_groups(model, row["replicas"])
    return model


def replicate_bytes_per_step(model, replicas: int, element_size: int = 4) -> float:
    """HSDP's bytes per rank and step on the replicate dimension: the all-reduce of this rank's local shards."""
    from grpo_hf.compression.traffic import allreduce_bytes
    from grpo_hf.optim.moments import local_tensor

    numel = sum(local_tensor(p).numel() for p in model.parameters() if p.requires_grad)
    return allreduce_bytes(element_size * numel, replicas)


def check_replica_run(trainer, row: dict) -> None:
    """The run really was what the row says: FSDP2 units on the row's mesh, and for replica groups the sync over them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from grpo_hf.optim.moments import local_tensor

    assert isinstance(trainer.model, FSDPModule), "the model was not sharded by FSDP2"
    ndim = {p.device_mesh.ndim for p in trainer.model.parameters()}
    assert ndim == ({2} if row["kind"] == "hsdp" else {1}), f"mesh dimensions {ndim} for a {row['kind']} row"
    if row["kind"] == "replicas":
        state = trainer.grpo_comm_state
        assert state.replicas.replicas == row["replicas"] and state.totals()["syncs"] > 0, "the sync did not run"
        assert state.replicas.shards == dist.get_world_size() // row["replicas"]
        assert any(local_tensor(p).numel() < p.numel() for p in trainer.model.parameters())


def delay_hsdp_all_reduce(model, replicas: int, link) -> None:
    """
    HSDP's replicate all-reduce behind the emulated link: an all-reduce hook on every FSDP2 unit (it runs after the
    unit's all-reduce, on the training thread on CPU) waits until `link` has carried what this rank sent in it.
    """
    from torch.distributed.fsdp import FSDPModule

    from benchmarks.emulated_link import EmulatedLink
    from grpo_hf.compression.traffic import allreduce_bytes

    def hook(output):
        EmulatedLink.wait_until(link.reserve(allreduce_bytes(output.numel() * output.element_size(), replicas)))

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)


def peak_rss_bytes() -> int | None:
    """
    The peak resident set size (`VmHWM`) since the last [`~grpo_hf.harness.compare.reset_peak_memory`], or `None`
    where it cannot be read.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak(record: dict) -> float:
    """A run's peak memory per rank: training's own (the largest rank) where measured, else the process's."""
    return max(
        record.get("train_peak_rss_by_rank") or record.get("peak_memory_by_rank") or [record["peak_memory_bytes"]]
    )


def replica_markdown(records: dict, baseline: str) -> str:
    """
    The replica-group rows of a suite run (`records`: task -> row -> list of result records at each row's best or only
    learning rate): bytes between replicas against fp32 and bf16 HSDP, perplexity against `baseline` (HSDP, best
    against best when the suite swept), and peak memory per rank during training (the largest rank, median over seeds;
    `reset_peak_memory` at train start) against the DDP sync row of the same H (`rg2-sync32` against `sync32`).
    """
    import math
    import statistics

    lines = [
        f"| task | row | seeds | bytes between replicas vs fp32 HSDP | vs bf16 HSDP | ppl / {baseline}: geomean | worst "
        "seed | peak RSS per rank in training (MiB) | x the DDP sync's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task, rows in records.items():
        base = {r["seed"]: math.exp(r["eval_loss"]) for r in rows.get(baseline, [])}
        for name, runs in rows.items():
            if ROW.fullmatch(name) is None:
                continue
            sent = statistics.fmean(sum(s["bytes"] for s in r["per_step"]) for r in runs)
            hsdp = statistics.fmean(r["dense_fp32_bytes_per_step"] * r["steps"] for r in runs)
            ratios = [math.exp(r["eval_loss"]) / base[r["seed"]] for r in runs if r["seed"] in base]
            geomean = math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else math.nan
            peak = statistics.median(_peak(r) for r in runs)
            ddp = rows.get(name.split("-", 1)[1]) if name.startswith("rg") else None
            ddp_peak = statistics.median(_peak(r) for r in ddp) if ddp else None
            cells = [task, name, str(len(runs)), f"{hsdp / sent:.1f}x", f"{hsdp / 2 / sent:.1f}x",
                     f"{geomean:.4f}" if ratios else "-", f"{max(ratios):.4f}" if ratios else "-",
                     f"{peak / 2**20:,.0f}", f"{peak / ddp_peak:.2f}" if ddp_peak else "-"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replica_step_markdown(results: list[dict]) -> str:
    """
    The step-cost rows of replica groups (`bench_step_cost.py`): each row's mean step on loopback and under each
    emulated link (`--link_gbit`, the replicate dimension only), against HSDP's of the same model and link, the bytes
    between replicas per step and the peak RSS per rank; `""` without such rows.
    """
    rows = [r for r in results if ROW.fullmatch(r["row"]) and "per_step" in r]
    if not rows:
        return ""
    links = sorted({gbit for r in rows for gbit in r.get("measured_link", {})}, key=float)
    header = ["model", "row", "processes", "mean step s (loopback)", "× hsdp"]
    for gbit in links:
        header += [f"mean step s @ {gbit} Gbit/s", "× hsdp"]
    header += ["MB between replicas per step (mean)", "peak RSS MiB per rank"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    hsdp = {r["model"]: r for r in rows if r["row"].startswith("hsdp")}

    def mean(row, key="step_s", link=None):
        steps = row["per_step"] if link is None else row["measured_link"][link]["per_step"]
        skip = 3  # the untimed steps of these rows (bench_step_cost's GRPO_WARMUP)
        return sum(s[key] for launch in steps for s in launch[skip:]) / sum(len(launch[skip:]) for launch in steps)

    for r in rows:
        base = hsdp.get(r["model"])
        cells = [r["model"], f"`{r['row']}`", str(r["world_size"]), f"{mean(r):.3f}",
                 f"{mean(r) / mean(base):.2f}" if base else "–"]  # fmt: skip
        for gbit in links:
            ours = r.get("measured_link", {}).get(gbit)
            theirs = base.get("measured_link", {}).get(gbit) if base else None
            cells += [f"{mean(r, link=gbit):.3f}" if ours else "–",
                      f"{mean(r, link=gbit) / mean(base, link=gbit):.2f}" if ours and theirs else "–"]  # fmt: skip
        cells += [f"{mean(r, 'bytes') / 1e6:.3f}", f"{max(r['peak_rss_mib_by_rank']):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "ROW",
    "peak_rss_bytes",
    "check_replica_run",
    "delay_hsdp_all_reduce",
    "replica_markdown",
    "replica_row",
    "replica_step_markdown",
    "replicate_bytes_per_step",
    "shard_for_row",
    "shard_hsdp",
]
