"""What a step costs: the plain Trainer, GRPOTrainer's defaults, torch's fp16 and PowerSGD hooks, on the same DDP runs.

    python -m benchmarks.bench_step_cost --output_dir runs/step_cost                      # tiny Llama and SmolLM2-135M
    python -m benchmarks.bench_step_cost --models tiny-llama --steps 6 --output_dir /tmp/x  # a quick check
    python -m benchmarks.bench_step_cost --models smollm2 --rows trainer,grpo,grpo-sync32,grpo-sync32-overlap \
        --steps 24 --sync_steps 96 --repeats 1 --link_gbit 1,10 --output_dir runs/step_cost_link  # slow links

Every row trains the same model on the same data under 2-process gloo DDP (`torchrun`, one thread per process), one
launch per row and repeat, so that each row's peak memory is its own. The launches go in rounds over the rows
(`--repeats`, 2 by default: trainer, grpo, ..., then trainer, grpo, ... again), so that a slow spell of a shared machine
falls on every row rather than on one:

- `trainer`: the plain `Trainer` (DDP's fp32 all-reduce);
- `grpo`: `GRPOTrainer` with its defaults (8-bit codes with error feedback, block absmax, all-gather at W=2);
- `grpo-none`: GRPOTrainer with compression off (`grpo_compression="none"`): what GRPOTrainer costs besides its codec;
- `fp16`, `powersgd-r4`: the plain Trainer with torch's `fp16_compress_hook` / `powerSGD_hook` (rank 4), registered
  as `benchmarks/suite.py` registers them.

On request only (`--rows`), the sync every H steps of issue 35, best measured on a slow link (`--link_gbit`):

- `grpo-sync32`: GRPOTrainer with `grpo_sync_every=32` (the sync blocks the step it falls on);
- `grpo-sync32-overlap`: the same with `grpo_sync_delay=1`, the sync overlapping the next inner step.

and replica groups (issue 45; `benchmarks/replica_rows.py`), on `2 R` processes (`R` replicas of 2 shards each, the
model FSDP2-sharded before the Trainer), the emulated link on the replicate dimension only:

- `hsdp2`: HSDP, FSDP2's all-reduce of the shards over the 2 replicas at every step;
- `rg2-sync32`, `rg2-sync32-d1`: the sync every 32 steps between the 2 replicas, blocking and overlapping one step.

Models: `tiny-llama` (a 10.8M Llama, hidden 352, 4 layers, vocab 8192, trained from scratch on the stdlib corpus,
batch 16 x 128 tokens) and `smollm2` (SmolLM2-135M, every parameter trained, the suite's `smollm2-full` task).

Per row: the median wall time of an optimizer step over the timed steps of all its launches (after the dense warm-up
of GRPO and PowerSGD's start iteration; each launch's own median is kept too), the peak RSS of each process
(`ru_maxrss`, the largest over ranks and launches), the bytes one rank sends per step (ring model:
DDP's all-reduce, the hook's own count), and the step time **projected** on a real link: measured step + bytes / link
speed, at 1, 10 and 100 Gbit/s (loopback transfers are nearly free, so the measured step is almost all compute; the
projection ignores any overlap of communication with the backward pass). Ratios are to `trainer` of the same model.

`--link_gbit 1,10` measures instead of projecting: every row is launched again per speed under an emulated link
(`GRPO_HF_EMULATED_LINK_GBIT`, see `EmulatedLink` in `benchmarks/emulated_link.py`, which also delays the baselines'
DDP hooks): each collective completes no earlier than its start plus the bytes this
rank sends in it over the link's speed, and what the step does meanwhile overlaps with it. The table then gains a
column per speed: the **measured** mean step time (a mean, not a median: a sync every H steps is one slow step in H),
and the comparison a column per speed: GRPO's measured median step minus the baseline's, with the same bootstrap. The
projections stay, labelled as such.

A second table sets GRPO's projected step against the plain Trainer's and the fp16 hook's: the difference of the
medians, with a 95% interval from a two-level bootstrap (launches drawn with replacement, then each drawn launch's
timed steps), so that "beats" and "loses" are only said when the interval excludes zero. Both tables are printed and
written to `<output_dir>/step_cost.md`, the figures to `<output_dir>/step_cost.json`. `--resume` keeps each launch
whose result exists for the same job and commit, so that a long run can be done in pieces.
"""

import json
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


HERE = Path(__file__).resolve().parent

from benchmarks.emulated_link import LINK_ENV, delayed, delayed_allreduce, install  # noqa: E402
from benchmarks.replica_rows import (  # noqa: E402
    check_replica_run,
    delay_hsdp_all_reduce,
    replica_row,
    replica_step_markdown,
    replicate_bytes_per_step,
    shard_for_row,
)
from benchmarks.revision import commit  # noqa: E402
from benchmarks.suite import POWERSGD_START, _torch_hook_bytes, parse_row, sync_row, torch_hook_trainer  # noqa: E402
from benchmarks.tasks import TASKS, Task, build_model, prepare  # noqa: E402


MODELS = {
    "tiny-llama": Task(
        "cost-tiny-llama", "lm", "tiny-llama", False, max_steps=40, batch_size=16, seq_len=128, learning_rate=1e-3,
        warmup_steps=2, shape={"hidden_size": 352, "layers": 4, "heads": 4, "vocab_size": 8192},
    ),
    "smollm2": TASKS["smollm2-full"],
}  # fmt: skip
ROWS = ("trainer", "grpo", "grpo-none", "fp16", "powersgd-r4")  # the default set
GRPO_ROWS = {  # the GRPOConfig fields of each GRPOTrainer row
    "grpo": {},
    "grpo-none": {"grpo_compression": "none"},
    "grpo-sync32": {"grpo_sync_every": 32},
    "grpo-sync32-overlap": {"grpo_sync_every": 32, "grpo_sync_delay": 1},
}
# Less memory (issue 43): GRPO's default codec with each grpo_optimizer_state preset, and the Trainer's own fused and
# 8-bit AdamW (bitsandbytes), on request. (`grpo-mini` and `grpo-mini8` went with the presets: their results are records.)
GRPO_ROWS.update({f"grpo-{preset}": {"grpo_optimizer_state": preset} for preset in ("factored8",)})
TRAINER_OPTIMS = {"trainer-fused": "adamw_torch_fused", "trainer-bnb8": "adamw_bnb_8bit"}
REPLICA_ROWS = ("hsdp2", "rg2-sync32", "rg2-sync32-d1")  # replica groups (issue 45): 2 replicas × 2 shards
ALL_ROWS = (*ROWS, "grpo-sync32", "grpo-sync32-overlap", *TRAINER_OPTIMS, "grpo-factored8", *REPLICA_ROWS)
LINKS_GBIT = (1, 10, 100)
BOOTSTRAP_DRAWS = 2000
GRPO_WARMUP = 3  # GRPOConfig's 2 dense steps, then the first compressed one (it compiles the codec if needed)


@dataclass
class CostArguments:
    output_dir: str = field(metadata={"help": "Where step_cost.json / step_cost.md (and the tokenized data) go."})
    models: str = field(default="tiny-llama,smollm2", metadata={"help": f"Comma-separated: {', '.join(MODELS)}."})
    rows: str = field(
        default=",".join(ROWS),
        metadata={"help": f"Comma-separated rows: {', '.join(ALL_ROWS)} (default: the first 5)."},
    )
    steps: int = field(default=20, metadata={"help": "Timed optimizer steps per launch (after the untimed ones)."})
    sync_steps: int = field(
        default=0,
        metadata={
            "help": "Timed steps of the grpo-sync32 rows (0: --steps). Their ramp syncs after steps 1, 3, 7, 15 and 31, "
            "so that only syncs from step 63 on are regular (and overlap): e.g. 96."
        },
    )
    repeats: int = field(
        default=2, metadata={"help": "Launches per row, in rounds over the rows; their timed steps are pooled."}
    )
    timeout: int = field(default=3600, metadata={"help": "Seconds before a row's launch is killed."})
    resume: bool = field(
        default=False, metadata={"help": "Keep each launch whose result exists for the same job at the same commit."}
    )
    link_gbit: str = field(
        default="",
        metadata={
            "help": "Comma-separated link speeds in Gbit/s (e.g. 1,10): launch every row again under an emulated link "
            "of each speed and record its measured step time beside the projection. Empty: loopback only."
        },
    )


def _skipped(row: str) -> int:
    """Untimed steps of a row: its dense warm-up (GRPO), PowerSGD's start iteration, one step otherwise."""
    if row.startswith(("grpo", "rg", "hsdp")):
        return GRPO_WARMUP
    if row.startswith("powersgd"):
        return POWERSGD_START + 1
    return 1


# ----------------------------------------------------------------------------------------------------------------
# Worker: one row under torchrun
# ----------------------------------------------------------------------------------------------------------------


def worker(job_path: str) -> None:
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from torch.nn.parallel import DistributedDataParallel
    from transformers import TrainerCallback, TrainingArguments

    from grpo_hf import GRPOConfig, GRPOTrainer
    from grpo_hf.compression.traffic import dense_allreduce_bytes
    from grpo_hf.optim.builder import state_nbytes

    job = json.loads(Path(job_path).read_text())
    task, row, world_size = MODELS[job["model"]], job["row"], int(os.environ["WORLD_SIZE"])
    link, link_gbit = install(), job.get("link_gbit")  # before the trainer builds its communicators
    if (link is None) != (link_gbit is None) or (link is not None and link.gbit != link_gbit):
        raise RuntimeError(f"the job asks for a link of {link_gbit} Gbit/s, {LINK_ENV} for {link and link.gbit}.")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Accelerate takes it over
    replica = replica_row(row, sync_row)  # replica groups: the model sharded before the Trainer
    model = build_model(task, job["info"], seed=0)
    if replica is not None:
        model = shard_for_row(model, replica)
    total_steps = _skipped(row) + job["steps"]
    common = dict(
        output_dir=os.path.join(job["output_dir"], "tmp", row),
        **{**task.training_arguments(world_size), "max_steps": total_steps},
        use_cpu=True,  # gloo DDP on CPU (without it the ranks train alone)
        logging_steps=total_steps,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs = dict(model=model, train_dataset=load_from_disk(job["info"]["train_path"]))
    hook_bytes = {"bytes": 0.0, "seconds": 0.0}
    if replica is not None:
        trainer = GRPOTrainer(args=GRPOConfig(**common, **replica["overrides"]), **kwargs)
        if link is not None and replica["kind"] == "hsdp":  # HSDP's replicate all-reduce behind the link
            delay_hsdp_all_reduce(model, replica["replicas"], link)
    elif row in GRPO_ROWS:
        trainer = GRPOTrainer(args=GRPOConfig(**common, **GRPO_ROWS[row]), **kwargs)
    else:
        kind = parse_row("comm", row) if not row.startswith("trainer") else {"kind": "trainer"}
        optim = {"optim": TRAINER_OPTIMS[row]} if row in TRAINER_OPTIMS else {}
        trainer = torch_hook_trainer(kind, TrainingArguments(**common, **optim), world_size, hook_bytes, **kwargs)
        if link is not None and trainer.comm_hook is not None:  # torch's fp16 / PowerSGD hook behind the link
            trainer.comm_hook = delayed(
                trainer.comm_hook,
                lambda state, bucket: _torch_hook_bytes(kind["kind"], state, bucket, world_size),
                link,
            )
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    comm_state = getattr(trainer, "grpo_comm_state", None)
    steps = []

    dense = row in ("trainer", "grpo-none", *TRAINER_OPTIMS, "hsdp2")  # DDP's (HSDP's) own fp32 all-reduce
    dense_bytes = dense_allreduce_bytes(numel, world_size)
    if replica is not None:  # bytes between replicas: HSDP's all-reduce of the local shards
        dense_bytes = replicate_bytes_per_step(model, replica["replicas"])

    def sent() -> float:
        if comm_state is not None:
            return comm_state.totals()["bytes_sent"]
        if not dense:
            return hook_bytes["bytes"]
        return dense_bytes * len(steps)

    class StepRecorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start, self.before = time.perf_counter(), sent()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            self.optimizer_s = time.perf_counter() - self.optimizer_start

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step_s": time.perf_counter() - self.start, "bytes": sent() - self.before,
                          "optimizer_s": self.optimizer_s})  # fmt: skip

    class LinkUnderDDP(TrainerCallback):
        """DDP's own all-reduce behind the emulated link: registered on the DDP model before the first backward."""

        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_begin(self, args, state, control, **kw):
            if self.trainer is not None:  # the DDP model exists from the first step on
                self.trainer.model_wrapped.register_comm_hook(None, delayed_allreduce(world_size, link))
                self.trainer = None

    trainer.add_callback(StepRecorder())
    if link is not None and dense and replica is None:
        trainer.add_callback(LinkUnderDDP(trainer))
    trainer.train()
    if replica is not None:
        check_replica_run(trainer, replica)
    else:
        assert isinstance(trainer.model_wrapped, DistributedDataParallel), "the run did not use DDP"
    if dense:  # the plain all-reduce: every step sends the dense fp32 gradients
        for step in steps:
            step["bytes"] = dense_bytes
    peak = [None] * world_size
    dist.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB -> MiB (Linux)
    if dist.get_rank() == 0:
        timed = steps[_skipped(row) :]
        result = {
            "job": job,
            "model": job["model"],
            "row": row,
            "world_size": world_size,
            "trainable_params": numel,
            "steps": len(timed),
            "median_step_s": statistics.median(s["step_s"] for s in timed),
            "mean_step_s": statistics.fmean(s["step_s"] for s in timed),
            "bytes_per_step": statistics.median(s["bytes"] for s in timed),
            "peak_rss_mib_by_rank": peak,
            "optimizer_state_bytes": sum(state_nbytes(trainer.optimizer).values()),
            "median_optimizer_s": statistics.median(s["optimizer_s"] for s in timed),
            "per_step": steps,
        }
        if link_gbit is not None:
            result["link_gbit"] = link_gbit
        if comm_state is not None:
            result["grpo_codec"] = "compiled" if comm_state.kernels.compiled else "eager"
            result["grpo_totals"] = comm_state.totals()
            result["grpo_memory_bytes"] = comm_state.memory_bytes()
            result["grpo_compile_s"] = getattr(comm_state, "compile_seconds", 0.0)  # (the sync's kernels: eager)
        Path(job["result_path"]).write_text(json.dumps(result, indent=1))
    trainer.accelerator.free_memory()  # then destroy the group: gloo runs otherwise abort at exit now and then
    del trainer
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Launcher and table
# ----------------------------------------------------------------------------------------------------------------


def link_speeds(text: str) -> list[float]:
    """`--link_gbit`: `"1,10"` -> `[1.0, 10.0]`; empty -> `[]`."""
    speeds = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            speed = float(item)
        except ValueError:
            speed = 0.0
        if not speed > 0 or speed in speeds:
            raise SystemExit(f"--link_gbit {text!r}: use distinct speeds in Gbit/s above 0, e.g. 1,10.")
        speeds.append(speed)
    return speeds


def check_rows(rows: list[str]) -> None:
    """Refuse an unknown row before anything runs."""
    unknown = [row for row in rows if row not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"unknown row {unknown[0]!r}: use {', '.join(ALL_ROWS)}.")


def _link_name(gbit: float | None) -> str:
    return "" if gbit is None else f"-link{gbit:g}"


def run_rows(args: CostArguments) -> list[dict]:
    """
    Every launch, in rounds (per repeat: each link, loopback first, then each row), and the pooled rows; a row measured
    under emulated links holds them in `measured_link` (`{"<gbit>": pooled launches}`).
    """
    from tests.testing_utils import run_torchrun

    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: use 1 or more.")
    out = Path(args.output_dir)
    rows, links = args.rows.split(","), [None, *link_speeds(args.link_gbit)]
    check_rows(rows)
    results, revision = [], commit()
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}: use {', '.join(MODELS)}.")
        info = prepare(MODELS[model], out / "data", world_size=2)
        launches = {(row, gbit): [] for row in rows for gbit in links}
        for repeat in range(args.repeats):
            for gbit in links:
                for row in rows:
                    name = f"{model}-{row}-{repeat}{_link_name(gbit)}"
                    job_path, result_path = out / f"{name}.job.json", out / f"{name}.json"
                    steps = args.sync_steps if row.startswith(("grpo-sync", "rg")) and args.sync_steps else args.steps
                    job = {"model": model, "row": row, "steps": steps, "info": info, "output_dir": str(out),
                           "result_path": str(result_path), "commit": revision}  # fmt: skip
                    if gbit is not None:
                        job["link_gbit"] = gbit
                    label = f"{model:<10} {row:<20} {'loopback' if gbit is None else f'{gbit:g} Gbit/s':<12}"
                    if args.resume and result_path.exists():
                        kept = json.loads(result_path.read_text())
                        if kept.get("job") == job and revision is not None and not revision.endswith("+"):
                            launches[row, gbit].append(kept)
                            print(f"{label} {kept['median_step_s']:.3f} s/step (kept)", flush=True)
                            continue
                    result_path.unlink(missing_ok=True)
                    job_path.write_text(json.dumps(job))
                    env = {"GRPO_COST_JOB": str(job_path), LINK_ENV: "" if gbit is None else str(gbit)}
                    replica = replica_row(row, sync_row)
                    nproc = 2 * replica["replicas"] if replica else 2  # replica groups: 2 shards per replica
                    run = run_torchrun(HERE / "bench_step_cost.py", nproc=nproc, timeout=args.timeout, env=env,
                                       log_path=job_path.with_suffix(".log"))  # fmt: skip
                    if run.returncode != 0 or not result_path.exists():
                        raise SystemExit(
                            f"{name} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
                        )
                    launches[row, gbit].append(json.loads(result_path.read_text()))
                    print(f"{label} {launches[row, gbit][-1]['median_step_s']:.3f} s/step", flush=True)
        for row in rows:
            result = pooled(launches[row, None])
            if len(links) > 1:
                result["measured_link"] = {
                    f"{gbit:g}": _link_figures(pooled(launches[row, gbit])) for gbit in links[1:]
                }
            results.append(result)
    return results


def _link_figures(row: dict) -> dict:
    """What a row keeps of its launches under one emulated link."""
    kept = ("launches", "median_step_s", "mean_step_s", "median_step_s_by_launch", "bytes_per_step",
            "peak_rss_mib_by_rank", "per_step")  # fmt: skip
    return {key: row[key] for key in kept}


def pooled(launches: list[dict]) -> dict:
    """One row from its launches: timed steps pooled for the median and mean, the largest peak RSS of each rank."""
    timed = [s for launch in launches for s in launch["per_step"][_skipped(launch["row"]) :]]
    return {
        **{key: value for key, value in launches[0].items() if key != "job"},  # (its paths are this machine's)
        "launches": len(launches),
        "median_step_s": statistics.median(s["step_s"] for s in timed),
        "mean_step_s": statistics.fmean(s["step_s"] for s in timed),
        "median_step_s_by_launch": [launch["median_step_s"] for launch in launches],
        "bytes_per_step": statistics.median(s["bytes"] for s in timed),
        "median_optimizer_s": statistics.median(s["optimizer_s"] for s in timed)
        if "optimizer_s" in timed[0]
        else None,
        "peak_rss_mib_by_rank": [
            max(ranks) for ranks in zip(*(launch["peak_rss_mib_by_rank"] for launch in launches))
        ],
        "peak_rss_mib_by_launch": [max(launch["peak_rss_mib_by_rank"]) for launch in launches],
        "per_step": [launch["per_step"] for launch in launches],
    }


def table(results: list[dict]) -> str:
    """
    The markdown table of the rows, with ratios to the plain Trainer of the same model; the step projected on each
    link of `LINKS_GBIT`, then, where `--link_gbit` measured it, the mean step under each emulated link.
    """
    header = ["model", "row", "params", "step s", "launches' step s", "× trainer", "peak RSS MiB", "× trainer",
              "MB sent/step"]  # fmt: skip
    header += [f"projected s @ {g} Gbit/s" for g in LINKS_GBIT]
    measured = sorted({gbit for r in results for gbit in r.get("measured_link", {})}, key=float)
    header += [f"measured mean s @ {gbit} Gbit/s" for gbit in measured]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    plain = {r["model"]: r for r in results if r["row"] == "trainer"}
    for r in results:
        base = plain.get(r["model"])
        rss = max(r["peak_rss_mib_by_rank"])
        step_ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}" if base else "-"
        rss_ratio = f"{rss / max(base['peak_rss_mib_by_rank']):.2f}" if base else "-"
        projected = [f"{r['median_step_s'] + r['bytes_per_step'] * 8 / (g * 1e9):.3f}" for g in LINKS_GBIT]
        by_launch = ", ".join(f"{s:.2f}" for s in r.get("median_step_s_by_launch", [r["median_step_s"]]))
        cells = [r["model"], r["row"], f"{r['trainable_params'] / 1e6:.1f}M", f"{r['median_step_s']:.3f}", by_launch,
                 step_ratio, f"{rss:.0f}", rss_ratio, f"{r['bytes_per_step'] / 1e6:.2f}", *projected]  # fmt: skip
        links = r.get("measured_link", {})
        cells += [f"{links[gbit]['mean_step_s']:.3f}" if gbit in links else "–" for gbit in measured]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(results: list[dict]) -> str:
    """
    Less memory (issue 43): per row, the step, the optimizer's own step, the peak RSS per process and the optimizer's
    state, each against the plain Trainer (AdamW) of the same model, and the bytes sent.
    """
    lines = [
        "| model | row | step s | × trainer | optimizer step ms | × trainer | peak RSS MiB per process | × trainer | "
        "optimizer state MB | × trainer | MB sent/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = {r["model"]: r for r in results if r["row"] == "trainer"}
    for r in results:
        base = plain[r["model"]]
        rss, base_rss = max(r["peak_rss_mib_by_rank"]), max(base["peak_rss_mib_by_rank"])
        optimizer_s, base_optimizer_s = r.get("median_optimizer_s"), base.get("median_optimizer_s")
        state, base_state = r.get("optimizer_state_bytes"), base.get("optimizer_state_bytes")
        cells = [r["model"], f"`{r['row']}`", f"{r['median_step_s']:.3f}", f"{r['median_step_s'] / base['median_step_s']:.2f}",
                 f"{optimizer_s * 1e3:.0f}" if optimizer_s else "–",
                 f"{optimizer_s / base_optimizer_s:.2f}" if optimizer_s and base_optimizer_s else "–",
                 f"{rss:.0f}", f"{rss / base_rss:.2f}",
                 f"{state / 1e6:.0f}" if state is not None else "–",
                 f"{state / base_state:.3f}" if state is not None and base_state else "–",
                 f"{r['bytes_per_step'] / 1e6:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _timed_mean(row: dict, key: str) -> float:
    """The mean of `key` (`step_s` or `bytes`) over a pooled row's timed steps: a sync every H steps is one step in H."""
    return statistics.fmean(s[key] for steps in row["per_step"] for s in steps[_skipped(row["row"]) :])


def link_choice(results: list[dict]) -> str:
    """
    Which setting for which link: each row's mean step on loopback (almost all compute) plus its mean bytes per step
    over 1, 10 and 100 Gbit/s (a projection: no overlap), the fastest in bold; then, where `--link_gbit` measured it,
    the mean step under the emulated link and its ratio to the row's own loopback step.
    """
    measured = sorted({gbit for r in results for gbit in r.get("measured_link", {})}, key=float)
    header = ["model", "row", "step s (loopback)", "MB sent/step (mean)"]
    header += [f"projected s @ {g} Gbit/s" for g in LINKS_GBIT]
    header += [f"measured s @ {g} Gbit/s (× loopback)" for g in measured]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model and "per_step" in r]
        projected = {
            r["row"]: [_timed_mean(r, "step_s") + _timed_mean(r, "bytes") * 8 / (g * 1e9) for g in LINKS_GBIT]
            for r in rows
        }
        fastest = [min(projected, key=lambda name: projected[name][i]) for i in range(len(LINKS_GBIT))]
        for r in rows:
            step = _timed_mean(r, "step_s")
            cells = [model, f"`{r['row']}`", f"{step:.3f}", f"{_timed_mean(r, 'bytes') / 1e6:.2f}"]
            cells += [
                f"**{s:.3f}**" if fastest[i] == r["row"] else f"{s:.3f}" for i, s in enumerate(projected[r["row"]])
            ]
            for gbit in measured:
                link = r.get("measured_link", {}).get(gbit)
                cells.append(f"{link['mean_step_s']:.3f} ({link['mean_step_s'] / step:.2f}×)" if link else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _timed_steps(row: dict) -> list[list[float]]:
    """A pooled row's timed step times, one list per launch."""
    return [[s["step_s"] for s in steps[_skipped(row["row"]) :]] for steps in row["per_step"]]


def _resampled_medians(row: dict, rng: random.Random, draws: int) -> list[float]:
    """Medians of the row's step times over `draws` two-level bootstrap samples: launches, then steps in each."""
    launches, medians = _timed_steps(row), []
    for _ in range(draws):
        sample = []
        for steps in rng.choices(launches, k=len(launches)):
            sample += rng.choices(steps, k=len(steps))
        medians.append(statistics.median(sample))
    return medians


def comparisons(results: list[dict], baselines=("trainer", "fp16"), draws: int = BOOTSTRAP_DRAWS) -> str:
    """
    The markdown table of GRPO's projected step minus each baseline's (ms, on the measured step and at each link
    speed), with 95% bootstrap intervals and what they say: `beats` (the interval is below zero), `loses` (above) or
    `tie`; then, where `--link_gbit` measured both rows under an emulated link, the difference of their measured
    steps there (medians, the same bootstrap). Seeded: the same results give the same table.
    """
    header = ["model", "GRPO against", "measured step"] + [f"@ {g} Gbit/s" for g in LINKS_GBIT]
    measured = sorted({gbit for r in results if r["row"] == "grpo" for gbit in r.get("measured_link", {})}, key=float)
    header += [f"measured @ {gbit} Gbit/s" for gbit in measured]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key = {(r["model"], r["row"]): r for r in results}
    for model in dict.fromkeys(r["model"] for r in results):
        grpo = by_key.get((model, "grpo"))
        for name in baselines:
            base = by_key.get((model, name))
            if grpo is None or base is None or "per_step" not in grpo or "per_step" not in base:
                continue
            rng = random.Random(0)
            ours, theirs = _resampled_medians(grpo, rng, draws), _resampled_medians(base, rng, draws)
            spread = sorted(a - b for a, b in zip(ours, theirs))  # the measured steps; a link adds a constant
            cells = [model, name]
            for gbit in (None, *LINKS_GBIT):
                extra = 0.0 if gbit is None else (grpo["bytes_per_step"] - base["bytes_per_step"]) * 8 / (gbit * 1e9)
                point = grpo["median_step_s"] - base["median_step_s"] + extra
                low, high = spread[int(0.025 * draws)] + extra, spread[int(0.975 * draws) - 1] + extra
                cells.append(_difference(point, low, high))
            for gbit in measured:
                ours, theirs = grpo.get("measured_link", {}).get(gbit), base.get("measured_link", {}).get(gbit)
                if ours is None or theirs is None:
                    cells.append("–")
                    continue
                ours, theirs = {**ours, "row": grpo["row"]}, {**theirs, "row": base["row"]}  # (for the untimed steps)
                rng = random.Random(0)
                spread = sorted(a - b for a, b in zip(_resampled_medians(ours, rng, draws),
                                                      _resampled_medians(theirs, rng, draws)))  # fmt: skip
                point = ours["median_step_s"] - theirs["median_step_s"]
                cells.append(_difference(point, spread[int(0.025 * draws)], spread[int(0.975 * draws) - 1]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _difference(point: float, low: float, high: float) -> str:
    """A difference of step times in ms, its interval and what it says (`beats`, `loses` or `tie`)."""
    verdict = "beats" if high < 0 else "loses" if low > 0 else "tie"
    return f"{1e3 * point:+.0f} ms [{1e3 * low:+.0f}, {1e3 * high:+.0f}] {verdict}"


def report(results: list[dict]) -> str:
    """Both tables: the rows ([`table`]), then GRPO against the baselines ([`comparisons`])."""
    caption = "GRPO's step minus the baseline's, with a 95% bootstrap interval (launches, then steps):"
    text = f"{table(results)}\n\n{caption}\n\n{comparisons(results)}"
    replicas = replica_step_markdown(results)
    return text + (f"\n\nReplica groups against HSDP on the same processes:\n\n{replicas}" if replicas else "")


def main():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(CostArguments).parse_args_into_dataclasses()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = run_rows(args)
    load = os.getloadavg()
    note = (
        f"2-process gloo DDP (replica-group rows: 2 replicas x 2 shards, 4 processes), one thread per process, "
        f"{args.repeats} launches per row in rounds, median of their "
        f"{args.steps * args.repeats} timed steps"
        + (f" ({args.sync_steps * args.repeats} for the sync rows)" if args.sync_steps else "")
        + "; projected = measured "
        f"step + bytes sent / link speed (a projection, not a measurement); load average at the end {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f}"
    )
    speeds = link_speeds(args.link_gbit)
    if speeds:
        note += (
            f"; measured mean s = the mean of the timed steps of {args.repeats} more launches per row and speed under an "
            "emulated link (each collective completes no earlier than its start + bytes sent / link speed)"
        )
    choice = "Which setting for which link (mean step and mean bytes: a sync every H steps is one slow step in H):"
    text = f"{note}\n\n{report(results)}\n\n{choice}\n\n{link_choice(results)}\n"
    print("\n" + text)
    (out / "step_cost.md").write_text(text)
    summary = {"command": "python -m benchmarks.bench_step_cost " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
               "note": note, "links_gbit": list(LINKS_GBIT), "load_average": list(load), "rows": results}  # fmt: skip
    if speeds:
        summary["measured_links_gbit"] = speeds
    (out / "step_cost.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if os.environ.get("GRPO_COST_JOB"):
        from tests.testing_utils import end_worker

        worker(os.environ["GRPO_COST_JOB"])
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        main()
