"""Soak benchmark: thousands of tiny GRPOTrainer steps under 2-process gloo DDP with compression on, watching for leaks.

    python -m benchmarks.bench_soak --output_dir runs/bench_soak                   # 5000 steps, a few minutes on 2 CPUs
    python -m benchmarks.bench_soak --steps 1000 --output_dir /tmp/soak            # shorter

Hardware: 2 shared CPU cores, no GPU (gloo over loopback). One command: it launches the `torchrun` workers itself.

What it runs: a tiny Llama (hidden 32, 2 layers, vocabulary 128, ~47k parameters) on random tokens, batch 4 x 16
tokens per rank, `grpo_compression="quantize"` with the default bits in `allgather` mode (every tensor of at least
256 entries compressed), importance scaling on, a log every `logging_steps`, a checkpoint every `save_steps` with
`save_total_limit=2` (the GRPO state is written and old checkpoints deleted all along), many epochs over a small
dataset. Every `window` steps each rank records:

- its RSS (`psutil`), after a `gc.collect()`;
- the hook time of every step in the window (`GRPOCommState.totals()["hook_ms"]`, differenced) and the update latency
  of GRPOCallback (end of backward to end of `optimizer.step`): p50 and p99 per window;
- the length of `state.log_history` and its size as JSON, the size of the GRPO state file as written into checkpoints
  (`torch.save` of `GRPOCallback.state_dict()`), and the sizes of the containers that live as long as the trainer
  (the metric window, compression statistics window, cached bucket layouts, residual rows, the compression state's
  bytes, latency buffer).

Verdicts printed at the end (per rank): RSS flat within 5% from the end of the first window to the end; hook p50 of
the last window at most 25% above the first (on shared cores the load of other jobs moves it both ways); the GRPO state and every container of constant size; log_history growing
by one entry of constant size per logging step (the Trainer keeps every log; its size is bounded by
`steps / logging_steps`, and grpo_hf adds a constant number of keys to each).
"""

import gc
import io
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

from tests.testing_utils import run_torchrun  # noqa: E402 - the test helpers, kept out of the wheel


SEQ_LEN = 16
RSS_TOLERANCE = 0.05
LATENCY_TOLERANCE = 0.25


@dataclass
class SoakArguments:
    output_dir: str = field(default="runs/bench_soak", metadata={"help": "Where the results go."})
    steps: int = field(default=5000, metadata={"help": "Optimizer steps."})
    window: int = field(default=250, metadata={"help": "Steps per measurement window."})
    logging_steps: int = field(default=10, metadata={"help": "Trainer logging interval."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint interval (save_total_limit=2)."})
    grpo_comm_mode: str = field(default="allgather", metadata={"help": "allgather or allreduce."})
    timeout: int = field(default=3600, metadata={"help": "Seconds before the torchrun job is killed."})


# ----------------------------------------------------------------------------------------------------------------
# Worker (one per rank, under torchrun)
# ----------------------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def worker(job_path: str) -> None:
    import psutil
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo_hf import GRPOConfig, GRPOTrainer
    from tests.testing_utils import tiny_test_llama

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    process = psutil.Process()

    class Soak(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.windows: list[dict] = []
            self.hook_ms: list[float] = []
            self.update_ms: list[float] = []
            self.last_hook_total = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            comm = self.trainer.grpo_comm_state
            total = comm.totals()["hook_ms"]
            self.hook_ms.append(total - self.last_hook_total)
            self.last_hook_total = total
            latencies = self.trainer.grpo_callback.step_metrics.latencies_ms
            if latencies:
                self.update_ms.append(latencies[-1])
            if state.global_step % job["window"] == 0:
                self.windows.append(self.measure(state))
                self.hook_ms, self.update_ms = [], []

        def measure(self, state) -> dict:
            gc.collect()
            callback, comm = self.trainer.grpo_callback, self.trainer.grpo_comm_state
            buffer = io.BytesIO()
            torch.save(callback.state_dict(), buffer)
            return {
                "step": state.global_step,
                "time": time.perf_counter(),
                "rss_mb": process.memory_info().rss / 2**20,
                "hook_ms_p50": percentile(self.hook_ms, 50),
                "hook_ms_p99": percentile(self.hook_ms, 99),
                "update_ms_p50": percentile(self.update_ms, 50) if self.update_ms else None,
                "update_ms_p99": percentile(self.update_ms, 99) if self.update_ms else None,
                "log_history_entries": len(state.log_history),
                "log_history_bytes": len(json.dumps(state.log_history)),
                "grpo_state_bytes": buffer.getbuffer().nbytes,
                "containers": {
                    "metric_keys": len(callback.metrics),
                    "latency_buffer": len(callback.step_metrics.latencies_ms),
                    "comm_window_keys": len(comm.traffic.window),
                    "bucket_layouts": len(comm.layouts),
                    "residual_rows": comm.residuals.num_rows,
                    "residual_vectors": len(comm.residuals.values),
                    "comm_state_bytes": sum(comm.memory_bytes().values()),
                },
                "python_objects": len(gc.get_objects()),
            }

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (512, SEQ_LEN), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = GRPOConfig(
        output_dir=job["output_dir"],
        use_cpu=True,  # gloo DDP under torchrun
        max_steps=job["steps"],
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=job["logging_steps"],
        save_strategy="steps",
        save_steps=job["save_steps"],
        save_total_limit=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        grpo_compression="quantize",
        grpo_comm_mode=job["grpo_comm_mode"],
        grpo_min_compress_numel=256,
        grpo_lr_scale_warmup_steps=10,
    )
    soak = Soak()
    trainer = GRPOTrainer(
        model=tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN), args=args, train_dataset=dataset
    )
    soak.trainer = trainer
    trainer.add_callback(soak)
    started = time.perf_counter()
    trainer.train()
    result = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "is_ddp": type(trainer.model_wrapped).__name__ == "DistributedDataParallel",
        "train_seconds": time.perf_counter() - started,
        "numel": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "compressed_tensors": len(trainer.grpo_comm_state.residuals.values),
        "nonfinite_steps": trainer.grpo_callback.nonfinite_steps,
        "windows": soak.windows,
    }
    path = Path(job["results_dir"], f"rank{dist.get_rank()}.json")
    path.write_text(json.dumps(result, indent=1))
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def verdicts(result: dict) -> tuple[dict, list[str]]:
    """The soak's figures (first window vs last) and one line per check, `OK` or `FAILED`."""
    first, last = result["windows"][0], result["windows"][-1]
    per_entry = [w["log_history_bytes"] / max(1, w["log_history_entries"]) for w in result["windows"]]
    p50s = [w["hook_ms_p50"] for w in result["windows"]]
    summary = {
        "rss_start_mb": first["rss_mb"],
        "rss_end_mb": last["rss_mb"],
        "rss_ratio": last["rss_mb"] / first["rss_mb"],
        "hook_p50_ratio": last["hook_ms_p50"] / first["hook_ms_p50"],
        "grpo_state_bytes": sorted({w["grpo_state_bytes"] for w in result["windows"]}),
        "containers_constant": all(w["containers"] == last["containers"] for w in result["windows"]),
        "log_entries_per_window": sorted(
            {
                b["log_history_entries"] - a["log_history_entries"]
                for a, b in zip(result["windows"], result["windows"][1:])
            }
        ),
        "log_bytes_per_entry": (min(per_entry), max(per_entry)),
    }
    checks = [
        (abs(summary["rss_ratio"] - 1) <= RSS_TOLERANCE, f"RSS {first['rss_mb']:.1f} -> {last['rss_mb']:.1f} MiB "
         f"({summary['rss_ratio'] - 1:+.2%}; flat within {RSS_TOLERANCE:.0%})"),
        (summary["hook_p50_ratio"] <= 1 + LATENCY_TOLERANCE, f"hook p50 {first['hook_ms_p50']:.2f} -> "
         f"{last['hook_ms_p50']:.2f} ms ({summary['hook_p50_ratio'] - 1:+.1%}; no growth above "
         f"{LATENCY_TOLERANCE:.0%}; range over windows {min(p50s):.2f}-{max(p50s):.2f} ms)"),
        (len(summary["grpo_state_bytes"]) == 1, f"GRPO state file {summary['grpo_state_bytes']} bytes (constant)"),
        (summary["containers_constant"], f"trainer-lifetime containers {last['containers']} (constant)"),
        (len(summary["log_entries_per_window"]) == 1 and summary["log_bytes_per_entry"][1] < 1.1 * summary["log_bytes_per_entry"][0],
         f"log_history +{summary['log_entries_per_window']} entries per window, "
         f"{summary['log_bytes_per_entry'][0]:.0f}-{summary['log_bytes_per_entry'][1]:.0f} bytes each"),
    ]  # fmt: skip
    return summary, [("OK      " if ok else "FAILED  ") + text for ok, text in checks]


def table(result: dict) -> str:
    lines = [
        "| step | RSS MiB | hook p50 ms | hook p99 ms | update p50 ms | update p99 ms | log entries | log kB | "
        "GRPO state B | Python objects |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in result["windows"]:
        lines.append(
            f"| {w['step']} | {w['rss_mb']:.1f} | {w['hook_ms_p50']:.2f} | {w['hook_ms_p99']:.2f} | "
            f"{w['update_ms_p50'] or 0:.2f} | {w['update_ms_p99'] or 0:.2f} | {w['log_history_entries']} | "
            f"{w['log_history_bytes'] / 1e3:.0f} | {w['grpo_state_bytes']} | {w['python_objects']} |"
        )
    return "\n".join(lines)


def main() -> int:
    from transformers import HfArgumentParser

    (soak,) = HfArgumentParser(SoakArguments).parse_args_into_dataclasses()
    if soak.steps < 2 * soak.window:
        raise SystemExit(f"--steps {soak.steps}: use at least two windows (2 x --window {soak.window}).")
    out = Path(soak.output_dir)
    results_dir = out / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    job = {**asdict(soak), "output_dir": str(out / "trainer"), "results_dir": str(results_dir)}
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job, indent=1))
    started = time.perf_counter()
    run = run_torchrun(
        Path(__file__).resolve(),
        nproc=2,
        timeout=soak.timeout,
        env={"GRPO_SOAK_JOB": str(job_path)},
        cwd=ROOT,
        log_path=out / "torchrun.log",
    )
    if run.returncode != 0:
        raise SystemExit(f"torchrun failed ({'timeout' if run.timed_out else run.returncode}):\n{run.stdout[-6000:]}")
    ranks = [json.loads((results_dir / f"rank{r}.json").read_text()) for r in range(2)]
    summaries, lines = [], []
    for result in ranks:
        summary, checks = verdicts(result)
        summaries.append(summary)
        lines += [f"rank {result['rank']}: {check}" for check in checks]
    rank0 = ranks[0]
    header = (
        f"{soak.steps} steps of a {rank0['numel'] / 1e3:.0f}k-parameter tiny Llama under 2-process gloo DDP "
        f"(DDP: {rank0['is_ddp']}), quantize compression ({soak.grpo_comm_mode}, {rank0['compressed_tensors']} "
        f"tensors compressed), a log every {soak.logging_steps} steps, a checkpoint every {soak.save_steps}; "
        f"{rank0['train_seconds']:.0f} s of training; rank 0 per {soak.window}-step window:"
    )
    text = f"{header}\n\n{table(rank0)}\n\n" + "\n".join(lines)
    print(f"{text}\n\n({(time.perf_counter() - started) / 60:.1f} min in all)")
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps({"arguments": asdict(soak), "summaries": summaries, "checks": lines, "ranks": ranks}, indent=1)
    )
    return 0 if all(line.split(": ", 1)[1].startswith("OK") for line in lines) else 1


if __name__ == "__main__":
    if os.environ.get("GRPO_SOAK_JOB"):
        from tests.testing_utils import end_worker

        worker(os.environ["GRPO_SOAK_JOB"])
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        raise SystemExit(main())
