"""The benchmark suite: every setting that becomes a default is measured on seven tasks and several seeds.

    python -m benchmarks.suite comm --output_dir runs/suite_comm          # compression under 2-process DDP (gloo)
    python -m benchmarks.suite comm --quick                               # 2 seeds, the from-scratch tasks
    python -m benchmarks.suite lr --output_dir runs/suite_lr              # per-group learning rates, one process
    python -m benchmarks.suite comm --tasks llama-scratch --rows dense,q4 --seeds 0 --output_dir /tmp/x

Tasks: see `benchmarks/tasks.py` (three tiny models trained from scratch, one with untied embeddings; LoRA and full
fine-tunes of SmolLM2-135M; a LoRA classification fine-tune of MiniLM; a 120-step full fine-tune of a pre-trained tiny
Llama with untied embeddings). Rows are compared with a baseline on the same seeds: `dense` (GRPOTrainer
with compression off) in the `comm` suite, `trainer` (the plain Trainer at the task's learning rate) in the `lr`
suite. Per task and row: the metric's ratio to the baseline per seed (perplexity; accuracy is a difference in
points), their geometric mean, the worst seed and a 95% t-interval over seeds; bytes per rank against dense fp32 over
the whole run and in the steady state (after the dense warm-up). Runs are resumable: a row whose result file exists
is skipped. The results go to `<output_dir>/results.json` and `<output_dir>/report.md`.

Hardware notes: on 2 shared CPU cores (gloo over loopback) bytes and quality are the meaningful outputs; step times
are CPU times of the machine.
"""

import gc
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

from benchmarks import lr_grid, peers  # noqa: E402
from benchmarks.replica_rows import (  # noqa: E402
    check_replica_run,
    peak_rss_bytes,
    replica_markdown,
    replica_row,
    replicate_bytes_per_step,
    shard_for_row,
)
from benchmarks.revision import commit  # noqa: E402
from benchmarks.tasks import TASKS, Task, build_model, compute_accuracy, prepare, site_order  # noqa: E402


_ALLGATHER = {"grpo_comm_mode": "allgather"}
# (The rows with gradient scales, `q8s`, `q4s`, `q2s`, `q4s-m1k`, `q4s-ar` and `q2s-ar`, were measured worse than the
# rows without and removed with `grpo_scale_gradients`; their result files stay in benchmarks/results/ as records.)
COMM_ROWS = {
    "dense": {"grpo_compression": "none"},
    "defaults": {},  # GRPOConfig's defaults as they are (the mode follows the world size)
    "q4": {"grpo_compression": "quantize", "grpo_bits": "4", **_ALLGATHER},
    "q8": {"grpo_compression": "quantize", "grpo_bits": "8", **_ALLGATHER},
    "q2": {"grpo_compression": "quantize", "grpo_bits": "2", **_ALLGATHER},  # 0.1's
    "q4-ar": {"grpo_compression": "quantize", "grpo_bits": "4", "grpo_comm_mode": "allreduce"},
    "q2-ar": {"grpo_compression": "quantize", "grpo_bits": "2", "grpo_comm_mode": "allreduce"},
    "article": {  # top 15% + 4/8 bits by module type, as the article describes it
        "grpo_compression": "sparse+quantize",
        "grpo_density": 0.15,
        "grpo_bits": "auto",
    },
}
DEFAULT_COMM_ROWS = "dense,q8,q4,fp16"  # q8: GRPOConfig's defaults at W=2
# The sync every H steps (grpo_sync_every), named by pattern: `sync<H>` (GRPOConfig's defaults with that interval),
# `sync<H>-q<bits>` (grpo_sync_bits 4, 8, 16 or 2: codes with error feedback; `-qt`: grpo_sync_bits "ternary") or
# `sync<H>-fp32`, then optionally `-f<F>` (F fragments), `-noramp`, `-lr<outer lr>`, `-m<momentum>`, `-bf16` (θ_global
# in bf16), `-momboth` / `-momsecond` (the inner AdamW moments averaged at a sync: grpo_sync_moments), `-d<tau>` /
# `-mix<alpha>` (the overlap: grpo_sync_delay, grpo_sync_mix); `localsgd-h<H>`: plain averaging every H steps (outer
# lr 1, momentum 0, fp32, no ramp: accelerate's LocalSGD); `outer-h<H>`: DDP's fp32 all-reduce every step plus the
# outer step every H steps (the control: no bytes saved). Other settings: `grpo:grpo_sync_every=16;...`. Last, optionally,
# the sparse code (SparseLoCo): `-k<k>of<C>` (the top k of every C entries: grpo_sync_density k / C, grpo_sync_chunk C)
# and `-beta<β>` (grpo_sync_error_decay), e.g. `sync32-k64of4096-beta0.95`.
SYNC_ROW = re.compile(
    r"sync(?P<every>\d+)(?:-q(?P<bits>4|8|16|2|t)|(?P<fp32>-fp32))?(?:-f(?P<fragments>\d+))?(?P<noramp>-noramp)?"
    r"(?:-lr(?P<lr>[0-9.]+))?(?:-m(?P<momentum>[0-9.]+))?(?P<bf16>-bf16)?(?:-mom(?P<moments>both|second))?"
    r"(?:-d(?P<delay>\d+))?(?:-mix(?P<mix>[0-9.]+))?"
    r"(?:-k(?P<topk>\d+)of(?P<chunk>\d+))?(?:-beta(?P<decay>[0-9.]+))?"
)


def sync_row(name: str) -> dict | None:
    """The GRPOConfig overrides of a named row of the sync every H steps (see `SYNC_ROW`), `None` for another row."""
    match = SYNC_ROW.fullmatch(name)
    if match and not (match["bits"] or match["fp32"]):  # `sync<H>` alone: GRPOConfig's defaults but the interval
        row = {"grpo_sync_every": int(match["every"])}
        if match["fragments"]:
            row["grpo_sync_fragments"] = int(match["fragments"])
        if match["noramp"]:
            row["grpo_sync_ramp"] = False
    elif match:
        row = {"grpo_sync_every": int(match["every"]), "grpo_sync_fragments": int(match["fragments"] or 1),
               "grpo_sync_ramp": not match["noramp"]}  # fmt: skip
        if match["bits"]:
            bits = "ternary" if match["bits"] == "t" else match["bits"]
            row.update(grpo_compression="quantize", grpo_sync_bits=bits)
        else:
            row.update(grpo_compression="none")
    if match:
        if match["lr"]:
            row["grpo_sync_outer_lr"] = float(match["lr"])
        if match["momentum"]:
            row["grpo_sync_outer_momentum"] = float(match["momentum"])
        if match["bf16"]:
            row["grpo_sync_global_dtype"] = "bfloat16"
        if match["moments"]:
            row["grpo_sync_moments"] = match["moments"]
        if match["delay"]:
            row["grpo_sync_delay"] = int(match["delay"])
        if match["mix"]:
            row["grpo_sync_mix"] = float(match["mix"])
        if match["topk"]:
            row["grpo_sync_density"] = int(match["topk"]) / int(match["chunk"])
            row["grpo_sync_chunk"] = int(match["chunk"])
        if match["decay"]:
            row["grpo_sync_error_decay"] = float(match["decay"])
        return row
    match = re.fullmatch(r"localsgd-h(\d+)", name)
    if match:
        return {"grpo_sync_every": int(match[1]), "grpo_sync_outer_lr": 1.0, "grpo_sync_outer_momentum": 0.0,
                "grpo_compression": "none", "grpo_sync_ramp": False}  # fmt: skip
    match = re.fullmatch(r"outer-h(\d+)", name)
    if match:
        return {"grpo_sync_every": int(match[1]), "grpo_sync_outer_only": True, "grpo_compression": "none"}
    return None


_STATIC = {"grpo_importance": False}
LR_ROWS = {  # GRPOTrainer settings measured in the lr suite (one process: no compression)
    "grpo": {},  # GRPOConfig's defaults
    "grpo-article": {"grpo_importance": True, "grpo_importance_score": "article", "grpo_lr_ratios": None},
    "grpo-coherence": {"grpo_importance": True, "grpo_importance_score": "coherence", "grpo_lr_ratios": None},
    "grpo-coherence-wide": {
        "grpo_importance": True, "grpo_importance_score": "coherence", "grpo_lr_scale_min": 0.5,
        "grpo_lr_scale_max": 2.0, "grpo_lr_ratios": None,
    },
    "grpo-off": {**_STATIC, "grpo_lr_ratios": None},
    "grpo-lora-b2": {**_STATIC, "grpo_lr_ratios": {"*lora_B": 2}},
    "grpo-lora-b4": {**_STATIC, "grpo_lr_ratios": {"*lora_B": 4}},
    "grpo-lora-b4a4": {**_STATIC, "grpo_lr_ratios": {"*lora_B": 4, "*lora_A": 0.25}},  # LoRA+ ratio 16 around lr
    "grpo-lora-b8a2": {**_STATIC, "grpo_lr_ratios": {"*lora_B": 8, "*lora_A": 0.5}},
    "grpo-norms": {**_STATIC, "grpo_lr_ratios": {"norms": 0.63}},  # the article: norm layers get ~37% less
    "grpo-emb2": {**_STATIC, "grpo_lr_ratios": {"embeddings": 2}},
    "grpo-emb0.5": {**_STATIC, "grpo_lr_ratios": {"embeddings": 0.5}},
}  # fmt: skip
DEFAULT_LR_ROWS = "trainer,trainer-lr0.5,trainer-lr2,loraplus-16,loraplus-4,grpo"
# The memory suite (one process): the Trainer's own optimizers (`optim=`), Adam-mini's package (`optimizers=`) and
# GRPOTrainer's `grpo_optimizer_state` presets; `adamw` (the Trainer's default) is the baseline.
MEMORY_ROWS = {
    "adamw": {"kind": "optim", "optim": "adamw_torch"},
    "adamw-fused": {"kind": "optim", "optim": "adamw_torch_fused"},
    "adamw-bnb8": {"kind": "optim", "optim": "adamw_bnb_8bit"},
    "adamw-ao8": {"kind": "optim", "optim": "adamw_torch_8bit"},
    "adamw-ao4": {"kind": "optim", "optim": "adamw_torch_4bit"},
    "adafactor": {"kind": "optim", "optim": "adafactor"},
    "adam-mini": {"kind": "adam-mini"},
}
DEFAULT_MEMORY_ROWS = "adamw,adamw-bnb8,adafactor,adam-mini,factored8"
POWERSGD_START = 10  # start_powerSGD_iter: torch's docs and our earlier measurements


@dataclass
class SuiteArguments:
    suite: str = field(
        metadata={
            "help": "'comm' (compression under DDP), 'lr' (per-group learning rates) or 'memory' (optimizer state: "
            "the Trainer's own low-memory optimizers against grpo_optimizer_state, one process).",
            "choices": ["comm", "lr", "memory"],
        }
    )
    output_dir: str = field(
        default="", metadata={"help": "Data, per-run JSON and the report (default runs/suite_<suite>)."}
    )
    tasks: str = field(default="", metadata={"help": f"Comma-separated tasks (default: all of {', '.join(TASKS)})."})
    rows: str = field(
        default="",
        metadata={
            "help": f"Comma-separated rows. comm: {', '.join(COMM_ROWS)}, fp16, powersgd-r<rank>, sync<H>-q<bits>, "
            "sync<H>-fp32 (suffixes -f<F>, -noramp, -lr<x>, -m<x>, -bf16, -momboth, -momsecond, -d<tau>, -mix<alpha>), "
            "localsgd-h<H>, outer-h<H>, hsdp<R> and rg<R>-<sync row> (replica groups, benchmarks/replica_rows.py), the "
            "peers running their own code (benchmarks/peers.py: torchft-diloco-h<H> with -f<F>, -lr<x>, -m<x>, -d<tau>, "
            "-mix<alpha>; accelerate-localsgd-h<H>), or "
            "'grpo:field=value;...' (GRPOConfig fields, e.g. grpo:grpo_bits=4;grpo_min_compress_numel=1024). lr: trainer, "
            f"trainer-lr<factor>, loraplus-<ratio>, {', '.join(LR_ROWS)}, grpo:field=value;.... "
            f"memory: {', '.join(MEMORY_ROWS)}, a grpo_optimizer_state value, grpo:field=value;.... "
            f"Default comm: {DEFAULT_COMM_ROWS}; lr: {DEFAULT_LR_ROWS}; memory: {DEFAULT_MEMORY_ROWS}."
        },
    )
    seeds: str = field(default="0,1,2,3", metadata={"help": "Comma-separated seeds."})
    quick: bool = field(default=False, metadata={"help": "2 seeds and the two from-scratch tasks only."})
    world_size: int = field(default=2, metadata={"help": "Processes of the comm suite's DDP runs."})
    baseline: str = field(
        default="",
        metadata={
            "help": "The row others are compared with (default: comm dense, lr trainer, memory adamw; hsdp<R> "
            "for replica groups)."
        },
    )
    max_steps: int = field(
        default=0, metadata={"help": "Optimizer steps of every run (0: each task's own; smoke runs)."}
    )
    scaling_world_sizes: str = field(
        default="2,4,8",
        metadata={"help": "comm: world sizes of the short bytes-only runs on llama-scratch ('' to skip)."},
    )
    eval_points: int = field(
        default=4,
        metadata={"help": "lr suite: evaluations along each run (for the steps a row needs to reach the baseline)."},
    )
    lrs: int = field(
        default=0,
        metadata={
            "help": "Learning-rate sweep: the points of a x2 grid centred on each task's learning rate (at least 5; "
            "0: every row at the task's learning rate). The first of --seeds sweeps every row over the grid, which is "
            "extended past an edge until the row's best is inside it; the other seeds run at each row's best. "
            "Rows are then compared best against best (see benchmarks/lr_grid.py)."
        },
    )
    learning_rate: float = field(
        default=0.0,
        metadata={
            "help": "Sweep: the grid's centre instead of the task's learning rate (e.g. dense's best, to screen rows "
            "there with --lrs 1 --max_lrs 1)."
        },
    )
    max_lrs: int = field(
        default=9, metadata={"help": "Sweep: the most learning rates one row may reach by extending its grid."}
    )
    report_only: bool = field(
        default=False,
        metadata={"help": "Summarize the results already on disk; launch nothing (missing seeds are left out)."},
    )
    timeout: int = field(default=14400, metadata={"help": "Seconds before one launch (a task and a seed) is killed."})
    threads: int = field(
        default=2,
        metadata={
            "help": "Intra-op threads of a one-process run (lr and memory suites; DDP runs use one per process). "
            "Results can differ in the last bits between thread counts: compare rows run with the same."
        },
    )


# ----------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------


def parse_row(suite: str, name: str) -> dict:
    """A row name -> `{"name", "kind", ...}`: what trains it and with which settings."""
    if name.startswith("grpo:"):
        overrides = {}
        for item in filter(None, name[5:].split(";")):
            key, _, value = item.partition("=")
            overrides[key] = value
        return {"name": name, "kind": "grpo", "overrides": overrides}
    if suite == "memory":
        from grpo_hf.optim import OPTIMIZER_STATE_CHOICES

        if name in MEMORY_ROWS:
            return {"name": name, **MEMORY_ROWS[name]}
        if name in OPTIMIZER_STATE_CHOICES:
            return {"name": name, "kind": "grpo", "overrides": {"grpo_optimizer_state": name}}
    elif suite == "comm":
        if name in COMM_ROWS:
            return {"name": name, "kind": "grpo", "overrides": dict(COMM_ROWS[name])}
        if sync_row(name) is not None:
            return {"name": name, "kind": "grpo", "overrides": sync_row(name)}
        if peers.peer_row(name) is not None:  # torchft's DiLoCo, accelerate's LocalSGD: their own code
            return {"name": name, "kind": "peer", **peers.peer_row(name)}
        if name == "fp16":
            return {"name": name, "kind": "fp16"}
        match = re.fullmatch(r"powersgd-r(\d+)", name)
        if match:
            return {"name": name, "kind": "powersgd", "rank": int(match.group(1))}
        if replica_row(name, sync_row) is not None:  # hsdp<R>, rg<R>-<sync row>: FSDP2 inside R replicas
            return replica_row(name, sync_row)
    else:
        if name == "trainer":
            return {"name": name, "kind": "trainer", "lr_factor": 1.0}
        match = re.fullmatch(r"trainer-lr([0-9.]+)", name)
        if match:
            return {"name": name, "kind": "trainer", "lr_factor": float(match.group(1))}
        match = re.fullmatch(r"loraplus-([0-9.]+)", name)
        if match:
            return {"name": name, "kind": "loraplus", "ratio": float(match.group(1))}
        if name in LR_ROWS:
            return {"name": name, "kind": "grpo", "overrides": dict(LR_ROWS[name])}
    raise ValueError(f"unknown {suite} row {name!r}; see --help for the row names.")


def _typed(overrides: dict) -> dict:
    """`grpo:` overrides typed as GRPOConfig's fields."""
    import dataclasses

    from grpo_hf import GRPOConfig

    types = {f.name: f.type for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for key, value in overrides.items():
        if key not in types:
            raise ValueError(f"row override {key!r} is not a GRPOConfig field.")
        kind = str(types[key])
        if not isinstance(value, str):
            out[key] = value
        elif "bool" in kind:
            out[key] = value.lower() in ("1", "true", "yes")
        elif "float" in kind:
            out[key] = float(value)
        elif "int" in kind:
            out[key] = int(value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------------------------------
# Worker: one task and one seed, every row in turn (under torchrun for the comm suite)
# ----------------------------------------------------------------------------------------------------------------


def _torch_hook_bytes(kind: str, state, bucket, world_size: int) -> float:
    """What torch's `fp16_compress_hook` / `powerSGD_hook` sends for this bucket (ring model)."""
    from grpo_hf.compression.traffic import allreduce_bytes

    if kind == "fp16":
        return allreduce_bytes(2 * bucket.buffer().numel(), world_size)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    if state.iter < state.start_powerSGD_iter:
        return allreduce_bytes(bucket.buffer().numel() * bucket.buffer().element_size(), world_size)
    uncompressed = p_size = q_size = 0
    for tensor in bucket.gradients():
        n = tensor.shape[0]
        m = tensor.numel() // n
        rank = min(n, m, state.matrix_approximation_rank)
        if _should_compress(n, m, rank, state.min_compression_rate)[0]:
            p_size, q_size = p_size + n * rank, q_size + m * rank
        else:
            uncompressed += tensor.numel()
    size = bucket.buffer().element_size()
    return sum(allreduce_bytes(size * count, world_size) for count in (uncompressed, p_size, q_size))


def torch_hook_trainer(row: dict, args, world_size: int, hook_bytes: dict, **kwargs):
    """
    The plain `Trainer` for a `trainer`, `fp16` or `powersgd` row: with torch's `fp16_compress_hook` or
    `powerSGD_hook` (rank `row["rank"]`, error feedback, warm start, from iteration `POWERSGD_START`) registered on
    the DDP model, as GRPOMixin registers its own. `hook_bytes["bytes"]` / `["seconds"]` add up what the hook sends
    (ring model) and the time spent in it.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    class HookedTrainer(Trainer):
        """The plain Trainer with a torch comm hook registered on the DDP model, as GRPOMixin registers its own."""

        comm_hook = comm_state = None

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.comm_hook is not None and not getattr(self, "_hooked", False):
                assert isinstance(model, DistributedDataParallel), "no DDP wrapper: was use_cpu=True set?"
                model.register_comm_hook(self.comm_state, self.comm_hook)
                self._hooked = True
            return super().training_step(model, inputs, num_items_in_batch)

    def timed(hook, kind):
        def wrapper(state, bucket):
            hook_bytes["bytes"] += _torch_hook_bytes(kind, state, bucket, world_size)
            start = time.perf_counter()
            future = hook(state, bucket)
            future.wait()  # PowerSGD on gloo: ranks must not start its collectives in different orders
            hook_bytes["seconds"] += time.perf_counter() - start
            return future

        return wrapper

    trainer = HookedTrainer(args=args, **kwargs)
    if row["kind"] == "fp16":
        trainer.comm_hook = timed(default_hooks.fp16_compress_hook, "fp16")
    elif row["kind"] == "powersgd":
        trainer.comm_state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=row["rank"],
            start_powerSGD_iter=POWERSGD_START,
            use_error_feedback=True,
            warm_start=True,
        )
        trainer.comm_hook = timed(powerSGD_hook.powerSGD_hook, "powersgd")
    return trainer


def _steady_peak(per_step: list[dict], comm_state) -> float:
    """
    The most bytes of one step between the start (dense warm-up; the ramp of the sync every H steps, where every
    fragment syncs at once) and the last step (the final sync of every fragment): what fragments spread.
    """
    from grpo_hf.compression.outer_sync import OuterSyncState, ramp_points

    first = 2
    if isinstance(comm_state, OuterSyncState) and comm_state.ramp:
        first = max(first, (ramp_points(comm_state.every) or [0])[-1])
    return max((s["bytes"] for s in per_step[first:-1]), default=0.0)


def run_row(
    task: Task,
    info: dict,
    row: dict,
    seed: int,
    train,
    evaluation,
    out_dir: str,
    world_size: int,
    eval_points: int = 4,
    sites=None,
) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    from grpo_hf import GRPOConfig, GRPOTrainer
    from grpo_hf.compression.traffic import dense_allreduce_bytes
    from grpo_hf.harness.compare import reset_peak_memory

    distributed = world_size > 1
    common = dict(
        output_dir=os.path.join(out_dir, "tmp"),
        **task.training_arguments(world_size),
        logging_steps=max(1, task.max_steps // 4),
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if not distributed:  # the lr suite: evaluate along the run, for the steps each row needs to reach a target
        common.update(eval_strategy="steps", eval_steps=max(1, task.max_steps // max(1, eval_points)))
    if row["kind"] == "trainer":
        common["learning_rate"] *= row["lr_factor"]
    model = shard_for_row(build_model(task, info, seed), row)  # replica-group rows: sharded before the Trainer
    set_seed(seed)
    kwargs = dict(model=model, train_dataset=train, eval_dataset=evaluation)
    if task.kind == "cls":
        kwargs["compute_metrics"] = compute_accuracy
    if sites is not None:
        sites.read, sites.counting = [0] * len(sites.read), True
        kwargs["data_collator"] = sites
    hook_bytes = {"bytes": 0.0, "seconds": 0.0}
    traffic = peers.PeerTraffic()
    if row["kind"] in ("grpo", "hsdp", "replicas"):
        extra = {"grpo_importance": False} if distributed else {}  # comm rows: only the communication differs
        extra.update(_typed(row["overrides"]))
        trainer = GRPOTrainer(args=GRPOConfig(**common, **extra), **kwargs)
    elif row["kind"] == "optim":
        trainer = Trainer(args=TrainingArguments(**common, optim=row["optim"]), **kwargs)
    elif row["kind"] == "adam-mini":
        from adam_mini import Adam_mini

        config = getattr(model, "config", None)
        optimizer = Adam_mini(
            model.named_parameters(), lr=common["learning_rate"], weight_decay=common["weight_decay"],
            dim=config.hidden_size, n_heads=config.num_attention_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None), verbose=False,
        )  # fmt: skip
        trainer = Trainer(args=TrainingArguments(**common), optimizers=(optimizer, None), **kwargs)
    elif row["kind"] == "loraplus":
        import torch
        from peft.optimizers import create_loraplus_optimizer

        optimizer = create_loraplus_optimizer(
            model,
            torch.optim.AdamW,
            lr=common["learning_rate"],
            loraplus_lr_ratio=row["ratio"],
            loraplus_weight_decay=common["weight_decay"],  # PEFT ignores a plain `weight_decay` here
        )
        trainer = Trainer(args=TrainingArguments(**common), optimizers=(optimizer, None), **kwargs)
    elif row["kind"] == "peer":
        trainer = peers.peer_trainer(row, TrainingArguments(**common), world_size, traffic, **kwargs)
    else:
        trainer = torch_hook_trainer(row, TrainingArguments(**common), world_size, hook_bytes, **kwargs)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dense_bytes = dense_allreduce_bytes(numel, world_size)
    if row["kind"] in ("hsdp", "replicas"):  # bytes between replicas: against HSDP's fp32 replicate all-reduce
        dense_bytes = replicate_bytes_per_step(model, row["replicas"])
    comm_state = getattr(trainer, "grpo_comm_state", None)
    per_step = []

    class StepRecorder(TrainerCallback):
        """Per optimizer step: wall time and the bytes this rank sent."""

        def _bytes(self):
            if comm_state is not None:
                return comm_state.totals()["bytes_sent"]
            if row["kind"] in ("fp16", "powersgd"):
                return hook_bytes["bytes"]
            if row["kind"] == "peer":
                return traffic.bytes
            return None

        def on_step_begin(self, args, state, control, **kw):
            self._start, self._before = time.perf_counter(), self._bytes()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self._optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            self._optimizer_s = time.perf_counter() - self._optimizer_start

        def on_step_end(self, args, state, control, **kw):
            after = self._bytes()
            sent = dense_bytes if after is None else after - self._before
            per_step.append({"step_s": time.perf_counter() - self._start, "bytes": sent,
                             "optimizer_s": getattr(self, "_optimizer_s", None)})  # fmt: skip

    trainer.add_callback(StepRecorder())
    reset_peak_memory()  # the peak of training itself (not the model's loading, nor an earlier row's in this process)
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    train_peak_rss = peak_rss_bytes()
    if sites is not None:
        sites.counting = False
    if row["kind"] in ("hsdp", "replicas"):
        check_replica_run(trainer, row)
    elif distributed:
        assert isinstance(trainer.model_wrapped, DistributedDataParallel), "the run did not use DDP"
    history = [
        {"step": h["step"], "eval_loss": h["eval_loss"], "eval_accuracy": h.get("eval_accuracy")}
        for h in trainer.state.log_history
        if "eval_loss" in h
    ]
    if history and history[-1]["step"] == trainer.state.global_step:  # the run's last step was evaluated already
        final = {"eval_loss": history[-1]["eval_loss"], "eval_accuracy": history[-1]["eval_accuracy"]}
    else:
        final = trainer.evaluate()
        history.append({"step": trainer.state.global_step, "eval_loss": final["eval_loss"],
                        "eval_accuracy": final.get("eval_accuracy")})  # fmt: skip
    result = {
        "task": task.name,
        "row": row["name"],
        "seed": seed,
        "world_size": world_size,
        "learning_rate": common["learning_rate"],
        "steps": len(per_step),
        "trainable_params": numel,
        "train_s": train_s,
        "per_step": per_step,
        "dense_fp32_bytes_per_step": dense_bytes,
        "peak_step_bytes": max((s["bytes"] for s in per_step), default=0.0),  # the most bytes of any one step
        "steady_peak_step_bytes": _steady_peak(per_step, comm_state),
        "eval_loss": final["eval_loss"],
        "eval_accuracy": final.get("eval_accuracy"),
        "eval_history": history,
        "train_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    if comm_state is not None:
        result["grpo_totals"] = comm_state.totals()
        result["grpo_mode"] = comm_state.mode
    if row["kind"] == "grpo":
        result["skipped_steps"] = trainer.grpo_callback.nonfinite_steps  # optimizer steps skipped as NaN/Inf
    if row["kind"] == "peer":
        result["peer"] = peers.record_fields(trainer)
    if sites is not None:
        result["sites_read"] = list(sites.read)
    result.update(_memory_figures(trainer), train_peak_rss_bytes=train_peak_rss)
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return result


class SiteRecorder:
    """
    The default data collator, counting the blocks this rank's training read by the site (package) they came from: the
    long runs' record that, in the non-IID task, rank r read site r only. A block found in both sites (a license
    header) is not counted; evaluation, which uses the same collator, is not counted (`counting` is off).
    """

    def __init__(self, train, info: dict):
        import numpy as np

        blocks = np.asarray(train.with_format("numpy")["input_ids"])
        bounds = np.cumsum(info["data"]["site_blocks"])
        self.site_of = {}
        for index, row in enumerate(blocks):
            site = int(np.searchsorted(bounds, index, side="right"))
            self.site_of[row.tobytes()] = site if self.site_of.get(row.tobytes(), site) == site else None
        self.read, self.counting = [0] * len(bounds), False

    def __call__(self, features):
        import numpy as np
        from transformers import default_data_collator

        for feature in features if self.counting else ():
            site = self.site_of.get(np.asarray(feature["input_ids"], dtype=np.int64).tobytes())
            if site is not None:
                self.read[site] += 1
        return default_data_collator(features)


def _memory_figures(trainer) -> dict:
    """The optimizer's state bytes (per GRPO group where its param groups say, and in all), the process's peak memory."""
    from grpo_hf.cost.prices import peak_memory_bytes
    from grpo_hf.optim.builder import state_nbytes

    by_group = state_nbytes(trainer.optimizer)
    return {"optimizer_state_bytes": sum(by_group.values()), "optimizer_state_bytes_by_group": by_group,
            "peak_memory_bytes": peak_memory_bytes()}  # fmt: skip


def result_path(results: Path, row: str, seed: int, learning_rate: float | None = None) -> Path:
    """Where one run's result lives: `<row>-seed<seed>.json`, or `<row>-lr<lr>-seed<seed>.json` in a sweep."""
    tag = "" if learning_rate is None else f"-lr{learning_rate:.4g}"
    return results / f"{row.replace('/', '_')}{tag}-seed{seed}.json"


def worker(job_path: str) -> None:
    import torch
    from datasets import load_from_disk

    job = json.loads(Path(job_path).read_text())
    task = Task(**{**TASKS[job["task"]].__dict__, **job.get("task_overrides", {})})
    distributed = job["world_size"] > 1
    if distributed:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # Accelerate takes it over
    train, evaluation = load_from_disk(job["info"]["train_path"]), load_from_disk(job["info"]["eval_path"])
    results = Path(job["results_dir"])
    sites = SiteRecorder(train, job["info"]) if task.corpus == "packages" else None
    for seed in job["seeds"]:
        ordered = site_order(train, job["info"], task, seed, job["world_size"])  # the non-IID task's deal
        for name in job["rows"]:
            out = result_path(results, name, seed, job.get("task_overrides", {}).get("learning_rate"))
            if out.exists():  # every rank sees the same files: finished rows are skipped on a re-run
                continue
            result = run_row(task, job["info"], parse_row(job["suite"], name), seed, ordered, evaluation,
                             job["output_dir"], job["world_size"], job.get("eval_points", 4), sites)  # fmt: skip
            rank = 0
            if distributed:
                rank = dist.get_rank()
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, sum(s["bytes"] for s in result["per_step"]))
                result["bytes_by_rank"] = gathered
                for key in ("peak_memory", "train_peak_rss"):  # every rank's, for the peak per rank
                    peaks = [None] * dist.get_world_size()
                    dist.all_gather_object(peaks, result[f"{key}_bytes"])
                    result[f"{key}_by_rank"] = peaks
                if "sites_read" in result:  # blocks per site, per rank; the non-IID task reads its own site only
                    read = [None] * dist.get_world_size()
                    dist.all_gather_object(read, result.pop("sites_read"))
                    result["sites_read_by_rank"] = read
                    if task.noniid and any(n for r, row in enumerate(read) for s, n in enumerate(row) if s != r):
                        raise RuntimeError(f"{task.name}: a rank read another site's blocks: {read}")
            result["commit"] = job.get("commit")
            if rank == 0:
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps(result, indent=1))
                os.replace(tmp, out)
                metric = f"acc {result['eval_accuracy']:.4f}" if result["eval_accuracy"] is not None else ""
                print(f"[{task.name} seed {seed}] {name:<24} {result['train_s']:6.0f} s  loss {result['eval_loss']:.4f} "
                      f"ppl {math.exp(result['eval_loss']):9.3f} {metric}", flush=True)  # fmt: skip
            if distributed:
                dist.barrier()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------------


def launch(job: dict, job_path: Path, timeout: int) -> None:
    """One task and seed: torchrun (comm) or one process (lr); raises with the log tail when it fails."""
    import subprocess

    from tests.testing_utils import WORKER_ENV, run_torchrun

    results, learning_rate = Path(job["results_dir"]), job.get("task_overrides", {}).get("learning_rate")
    if all(result_path(results, row, seed, learning_rate).exists() for row in job["rows"] for seed in job["seeds"]):
        return  # done in an earlier run
    job_path.write_text(json.dumps(job, indent=1))
    log_path = job_path.with_suffix(".log")
    if job["world_size"] > 1:
        run = run_torchrun(Path(__file__).resolve(), nproc=job["world_size"], timeout=timeout,
                           env={"GRPO_SUITE_JOB": str(job_path)}, cwd=ROOT, log_path=log_path)  # fmt: skip
        text, rc = run.stdout, ("timeout" if run.timed_out else run.returncode)
    else:
        env = {
            **os.environ,
            **WORKER_ENV,
            "OMP_NUM_THREADS": str(job.get("threads", 2)),
            "GRPO_SUITE_JOB": str(job_path),
        }
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
        text, rc = log_path.read_text(), proc.returncode
    for line in text.splitlines():
        if line.startswith("["):
            print(line, flush=True)
    if rc != 0:
        raise RuntimeError(f"{job['task']} seeds {job['seeds']} failed ({rc}); log {log_path}:\n{text[-6000:]}")


# ----------------------------------------------------------------------------------------------------------------
# Statistics and the report
# ----------------------------------------------------------------------------------------------------------------

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ratio_stats(ratios: list[float]) -> dict:
    """Geometric mean, worst (largest) and a 95% t-interval of the geometric mean of per-seed ratios."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = (
        T_975.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.nan
    )
    return {"geomean": math.exp(mean), "worst": max(ratios), "best": min(ratios),
            "ci95": [math.exp(mean - half), math.exp(mean + half)]}  # fmt: skip


def first_step_reaching(history: list[dict], target: float) -> int | None:
    """The first evaluated step whose loss is at most `target` (`None` if never)."""
    return next((h["step"] for h in history if h["eval_loss"] <= target + 1e-12), None)


def summarize(suite: str, results: dict[str, dict[str, dict[int, dict]]], baseline: str) -> dict:
    """Per task and row: the figures of the report (see the module docstring)."""
    summary = {}
    for task_name, rows in results.items():
        base = rows.get(baseline, {})
        summary[task_name] = {}
        for name, by_seed in rows.items():
            seeds = sorted(s for s in by_seed if s in base)
            if not seeds:
                continue
            ppl = {s: math.exp(by_seed[s]["eval_loss"]) for s in seeds}
            ratios = [ppl[s] / math.exp(base[s]["eval_loss"]) for s in seeds]
            entry = {"seeds": seeds, "perplexity": ppl, "ppl_ratio": dict(zip(seeds, ratios)), **ratio_stats(ratios)}
            accuracy = [by_seed[s].get("eval_accuracy") for s in seeds]
            if all(a is not None for a in accuracy):
                deltas = [100 * (a - base[s]["eval_accuracy"]) for a, s in zip(accuracy, seeds)]
                entry.update(accuracy=dict(zip(seeds, accuracy)), accuracy_delta_mean=statistics.fmean(deltas),
                             accuracy_delta_worst=min(deltas))  # fmt: skip
            sent = [sum(s["bytes"] for s in by_seed[seed]["per_step"]) for seed in seeds]
            dense = [by_seed[seed]["dense_fp32_bytes_per_step"] * by_seed[seed]["steps"] for seed in seeds]
            if suite == "comm":  # one process (the lr suite) sends nothing
                entry["bytes_ratio"] = statistics.fmean(d / s for d, s in zip(dense, sent))
                entry["peak_bytes_ratio"] = statistics.fmean(  # dense fp32 per step / the busiest step's bytes
                    by_seed[s]["dense_fp32_bytes_per_step"] / max(x["bytes"] for x in by_seed[s]["per_step"])
                    for s in seeds
                )
                if all(by_seed[s].get("steady_peak_step_bytes") for s in seeds):  # after the warm-up or the ramp
                    entry["steady_peak_bytes_ratio"] = statistics.fmean(
                        by_seed[s]["dense_fp32_bytes_per_step"] / by_seed[s]["steady_peak_step_bytes"] for s in seeds
                    )
            warm = 10 if name.startswith("powersgd") else 2
            steady = [by_seed[seed]["per_step"][warm:] for seed in seeds]
            if suite == "comm" and all(steady):
                entry["steady_bytes_ratio"] = statistics.fmean(
                    by_seed[seed]["dense_fp32_bytes_per_step"] / statistics.fmean(x["bytes"] for x in st)
                    for seed, st in zip(seeds, steady)
                )
            entry["step_s"] = statistics.fmean(
                statistics.fmean(x["step_s"] for x in by_seed[s]["per_step"][warm:] or by_seed[s]["per_step"])
                for s in seeds
            )
            skipped = [by_seed[s].get("skipped_steps") for s in seeds]
            if all(k is not None for k in skipped):
                entry["skipped_steps"] = dict(zip(seeds, skipped))
            if suite == "lr":
                reach = [first_step_reaching(by_seed[s]["eval_history"], base[s]["eval_loss"]) for s in seeds]
                entry["steps_to_baseline"] = dict(zip(seeds, reach))
            summary[task_name][name] = entry
    return summary


def markdown(suite: str, summary: dict, baseline: str) -> str:
    lines = []
    metric = "ppl / " + baseline
    header = f"| task | row | seeds | {metric}: geomean | worst seed | 95% CI | per seed |"
    align = "|---|---|---:|---:|---:|---|---|"
    if suite == "comm":
        header += " bytes vs fp32 (run) | (steady) | step s | skipped steps |"
        align += "---:|---:|---:|---:|"
    else:
        header += " steps to baseline |"
        align += "---|"
    header += " accuracy delta (mean / worst) |"
    align += "---|"
    lines += [header, align]
    for task, rows in summary.items():
        for name, e in rows.items():
            per_seed = " ".join(f"{e['ppl_ratio'][s]:.3f}" for s in e["seeds"])
            ci = f"{e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}" if not math.isnan(e["ci95"][0]) else "-"
            cells = [task, name, str(len(e["seeds"])), f"{e['geomean']:.3f}", f"{e['worst']:.3f}", ci, per_seed]
            if suite == "comm":
                steady = e.get("steady_bytes_ratio")
                skipped = e.get("skipped_steps")
                cells += [f"{e['bytes_ratio']:.1f}x", f"{steady:.1f}x" if steady else "-", f"{e['step_s']:.2f}",
                          "-" if skipped is None else str(sum(skipped.values()))]  # fmt: skip
            else:
                reach = e["steps_to_baseline"]
                cells.append(" ".join("-" if reach[s] is None else str(reach[s]) for s in e["seeds"]))
            if "accuracy_delta_mean" in e:
                cells.append(f"{e['accuracy_delta_mean']:+.2f} / {e['accuracy_delta_worst']:+.2f} pts")
            else:
                cells.append("")
            lines.append("| " + " | ".join(cells) + " |")
    rows = sorted({name for task in summary.values() for name in task})
    lines += ["", f"Across tasks (geometric mean of the per-task geometric means of {metric}; worst task):", ""]
    for name in rows:
        per_task = {t: summary[t][name]["geomean"] for t in summary if name in summary[t]}
        if per_task:
            overall = math.exp(statistics.fmean(math.log(v) for v in per_task.values()))
            worst = max(per_task, key=per_task.get)
            lines.append(
                f"- `{name}`: {overall:.3f} over {len(per_task)} tasks (worst: {worst} {per_task[worst]:.3f})"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The learning-rate sweep (--lrs): each row at its own best learning rate
# ----------------------------------------------------------------------------------------------------------------


def _perplexity(record: dict) -> float:
    return math.exp(record["eval_loss"])


def load_sweep(results_dir: Path) -> dict[str, dict[int, dict[float, dict]]]:
    """The sweep's result files of one task: row -> seed -> learning rate (`lr_grid.key`) -> record."""
    runs: dict = {}
    for path in sorted(results_dir.glob("[!_]*-lr*-seed*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["row"], {}).setdefault(record["seed"], {})[lr_grid.key(record["learning_rate"])] = (
            record
        )
    return runs


def sweep_task(args, task: Task, rows: list[str], seeds: list[int], job: dict, results_dir: Path) -> None:
    """
    Launch what the sweep of one task still lacks, one launch per row, learning rate and seed: the first seed over
    each row's grid (extended by a point past the edge while the row's best sits there, up to `--max_lrs` points),
    then the other seeds at each row's best. Finished runs are kept (resume).
    """
    search, *others = seeds

    def run(row: str, learning_rate: float, seed: int) -> None:
        overrides = {**job["task_overrides"], "learning_rate": learning_rate}
        name = result_path(results_dir, f"_job-{row}", seed, learning_rate).name
        launch({**job, "rows": [row], "seeds": [seed], "task_overrides": overrides}, results_dir / name, args.timeout)

    best = {}
    for row in rows:
        learning_rates = lr_grid.grid(args.learning_rate or task.learning_rate, args.lrs)
        while True:
            for learning_rate in learning_rates:
                run(row, learning_rate, search)
            curve = {lr: _perplexity(r) for lr, r in load_sweep(results_dir)[row][search].items()}
            further = lr_grid.extension(curve)
            if further is None or len(curve) >= args.max_lrs:
                break
            learning_rates = [further]
        best[row] = lr_grid.best_point(curve)[0]
    for seed in others:
        for row in rows:
            run(row, best[row], seed)


def summarize_sweep(runs: dict, nominal: float, baseline: str, search_seed: int) -> dict:
    """
    Per row of one task: its curve on the search seed, its best learning rate (and whether the best is inside the
    grid), the ratio of its perplexity at its best to `baseline`'s at its own best on every seed both have (best
    against best: geometric mean and worst seed), the window (log10 span of learning rates within 1% of the
    baseline's best), and the ratio at the task's nominal learning rate.
    """

    if search_seed not in runs.get(baseline, {}):
        return {}
    nominal = lr_grid.key(nominal)
    base_curve = {lr: _perplexity(r) for lr, r in runs[baseline][search_seed].items()}
    base_lr, base_best = lr_grid.best_point(base_curve)
    base_window = lr_grid.window(base_curve, base_best)
    summary = {}
    for name, by_seed in runs.items():
        if search_seed not in by_seed:
            continue
        records = by_seed[search_seed]
        curve = {lr: _perplexity(r) for lr, r in records.items()}
        best_lr, _ = lr_grid.best_point(curve)
        ratios = {
            seed: _perplexity(by_seed[seed][best_lr]) / _perplexity(runs[baseline][seed][base_lr])
            for seed in sorted(by_seed)
            if best_lr in by_seed[seed] and base_lr in runs[baseline].get(seed, {})
        }
        best_record = records[best_lr]
        sent = sum(s["bytes"] for s in best_record["per_step"])
        entry = {
            "curve": {f"{lr:.4g}": value for lr, value in sorted(curve.items())},
            "best_lr": best_lr,
            "best_inside": lr_grid.best_at_edge(curve) is None,
            "best_vs_best": ratios,
            "geomean": lr_grid.geomean(list(ratios.values())),
            "worst": max(ratios.values()),
            "window": lr_grid.window(curve, base_best),
            "window_closed": lr_grid.window_closed(curve, base_best),
            "window_ratio": lr_grid.window_ratio(lr_grid.window(curve, base_best), base_window),
            "at_nominal": curve[nominal] / base_curve[nominal] if nominal in curve and nominal in base_curve else None,
            "nominal_lr": nominal,
            "bytes_ratio": best_record["dense_fp32_bytes_per_step"] * best_record["steps"] / sent if sent else None,
            "skipped_steps": best_record.get("skipped_steps"),
        }
        entry["earns_default"] = lr_grid.earns_default(entry["window"], base_window, entry["geomean"])
        if best_record.get("peer", {}).get("quantized_estimate_bytes"):  # torchft's quantized GPU path (an estimate)
            estimate = best_record["peer"]["quantized_estimate_bytes"]
            entry["quantized_estimate_bytes_ratio"] = (
                best_record["dense_fp32_bytes_per_step"] * best_record["steps"] / estimate
            )
        # the memory suite: each row's figures against the baseline's (a baseline run before they were recorded, as the
        # comm suite's older files, has none)
        if "optimizer_state_bytes" in best_record and "optimizer_state_bytes" in runs[baseline][search_seed][base_lr]:
            entry.update(_memory_ratios(by_seed, best_lr, runs[baseline], base_lr))
        summary[name] = entry
    return summary


def _median_optimizer_s(record: dict) -> float | None:
    """The median time of one `optimizer.step` of a run (the first 2 steps, allocation and compilation, left out)."""
    times = [s["optimizer_s"] for s in record["per_step"][2:] if s.get("optimizer_s") is not None]
    return statistics.median(times) if times else None


def _memory_ratios(by_seed: dict, best_lr: float, base_by_seed: dict, base_lr: float) -> dict:
    """
    A memory-suite row at its best learning rate against the baseline at its own, over the seeds both ran: the
    optimizer's state bytes, the process's peak memory and the median optimizer step (each a ratio of the medians
    over seeds), with the row's own figures.
    """
    seeds = [s for s in sorted(by_seed) if best_lr in by_seed[s] and base_lr in base_by_seed.get(s, {})]
    mine = [by_seed[s][best_lr] for s in seeds]
    theirs = [base_by_seed[s][base_lr] for s in seeds]

    def median(records, read):
        values = [read(r) for r in records]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {}
    for key, read in (
        ("state_bytes", lambda r: r["optimizer_state_bytes"]),
        ("peak_memory_bytes", lambda r: r.get("peak_memory_bytes")),
        ("optimizer_s", _median_optimizer_s),
    ):
        value, base = median(mine, read), median(theirs, read)
        out[key] = value
        out[f"{key}_ratio"] = value / base if value is not None and base else None
    return out


def memory_markdown(sweep: dict[str, dict], baseline: str = "adamw") -> str:
    """The memory suite's table: per task and row, state bytes, peak memory, optimizer step and quality, best against
    best."""
    lines = [
        f"| task | row | optimizer state (x {baseline}) | peak memory (x {baseline}) | optimizer step (x {baseline}) | "
        f"ppl / {baseline}, best vs best: geomean (seeds) | worst seed | best lr | window (log10 lr within 1% of "
        f"{baseline}'s best) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for task, rows in sweep.items():
        for name, e in rows.items():
            if "state_bytes" not in e:
                continue
            state = f"{e['state_bytes'] / 1e6:,.2f} MB ({e['state_bytes_ratio']:.3f})"
            peak = (
                "-"
                if e["peak_memory_bytes"] is None
                else f"{e['peak_memory_bytes'] / 2**20:,.0f} MiB ({e['peak_memory_bytes_ratio']:.2f})"
            )
            step = (
                "-" if e["optimizer_s"] is None else f"{e['optimizer_s'] * 1e3:,.1f} ms ({e['optimizer_s_ratio']:.2f})"
            )
            edge = "" if e["best_inside"] else " (edge)"
            span = f"{e['window']:.2f}" + ("" if e["window_closed"] else "+")
            lines.append(f"| {task} | `{name}` | {state} | {peak} | {step} | {e['geomean']:.3f} ({len(e['best_vs_best'])}) "
                         f"| {e['worst']:.3f} | {e['best_lr']:.3g}{edge} | {span} |")  # fmt: skip
    lines += [
        "",
        "Optimizer state: the bytes of every tensor the optimizer keeps (median over seeds), against the baseline's; peak "
        "memory: the process's (peak RSS on CPU); optimizer step: the median `optimizer.step` of a run (first 2 steps "
        "left out). `(edge)`: the best learning rate is at the grid's edge; a window ending in + reaches it.",
    ]
    return "\n".join(lines)


def sweep_markdown(sweep: dict[str, dict], nominal: dict[str, float], baseline: str = "dense") -> str:
    """The best-against-best table of a sweep: one line per task and row."""
    lines = [
        f"| task | row | lrs run | best lr | ppl / {baseline}, best vs best: geomean (seeds) | worst seed | window (log10 lr "
        f"within 1% of {baseline}'s best) | window / {baseline}'s | ppl / {baseline} at the task's lr | bytes vs fp32 |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for task, rows in sweep.items():
        for name, e in rows.items():
            edge = "" if e["best_inside"] else " (edge)"
            span = f"{e['window']:.2f}" + ("" if e["window_closed"] else "+")
            at = "-" if e["at_nominal"] is None else f"{e['at_nominal']:.3f} (lr {nominal[task]:.3g})"
            sent = "-" if not e["bytes_ratio"] else f"{e['bytes_ratio']:.1f}x"
            wider = "-" if name == baseline or e.get("window_ratio") is None else f"{e['window_ratio']:.2f}x"
            if name != baseline and e.get("earns_default"):
                wider += " (rule met)"
            lines.append(f"| {task} | {name} | {len(e['curve'])} | {e['best_lr']:.3g}{edge} | {e['geomean']:.3f} ({len(e['best_vs_best'])})"
                         f" | {e['worst']:.3f} | {span} | {wider} | {at} | {sent} |")  # fmt: skip
    lines += [
        "",
        "A window ending in + reaches the grid's edge (a lower bound); `(edge)`: the best is at the grid's edge. "
        f"`(rule met)`: a window at least {lr_grid.WIDER_BY:g}x the {baseline}'s at no more than {lr_grid.AT_MOST}x "
        "best against best, the rule a learning-rate setting must meet to become a default.",
    ]
    return "\n".join(lines)


def scaling(args, out: Path) -> list[dict]:
    """Steady-state bytes per rank of the compressed rows at several world sizes (short runs on llama-scratch)."""
    sizes = [int(w) for w in args.scaling_world_sizes.split(",") if w]
    if not sizes:
        return []
    task = TASKS["llama-scratch"]
    rows = ["dense", "q4", "q2", "q4-ar", "q2-ar"]
    table = []
    info = None if args.report_only else prepare(task, out / "data", 2)
    for world_size in sizes:
        results_dir = out / "scaling" / f"w{world_size}"
        results_dir.mkdir(parents=True, exist_ok=True)
        job = {"suite": "comm", "task": task.name, "task_overrides": {"max_steps": 8}, "info": info, "rows": rows,
               "seeds": [0], "results_dir": str(results_dir), "output_dir": str(out), "world_size": world_size}  # fmt: skip
        if not args.report_only:
            launch(job, results_dir / "_job.json", args.timeout)
        for name in rows:
            result = json.loads((results_dir / f"{name}-seed0.json").read_text())
            steady = result["per_step"][2:]
            table.append({"world_size": world_size, "row": name,
                          "steady_bytes": statistics.fmean(s["bytes"] for s in steady)})  # fmt: skip
    return table


def sweep_report(args, tasks: list[str], seeds: list[int], baseline: str, out: Path, start: float) -> None:
    """Summarize a sweep's result files into `results.json` (key `sweep`) and `report.md`."""
    sweep = {}
    for name in tasks:
        runs = load_sweep(out / "results" / name)
        runs = {
            row: {s: r for s, r in by_seed.items() if s in seeds}
            for row, by_seed in runs.items()
            if row in args.row_list
        }
        sweep[name] = summarize_sweep(runs, TASKS[name].learning_rate, baseline, seeds[0])
    nominal = {name: TASKS[name].learning_rate for name in tasks}
    command = "python -m benchmarks.suite " + " ".join(sys.argv[1:])
    table = memory_markdown(sweep, baseline) if args.suite == "memory" else sweep_markdown(sweep, nominal, baseline)
    report = f"`{command}` ({time.time() - start:.0f} s, {time.strftime('%Y-%m-%d')})\n\n" + table
    (out / "results.json").write_text(
        json.dumps({"sweep": sweep, "nominal_lr": nominal, "command": command}, indent=1)
    )
    report += replica_report(out, tasks, args.row_list, seeds, baseline, sweep)
    (out / "report.md").write_text(report + "\n")
    print(report)


def replica_report(out: Path, tasks: list[str], rows: list[str], seeds: list[int], baseline: str, sweep=None) -> str:
    """
    The replica-group rows' own table (benchmarks/replica_rows.py), each row at its best learning rate when swept, with
    the DDP sync rows of the same settings found on disk (`sync32` for `rg2-sync32`: the memory column).
    """
    replicas = [r for r in rows if replica_row(r, sync_row)]
    if not replicas:
        return ""
    ddp = {r.split("-", 1)[1] for r in replicas if r.startswith("rg")}  # the DDP sync rows of the memory column
    records = {}
    for name in tasks:
        for path in sorted((out / "results" / name).glob("[!_]*-seed*.json")):
            record = json.loads(path.read_text())
            best = (sweep or {}).get(name, {}).get(record["row"], {}).get("best_lr")
            at_best = best is None or lr_grid.key(record["learning_rate"]) == best
            if (record["row"] in rows or record["row"] in ddp) and record["seed"] in seeds and at_best:
                records.setdefault(name, {}).setdefault(record["row"], []).append(record)
    return "\n\nReplica groups (bytes between replicas; peak memory per rank):\n\n" + replica_markdown(
        records, baseline
    )


def main() -> None:
    from transformers import HfArgumentParser

    argv = sys.argv[1:]
    if argv and not argv[0].startswith("-"):  # `suite.py comm ...`: the suite is the first word
        argv = ["--suite", *argv]
    (args,) = HfArgumentParser(SuiteArguments).parse_args_into_dataclasses(args=argv)
    out = Path(args.output_dir or f"runs/suite_{args.suite}")
    tasks = [t for t in (args.tasks.split(",") if args.tasks else TASKS)]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, tasks = seeds[:2], [t for t in tasks if t.endswith("scratch")]
    default_rows = {"comm": DEFAULT_COMM_ROWS, "lr": DEFAULT_LR_ROWS, "memory": DEFAULT_MEMORY_ROWS}[args.suite]
    args.row_list = (args.rows or default_rows).split(",")
    baseline = args.baseline or {"comm": "dense", "lr": "trainer", "memory": "adamw"}[args.suite]
    if baseline not in args.row_list:
        args.row_list.insert(0, baseline)
    world_size = args.world_size if args.suite == "comm" else 1
    out.mkdir(parents=True, exist_ok=True)
    start, revision = time.time(), commit()
    for name in tasks:
        task = TASKS[name]
        rows = [r for r in args.row_list if not (r.startswith("loraplus") and not task.lora)]
        for row in rows:
            parse_row(args.suite, row)  # fail on a bad row name before any work
        rows = peers.available_rows(rows)  # a peer row whose package is missing is skipped, with a line
        if args.report_only:
            continue
        info = prepare(task, out / "data", world_size)
        results_dir = out / "results" / name
        results_dir.mkdir(parents=True, exist_ok=True)
        if args.lrs:
            job = {"suite": args.suite, "task": name, "info": info, "results_dir": str(results_dir),
                   "output_dir": str(out), "world_size": world_size, "eval_points": args.eval_points,
                   "task_overrides": {"max_steps": args.max_steps} if args.max_steps else {}, "commit": revision,
                   "threads": args.threads}  # fmt: skip
            sweep_task(args, task, rows, seeds, job, results_dir)
            continue
        for seed in seeds:  # one launch per seed: a crash loses one seed's rows at most
            job = {"suite": args.suite, "task": name, "info": info, "rows": rows, "seeds": [seed],
                   "results_dir": str(results_dir), "output_dir": str(out), "world_size": world_size,
                   "task_overrides": {"max_steps": args.max_steps} if args.max_steps else {},
                   "eval_points": args.eval_points, "commit": revision, "threads": args.threads}  # fmt: skip
            launch(job, results_dir / f"_job-seed{seed}.json", args.timeout)
    if args.lrs:
        return sweep_report(args, tasks, seeds, baseline, out, start)
    results = {}
    for name in tasks:
        results[name] = {}
        for path in sorted((out / "results" / name).glob("[!_]*-seed*.json")):
            record = json.loads(path.read_text())
            if record["row"] in args.row_list and record["seed"] in seeds:
                results[name].setdefault(record["row"], {})[record["seed"]] = record
    summary = summarize(args.suite, results, baseline)
    table = scaling(args, out) if args.suite == "comm" and "llama-scratch" in tasks else []
    report = markdown(args.suite, summary, baseline) + replica_report(out, tasks, args.row_list, seeds, baseline)
    if table:
        report += (
            "\n\nSteady-state bytes per rank and step (llama-scratch, short runs):\n\n| row | "
            + " | ".join(f"W={w}" for w in sorted({t["world_size"] for t in table}))
            + " |\n|---|"
            + "---:|" * len({t["world_size"] for t in table})
            + "\n"
        )
        for name in dict.fromkeys(t["row"] for t in table):
            cells = [f"{t['steady_bytes'] / 1e3:,.1f} kB" for t in table if t["row"] == name]
            report += f"| {name} | " + " | ".join(cells) + " |\n"
    command = "python -m benchmarks.suite " + " ".join(sys.argv[1:])
    report = f"`{command}` ({time.time() - start:.0f} s, {time.strftime('%Y-%m-%d')})\n\n" + report
    (out / "results.json").write_text(json.dumps({"summary": summary, "scaling": table, "command": command}, indent=1))
    (out / "report.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    if os.environ.get("GRPO_SUITE_JOB"):
        from tests.testing_utils import end_worker

        worker(os.environ["GRPO_SUITE_JOB"])
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        main()
