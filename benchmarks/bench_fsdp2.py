"""FSDP2 with GRPO's compressed reduce-scatter on the suite's `llama-scratch` task: quality, bytes and memory per rank.

    python -m benchmarks.bench_fsdp2 --output_dir runs/bench_fsdp2                         # every default row, seeds 0-3
    python -m benchmarks.bench_fsdp2 --output_dir /tmp/x --rows fsdp2,q8-none --seeds 0 --max_steps 20   # a smoke run
    python -m benchmarks.bench_fsdp2 --output_dir runs/bench_fsdp2 --report_only           # the summary of what is there

Every run trains the task's model (`benchmarks/tasks.py`: Llama 2.6M, hidden 128, 4 layers, from scratch, on the
stdlib source at 128 tokens, cosine LR with warm-up, AdamW, gradient clipping at 1.0 as the Trainer's default) on 2
gloo processes, with `fully_shard` applied as Accelerate's FSDP2 path applies it (each decoder layer, then the tail
with the tied embedding, then the root). The same seed gives every row the same initialization and data order.

Rows:

- `ddp`: the DDP reference (dense fp32 all-reduce), for bytes and memory.
- `fsdp2`: FSDP2 with its own reduce-scatter (uncompressed): the baseline of the quality ratios.
- `q8-none`, `q4-none`: GRPO's reduce-scatter at 8 / 4 bits without error feedback (what owner-side feedback amounts
  to in a one-phase reduce-scatter, see `grpo_hf/compression/fsdp.py`).
- `q8-bf16`, `q4-bf16`: the same with the worker-side residual in bf16; `q8-int8`, `q4-int8` (not run by default): the
  residual in 8-bit blocks.

One torchrun launch per row and seed, so that each peak RSS is that run's own. Per row and seed,
`<output_dir>/results/<row>-seed<seed>.json` holds the eval loss and perplexity (all held-out tokens), per rank and
optimizer step the bytes of the gradient reduction (ring model; the compressed rows count their all-to-all messages)
and of FSDP2's parameter all-gathers, per rank the peak RSS, its growth from before the model was built, and the
counted bytes of parameters, gradients, optimizer states and error-feedback residuals. An existing file is not run
again (resumable). The summary (`report.md`, `results.json`): per row the geometric mean over seeds of the perplexity
ratio to `fsdp2`, the worst seed, bytes and memory per rank.

Hardware notes: on a shared CPU, bytes, counted memory and quality are the meaningful outputs; times are the machine's.
"""

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

from benchmarks.tasks import TASKS, build_model, prepare  # noqa: E402


ROWS = {
    "ddp": {"engine": "ddp"},
    "fsdp2": {"engine": "fsdp2"},
    "q8-none": {"engine": "fsdp2", "bits": 8, "error_feedback": "none"},
    "q8-bf16": {"engine": "fsdp2", "bits": 8, "error_feedback": "worker-bf16"},
    "q4-none": {"engine": "fsdp2", "bits": 4, "error_feedback": "none"},
    "q4-bf16": {"engine": "fsdp2", "bits": 4, "error_feedback": "worker-bf16"},
    "q8-int8": {"engine": "fsdp2", "bits": 8, "error_feedback": "worker-int8"},
    "q4-int8": {"engine": "fsdp2", "bits": 4, "error_feedback": "worker-int8"},
}
DEFAULT_ROWS = "fsdp2,ddp,q8-none,q8-bf16,q4-none,q4-bf16"
BASELINE = "fsdp2"
DENSE_WARMUP_STEPS = 2  # GRPOConfig's grpo_dense_warmup_steps
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


# ----------------------------------------------------------------------------------------------------------------
# Worker: one row and one seed, under torchrun
# ----------------------------------------------------------------------------------------------------------------


class CountingAllGather:
    """FSDP2's all-gather as it is (`all_gather_single`), counting what this rank sends (ring: (W - 1) * s)."""

    def __init__(self):
        self.bytes = 0.0

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        self.bytes += (dist.get_world_size(group) - 1) * input_tensor.numel() * input_tensor.element_size()
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13: the old name
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    """FSDP2's reduce-scatter as it is (`reduce_scatter_single`), counting what this rank sends (ring: (W - 1) * s)."""

    def __init__(self):
        self.bytes = 0.0

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        self.bytes += (dist.get_world_size(group) - 1) * output_tensor.numel() * output_tensor.element_size()
        scatter = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )  # torch < 2.13: the old name
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def run(job: dict) -> dict:
    import psutil
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from torch.distributed.fsdp import FSDPModule
    from transformers import get_cosine_schedule_with_warmup

    from grpo_hf.compression.fsdp import FSDPCommState, install_compressed_reduce_scatter
    from grpo_hf.compression.traffic import dense_allreduce_bytes
    from tests.testing_utils import shard_like_accelerate

    task = TASKS["llama-scratch"]
    steps = job["max_steps"] or task.max_steps
    row, seed = ROWS[job["row"]], job["seed"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train, evaluation = load_from_disk(job["info"]["train_path"]), load_from_disk(job["info"]["eval_path"])
    per_rank = task.batch_size // world_size
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    if steps * task.batch_size > len(order):
        raise ValueError(f"{steps} steps need {steps * task.batch_size} sequences; the data has {len(order)}.")
    train_ids = torch.tensor(train["input_ids"])
    rss_before = psutil.Process().memory_info().rss

    model = build_model(task, job["info"], seed)
    model.train()
    comm_state, gather, scatter = None, CountingAllGather(), CountingReduceScatter()
    if row["engine"] == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        shard_like_accelerate(model)
        assert isinstance(model, FSDPModule)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
        if "bits" in row:
            comm_state = FSDPCommState(row["bits"], row["error_feedback"], dense_warmup_steps=DENSE_WARMUP_STEPS)
            install_compressed_reduce_scatter(model, comm_state)
        wrapped = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.learning_rate, weight_decay=task.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, task.warmup_steps, steps)
    numel = sum(p.numel() for p in model.parameters())
    losses, grad_bytes, gather_bytes, skipped = [], [], [], 0
    start = time.perf_counter()
    for step in range(steps):
        batch = order[step * task.batch_size :][rank * per_rank : (rank + 1) * per_rank]
        ids = train_ids[batch]
        sent_before, gathered_before = _grad_bytes(comm_state, scatter), gather.bytes
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        finite = bool(torch.isfinite(norm))
        if comm_state is not None:
            comm_state.end_step(finite)
        if finite:
            optimizer.step()
        else:
            skipped += 1
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if row["engine"] == "ddp":
            grad_bytes.append(dense_allreduce_bytes(numel, world_size))
        else:
            grad_bytes.append(_grad_bytes(comm_state, scatter) - sent_before)
        gather_bytes.append(gather.bytes - gathered_before)
    train_s = time.perf_counter() - start
    state = {  # counted while the parameters are sharded (a forward leaves units with reshard_after_forward=False whole)
        "params": _tensor_bytes(model.parameters()),
        "optimizer": _tensor_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
        "residuals": comm_state.residual_nbytes() if comm_state is not None else 0,
    }
    state["grads"] = state["params"]  # fp32 gradients shaped like the (sharded) parameters
    eval_loss = evaluate(model, wrapped, evaluation, rank, world_size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "rank": rank,
        "peak_rss_bytes": peak,
        "peak_rss_growth_bytes": peak - rss_before,
        "state_bytes": state,
        "grad_bytes_per_step": grad_bytes,
        "allgather_bytes_per_step": gather_bytes,
        "train_s": train_s,
    }
    gathered = [None] * world_size
    dist.all_gather_object(gathered, record)
    result = {
        "row": job["row"],
        "seed": seed,
        "settings": row,
        "world_size": world_size,
        "steps": steps,
        "params": numel,
        "eval_loss": eval_loss,
        "perplexity": math.exp(eval_loss),
        "train_loss": losses,
        "skipped_steps": skipped,
        "dense_fp32_reduce_scatter_bytes_per_step": (world_size - 1) / world_size * 4 * numel,
        "dense_fp32_allreduce_bytes_per_step": dense_allreduce_bytes(numel, world_size),
        "ranks": gathered,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "data": job["info"].get("data", {}),
    }
    del wrapped, model, optimizer
    gc.collect()
    return result


def _grad_bytes(comm_state, scatter) -> float:
    return comm_state.totals()["bytes_sent"] if comm_state is not None else scatter.bytes


def evaluate(model, wrapped, evaluation, rank: int, world_size: int, batch_size: int = 16) -> float:
    """Mean loss over every predicted held-out token (each rank takes an equal share; the sums are all-reduced)."""
    import torch
    import torch.distributed as dist

    ids = torch.tensor(evaluation["input_ids"])
    share = len(ids) // world_size
    mine = ids[rank * share : (rank + 1) * share]
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for start in range(0, share, batch_size):
            chunk = mine[start : start + batch_size]
            loss = wrapped(input_ids=chunk, labels=chunk).loss
            tokens = chunk.shape[0] * (chunk.shape[1] - 1)
            totals += torch.tensor([float(loss) * tokens, tokens], dtype=torch.float64)
    model.train()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def worker(job_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = json.loads(Path(job_path).read_text())
    result = run(job)
    if dist.get_rank() == 0:
        out = Path(job["result_path"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)
        print(f"[{job['row']} seed {job['seed']}] ppl {result['perplexity']:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Launcher and summary
# ----------------------------------------------------------------------------------------------------------------


def launch(job: dict, job_path: Path, timeout: int) -> None:
    from tests.testing_utils import run_torchrun

    job_path.write_text(json.dumps(job, indent=1))
    log = job_path.with_suffix(".log")
    done = run_torchrun(Path(__file__).resolve(), nproc=2, timeout=timeout, env={"GRPO_BENCH_FSDP2_JOB": str(job_path)},
                        cwd=ROOT, log_path=log)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"{job['row']} seed {job['seed']} failed ({done.returncode}); log {log}:\n{done.stdout[-4000:]}"
        )
    for line in done.stdout.splitlines():
        if line.startswith("["):
            print(line, flush=True)


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    base = results.get(BASELINE, {})
    summary = {}
    for name, by_seed in results.items():
        seeds = sorted(by_seed)
        first = by_seed[seeds[0]]
        entry = {
            "seeds": seeds,
            "perplexity": {s: by_seed[s]["perplexity"] for s in seeds},
            "grad_bytes_per_step": statistics.fmean(
                statistics.fmean(r["grad_bytes_per_step"]) for s in seeds for r in by_seed[s]["ranks"]
            ),
            "steady_grad_bytes_per_step": statistics.fmean(
                statistics.fmean(r["grad_bytes_per_step"][DENSE_WARMUP_STEPS:]) for s in seeds for r in by_seed[s]["ranks"]
            ),
            "allgather_bytes_per_step": statistics.fmean(
                statistics.fmean(r["allgather_bytes_per_step"]) for s in seeds for r in by_seed[s]["ranks"]
            ),
            "peak_rss_mb": statistics.fmean(r["peak_rss_bytes"] / 2**20 for s in seeds for r in by_seed[s]["ranks"]),
            "peak_rss_growth_mb": statistics.fmean(
                r["peak_rss_growth_bytes"] / 2**20 for s in seeds for r in by_seed[s]["ranks"]
            ),
            "state_bytes": {k: statistics.fmean(r["state_bytes"][k] for r in first["ranks"]) for k in first["ranks"][0]["state_bytes"]},
            "dense_fp32_reduce_scatter_bytes_per_step": first["dense_fp32_reduce_scatter_bytes_per_step"],
        }  # fmt: skip
        common = [s for s in seeds if s in base]
        if common:
            ratios = [by_seed[s]["perplexity"] / base[s]["perplexity"] for s in common]
            logs = [math.log(r) for r in ratios]
            half = (
                T_975.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
                if len(logs) > 1
                else math.nan
            )
            entry.update(ratio_seeds=common, ppl_ratio=dict(zip(common, ratios)), geomean=math.exp(statistics.fmean(logs)),
                         worst=max(ratios), ci95=[math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)])  # fmt: skip
        summary[name] = entry
    return summary


def markdown(summary: dict) -> str:
    lines = [
        f"| row | seeds | ppl / {BASELINE}: geomean | worst seed | per seed | grad bytes/rank/step (steady) | vs fp32 "
        "reduce-scatter | all-gather bytes/rank/step | peak RSS/rank MB (growth) | params+grads+optim+residual "
        "MB/rank (residual) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, e in summary.items():
        state = e["state_bytes"]
        counted = sum(state.values()) / 2**20
        per_seed = " ".join(f"{e['ppl_ratio'][s]:.4f}" for s in e.get("ratio_seeds", []))
        ratio = e["dense_fp32_reduce_scatter_bytes_per_step"] / e["steady_grad_bytes_per_step"]
        lines.append(
            f"| {name} | {len(e['seeds'])} | {e.get('geomean', math.nan):.4f} | {e.get('worst', math.nan):.4f} | "
            f"{per_seed} | {e['steady_grad_bytes_per_step'] / 1e3:,.1f} kB | {ratio:.2f}x | "
            f"{e['allgather_bytes_per_step'] / 1e3:,.1f} kB | {e['peak_rss_mb']:.0f} ({e['peak_rss_growth_mb']:+.0f}) | "
            f"{counted:.2f} ({state['residuals'] / 2**20:.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output_dir", default="runs/bench_fsdp2", help="Data, per-run JSON files and the report.")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"Comma-separated rows of {', '.join(ROWS)}.")
    parser.add_argument("--seeds", default="0,1,2,3", help="Comma-separated seeds.")
    parser.add_argument("--max_steps", type=int, default=0, help="Optimizer steps (0: the task's; smoke runs).")
    parser.add_argument("--report_only", action="store_true", help="Summarize what is on disk; launch nothing.")
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds before one launch is killed.")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}.")
    if BASELINE not in rows:
        rows.insert(0, BASELINE)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.output_dir)
    results_dir = out / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if not args.report_only:
        info = prepare(TASKS["llama-scratch"], out / "data", 2)
        for seed in seeds:
            for row in rows:
                result_path = results_dir / f"{row}-seed{seed}.json"
                if result_path.exists():
                    continue
                job = {
                    "row": row,
                    "seed": seed,
                    "info": info,
                    "max_steps": args.max_steps,
                    "result_path": str(result_path),
                }
                launch(job, results_dir / f"_job-{row}-seed{seed}.json", args.timeout)
    results: dict[str, dict[int, dict]] = {}
    for path in sorted(results_dir.glob("[!_]*-seed*.json")):
        record = json.loads(path.read_text())
        if record["row"] in rows and record["seed"] in seeds:
            results.setdefault(record["row"], {})[record["seed"]] = record
    summary = summarize({r: results[r] for r in rows if r in results})
    command = "python -m benchmarks.bench_fsdp2 " + " ".join(sys.argv[1:])
    report = (
        f"`{command}` ({time.time() - start:.0f} s, {time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.1f})\n\n"
    )
    report += markdown(summary)
    (out / "results.json").write_text(
        json.dumps({"summary": summary, "command": command, "date": time.strftime("%Y-%m-%d")}, indent=1)
    )
    (out / "report.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    if os.environ.get("GRPO_BENCH_FSDP2_JOB"):
        from tests.testing_utils import end_worker

        worker(os.environ["GRPO_BENCH_FSDP2_JOB"])
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        main()
