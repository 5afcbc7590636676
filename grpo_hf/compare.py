"""The comparison runner: trains `Trainer` and `GRPOTrainer` side by side on a recipe and measures both runs.

Example:

```python
>>> from grpo_hf.compare import compare
>>> from grpo_hf.parser import load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> results = compare(model_args, data_args, args)
>>> results["ratios"]["perplexity_after"]  # GRPOTrainer / Trainer
```
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .checkpoints import resolve_resume_checkpoint
from .evaluation import evaluate_perplexity, reset_peak_memory
from .parser import DTYPES, DataArguments, ModelArguments


TRAINER_KINDS = ("trainer", "grpo")
LABELS = {"trainer": "Trainer", "grpo": "GRPOTrainer"}
# The training fields a comparison's results record (with every model, data and grpo_*/cost_* field).
SUMMARY_TRAINING_KEYS = (
    "output_dir seed max_steps num_train_epochs per_device_train_batch_size per_device_eval_batch_size "
    "gradient_accumulation_steps learning_rate lr_scheduler_type warmup_steps weight_decay max_grad_norm optim "
    "logging_steps bf16 fp16"
).split()


def plain_training_arguments(args):
    """
    A plain [`~transformers.TrainingArguments`] with every `TrainingArguments` field of `args` and nothing else, so
    that the baseline `Trainer` cannot be influenced by a `grpo_*` or `cost_*` field.
    """
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    return TrainingArguments(**{name: getattr(args, name) for name in names})


# --------------------------------------------------------------------------------------------------------------
# Model, tokenizer, data
# --------------------------------------------------------------------------------------------------------------


def _is_tiny(model_args: ModelArguments) -> bool:
    return model_args.model_name_or_path.startswith("tiny-")


def build_tokenizer(model_args: ModelArguments, data_args: DataArguments):
    """
    The tokenizer of a recipe: `tokenizer_name_or_path` if given; for `tiny-*` models a byte-level BPE of
    `tiny_vocab_size` trained on the first `tiny_tokenizer_chars` characters of the corpus' train split; else `None`
    (the model's own tokenizer, returned by [`build_model`]).
    """
    if model_args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_args.tokenizer_name_or_path)
    if not _is_tiny(model_args):
        return None
    from .data import load_stdlib_texts, train_bpe_tokenizer

    texts = load_stdlib_texts(
        data_args.corpus, split="train", val_percent=data_args.val_percent, root=data_args.corpus_root
    )
    if model_args.tiny_tokenizer_chars:
        kept, chars = [], 0
        for text in texts:
            if chars >= model_args.tiny_tokenizer_chars:
                break
            kept.append(text)
            chars += len(text)
        texts = kept
    return train_bpe_tokenizer(texts, vocab_size=model_args.tiny_vocab_size)


def build_model(model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer=None):
    """
    Load the recipe's model (and tokenizer) and wrap it with LoRA when `lora_r > 0`.

    The tiny models and the LoRA adapter are initialised from `seed` without touching the global RNG, so two calls
    give identical weights.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    from .models import load_causal_lm

    dtype = DTYPES[model_args.dtype]
    kwargs = {}
    if _is_tiny(model_args):
        kwargs = dict(
            hidden_size=model_args.tiny_hidden_size,
            layers=model_args.tiny_layers,
            heads=model_args.tiny_heads,
            seq_len=data_args.seq_len,
            seed=seed,
        )
    model, tokenizer = load_causal_lm(model_args.model_name_or_path, tokenizer=tokenizer, dtype=dtype, **kwargs)
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        config = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, config)
    model.train()
    return model, tokenizer


def build_datasets(tokenizer, data_args: DataArguments):
    """`(train_ds, eval_ds, info)` of the recipe's corpus ([`~grpo_hf.data.build_lm_datasets`])."""
    from .data import build_lm_datasets

    return build_lm_datasets(
        tokenizer,
        seq_len=data_args.seq_len,
        max_train_tokens=data_args.max_train_tokens,
        max_eval_tokens=data_args.max_eval_tokens,
        kind=data_args.corpus,
        val_percent=data_args.val_percent,
        root=data_args.corpus_root,
    )


def dense_allreduce_bytes_per_step(trainable_params: int, world_size: int) -> float:
    """Bytes one rank sends per optimizer step in a dense fp32 ring all-reduce: `2 (W - 1) / W * 4 * params`."""
    from .compression.traffic import dense_allreduce_bytes

    return dense_allreduce_bytes(trainable_params, world_size)


# --------------------------------------------------------------------------------------------------------------
# Callbacks of a measured run
# --------------------------------------------------------------------------------------------------------------


class CommBytesCallback(TrainerCallback):
    """
    Bytes one worker sends at every optimizer step (`per_step`): a constant for the dense baseline
    (`bytes_per_step`), or the growth of GRPO's codec counter (`comm_state.totals()["bytes_sent"]`).
    """

    def __init__(self, bytes_per_step: float | None = None, comm_state=None):
        self.bytes_per_step = bytes_per_step
        self.comm_state = comm_state
        self.per_step: list[float] = []
        self._seen = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.comm_state is None:
            self.per_step.append(float(self.bytes_per_step or 0.0))
            return
        total = float(self.comm_state.totals()["bytes_sent"])
        self.per_step.append(total - self._seen)
        self._seen = total


class CompactProgressCallback(ProgressCallback):
    """
    A progress callback that prints a short line per log (loss, LR, grad norm, compression ratio) instead of every
    `grpo/*` key; with `show_bar=False` (`disable_tqdm`) it prints the lines without a progress bar.
    """

    keys = ("loss", "grad_norm", "learning_rate", "grpo/comm/ratio_fp32")
    final_keys = ("train_runtime", "train_loss")

    def __init__(self, show_bar: bool = True):
        super().__init__()
        self.show_bar = show_bar

    def on_train_begin(self, args, state, control, **kwargs):
        if self.show_bar:
            super().on_train_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.show_bar:
            super().on_step_end(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.show_bar and self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)

    def on_prediction_step(self, *args, **kwargs):
        if self.show_bar:
            super().on_prediction_step(*args, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        shown = {k: logs[k] for k in (self.final_keys if "train_loss" in logs else self.keys) if k in logs}
        if not shown:
            return
        text = f"step {state.global_step}: " + ", ".join(
            f"{k.split('/')[-1]}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
        )
        if self.show_bar and self.training_bar is not None:
            self.training_bar.write(text)
        else:
            print(text, flush=True)


def _use_compact_progress(trainer) -> None:
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(CompactProgressCallback(show_bar=not trainer.args.disable_tqdm))


# --------------------------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------------------------


def capture_environment() -> dict[str, Any]:
    """Versions, platform, CPUs, torch threads and GPU of this run, for `results.json`."""
    import importlib.metadata as metadata
    import platform

    env = {"python": sys.version, "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        env["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for package in ("torch", "transformers", "accelerate", "peft", "evaluate", "grpo_hf"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    env["torch_threads"] = torch.get_num_threads()
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before str: transformers' enums are str subclasses
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def recipe_summary(model_args: ModelArguments, data_args: DataArguments, args) -> dict[str, Any]:
    """The settings a comparison depends on: every model and data field, and the training fields that matter."""
    from .config import grpo_field_names

    return _jsonable(
        {
            "model": dataclasses.asdict(model_args),
            "data": dataclasses.asdict(data_args),
            "training": {k: getattr(args, k) for k in SUMMARY_TRAINING_KEYS},
            "grpo": {k: getattr(args, k) for k in grpo_field_names()},
        }
    )


# --------------------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """What every run of a comparison shares: the tokenizer, the datasets, their description, the eval before."""

    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    data_info: dict
    eval_before: dict | None = None


def _say(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


def prepare(model_args: ModelArguments, data_args: DataArguments, progress=None, tokenizer=None):
    """Build the tokenizer and the datasets once for all runs of a comparison."""
    if tokenizer is None:
        tokenizer = build_tokenizer(model_args, data_args)
    if tokenizer is None:  # the model's own tokenizer (SmolLM2, Hub models)
        from .models import load_causal_lm

        _say(progress, "loading model (for its tokenizer)")
        model, tokenizer = load_causal_lm(model_args.model_name_or_path, dtype=DTYPES[model_args.dtype])
        del model
        gc.collect()
    _say(progress, "tokenizing the corpus")
    train_ds, eval_ds, info = build_datasets(tokenizer, data_args)
    info = dict(info, vocab_size=len(tokenizer), tokenizer=type(tokenizer).__name__)
    return Prepared(tokenizer, train_ds, eval_ds, info)


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    args,
    trainer_kind: str = "grpo",
    prepared: Prepared | None = None,
    progress: Callable[[str], None] | None = print,
    output_dir: str | None = None,
    save_model: bool = False,
) -> dict[str, Any]:
    """
    Train one model with the plain `Trainer` (`trainer_kind="trainer"`) or `GRPOTrainer` (`"grpo"`) and measure it.

    1. builds the tokenizer and the datasets (the Python standard library corpus, hash split; see
       [`~grpo_hf.data.build_lm_datasets`]), unless `prepared` holds them;
    2. loads the model ([`~grpo_hf.models.load_causal_lm`]) and wraps it with a LoRA adapter (`lora_r > 0`), the
       adapter initialised from the run's seed, so both trainers of a comparison start from the same weights;
    3. evaluates held-out perplexity with the offline `evaluate` metric
       ([`~grpo_hf.evaluation.evaluate_perplexity`]), unless `prepared` holds it;
    4. trains with the plain `Trainer` (a plain `TrainingArguments` built from the same values, so no GRPO field can
       influence it) or with `GRPOTrainer`, measuring cost with a [`~grpo_hf.CostCallback`];
    5. evaluates perplexity again and collects the logs, the bytes communicated per step and the cost figures.

    Bytes communicated on one process: nothing is sent, so both rows count what one of `W` workers would send per
    optimizer step (`W = cost_num_workers`, else 2): the baseline a dense fp32 ring all-reduce of every trainable
    gradient, `2 (W - 1) / W * 4 * trainable_params`; GRPO what its compression codec (applied locally, with error
    feedback) would send ([`~grpo_hf.compression.hook.compress_locally`]).

    Args:
        model_args ([`ModelArguments`]), data_args ([`DataArguments`]), args ([`~grpo_hf.GRPOConfig`]):
            The recipe. The plain `Trainer` gets [`plain_training_arguments`]`(args)`; the cost settings (`cost_*`)
            price both runs alike.
        trainer_kind (`str`, *optional*, defaults to `"grpo"`):
            `"trainer"` or `"grpo"`.
        prepared ([`Prepared`], *optional*):
            Tokenizer, datasets and the perplexity before training, shared by the runs of a comparison; built (and
            the perplexity before measured, then stored in it) when missing.
        progress (`Callable[[str], None]`, *optional*, defaults to `print`):
            Receives one line per phase (`"loading model"`, `"evaluating before"`, `"training Trainer"`, ...).
        output_dir (`str`, *optional*):
            The trainer's `output_dir` (checkpoints); defaults to `args.output_dir`.
        save_model (`bool`, *optional*, defaults to `False`):
            Save the trained model (the adapter with LoRA) and the tokenizer into the trainer's `output_dir`.

    Returns:
        `dict`: one row of the comparison: `name`, `label`, perplexity before/after, `train_seconds`,
        `tokens_per_second`, `peak_memory_gb`, `comm_*` (bytes one worker sends), `energy_kwh`, dollars,
        `cost_per_quality = total_usd * perplexity_after`, the loss curve, the per-group LR multipliers, the bytes of
        every step and the cost assumptions.
    """
    from transformers import Trainer, default_data_collator

    from .callbacks import CostCallback
    from .cost import CostSettings, comm_time_seconds, cost_per_quality
    from .trainer import GRPOTrainer

    if trainer_kind not in TRAINER_KINDS:
        raise ValueError(f"trainer_kind={trainer_kind!r}: use one of {TRAINER_KINDS}.")
    label = LABELS[trainer_kind]
    if prepared is None:
        prepared = prepare(model_args, data_args, progress)
    output_dir = output_dir or args.output_dir
    args = dataclasses.replace(args, output_dir=output_dir)
    if args.include_num_input_tokens_seen == "no":  # the plain Trainer's token count, for tokens/s
        args.include_num_input_tokens_seen = "all"

    _say(progress, f"loading model ({label})")
    model, _ = build_model(model_args, data_args, seed=args.seed, tokenizer=prepared.tokenizer)
    model.to(args.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    if prepared.eval_before is None:
        _say(progress, "evaluating before")
        prepared.eval_before = evaluate_perplexity(
            model, prepared.eval_dataset, args.per_device_eval_batch_size, show_progress=not args.disable_tqdm
        )

    settings = CostSettings.from_args(args)
    world = settings.cost_num_workers or 2
    common = dict(
        model=model,
        train_dataset=prepared.train_dataset,
        processing_class=prepared.tokenizer,
        data_collator=default_data_collator,
    )
    if trainer_kind == "trainer":
        per_step = dense_allreduce_bytes_per_step(trainable, world)
        recorder = CommBytesCallback(per_step)
        cost = CostCallback(settings, seq_len=data_args.seq_len)
        trainer = Trainer(args=plain_training_arguments(args), callbacks=[cost, recorder], **common)
        comm_mode = f"dense fp32 all-reduce (W={world})"
    else:
        trainer = GRPOTrainer(args=args, **common)
        cost = trainer.cost_callback
        comm_state = trainer.grpo_comm_state
        if comm_state is not None:  # bytes one of W workers would send (GRPOCommState counts W=2 by default)
            comm_state.simulated_world_size = world
        recorder = CommBytesCallback(
            dense_allreduce_bytes_per_step(trainable, world) if comm_state is None else None, comm_state
        )
        trainer.add_callback(recorder)
        density = f"density {args.grpo_density:g}, " if "sparse" in trainer.grpo_compression else ""
        comm_mode = (
            f"{trainer.grpo_compression} ({comm_state.mode}, W={world}, {density}bits {args.grpo_bits}, error feedback)"
            if comm_state is not None
            else f"dense fp32 all-reduce (W={world}, grpo_compression={trainer.grpo_compression})"
        )
    _use_compact_progress(trainer)

    memory_reset = reset_peak_memory(args.device)
    _say(progress, f"training {label}")
    start = time.perf_counter()
    resume = args.resume_from_checkpoint  # GRPOTrainer resolves "last" itself; the plain Trainer does not know it
    if trainer_kind == "trainer":
        resume = resolve_resume_checkpoint(output_dir, resume, grpo=False)
    output = trainer.train(resume_from_checkpoint=resume)
    wall = time.perf_counter() - start
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    summary = cost.summary()
    metrics = summary["metrics"]

    _say(progress, f"evaluating after ({label})")
    eval_after = evaluate_perplexity(
        model, prepared.eval_dataset, args.per_device_eval_batch_size, show_progress=not args.disable_tqdm
    )
    if save_model:
        trainer.save_model(output_dir)

    history = [dict(h) for h in trainer.state.log_history]
    loss_curve = [(h["step"], h["loss"]) for h in history if "loss" in h]
    lr_scales: dict[str, list] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("grpo/lr_scale/"):
                lr_scales.setdefault(key.removeprefix("grpo/lr_scale/"), []).append((h["step"], value))
    comm_bytes = float(sum(recorder.per_step))
    steps = trainer.state.global_step
    row: dict[str, Any] = {
        "name": trainer_kind,
        "label": label,
        "perplexity_before": prepared.eval_before["perplexity"],
        "perplexity_after": eval_after["perplexity"],
        "mean_nll_before": prepared.eval_before["mean_nll"],
        "mean_nll_after": eval_after["mean_nll"],
        "eval_tokens": eval_after["num_tokens"],
        "eval_seconds": eval_after["seconds"],
        "train_loss": loss_curve[-1][1] if loss_curve else output.training_loss,
        "train_loss_mean": output.training_loss,
        "steps": steps,
        "train_seconds": metrics.get("cost/train_seconds", wall),
        "train_wall_seconds": wall,
        "tokens": metrics.get("cost/tokens"),
        "tokens_per_second": metrics.get("cost/tokens_per_second"),
        "peak_memory_gb": metrics.get("cost/peak_memory_gb"),
        "peak_memory_reset": memory_reset,
        # 1-minute load average at the end of training: above the core count, other processes shared the CPUs and
        # the times (and the estimated energy and cost) are inflated.
        "load_average": load_average,
        "trainable_params": trainable,
        "total_params": total_params,
        "comm_mode": comm_mode,
        "comm_workers": world,
        "comm_bytes": comm_bytes,
        "comm_bytes_per_step": comm_bytes / steps if steps else 0.0,
        "comm_bytes_dense_fp32": dense_allreduce_bytes_per_step(trainable, world) * steps,
        "comm_seconds_projected": comm_time_seconds(comm_bytes, settings.cost_link_gbps),
        "energy_kwh": metrics.get("cost/energy_kwh"),
        "energy_source": metrics.get("cost/energy_source"),
        "energy_estimated": bool(metrics.get("cost/energy_estimated")),
        "gpu_usd": metrics.get("cost/gpu_usd"),
        "energy_usd": metrics.get("cost/energy_usd"),
        "cooling_usd": metrics.get("cost/cooling_usd"),
        "total_usd": metrics.get("cost/total_usd"),
        "cost_per_quality": cost_per_quality(metrics["cost/total_usd"], perplexity=eval_after["perplexity"])
        if math.isfinite(eval_after["perplexity"]) and "cost/total_usd" in metrics
        else None,  # a diverged run has no quality; a resumed finished run trained nothing
        "loss_curve": loss_curve,
        "lr_scales": lr_scales,
        "bytes_per_step": list(recorder.per_step),
        "cost_assumptions": summary["assumptions"],
    }
    if trainer_kind == "grpo":
        row["groups"] = {g.name: g.numel for g in trainer.grpo_groups}
        if trainer.grpo_comm_state is not None:
            row["comm_totals"] = trainer.grpo_comm_state.totals()
            row["comm_ratio_fp32"] = row["comm_bytes_dense_fp32"] / comm_bytes if comm_bytes else None
    else:
        row["comm_ratio_fp32"] = 1.0
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return _jsonable(row)


def compare(
    model_args: ModelArguments,
    data_args: DataArguments,
    args,
    progress: Callable[[str], None] | None = print,
    kinds: tuple[str, ...] = TRAINER_KINDS,
) -> dict[str, Any]:
    """
    Train the plain `Trainer` and `GRPOTrainer` on identical data, seed and steps and compare them.

    The tokenizer, the datasets and the perplexity before training are computed once; each run loads the model
    afresh (same weights, same LoRA initialisation). Each run's checkpoints and trained model (the adapter with LoRA,
    and the tokenizer: what `grpo-hf publish` uploads) go to `<output_dir>/<kind>`. Then, with
    `cost_noise_rounds > 0`, [`~grpo_hf.noise.measure_timing_noise`] times interleaved windows of both trainers (checkpoints in
    `<output_dir>/noise`).

    Returns:
        `dict`: `runs` (one row per trainer, see [`run_training`]), `ratios` (GRPOTrainer / Trainer per metric, see
        [`~grpo_hf.report.compute_ratios`]), `timing_noise` (the windows) and `ratio_noise` (a noise band and a
        `within_noise` flag per timed ratio, see [`~grpo_hf.noise.timed_ratio_noise`]), `recipe`, `data` (corpus
        fingerprint, `sys.version`, sizes), `environment` and `wall_seconds`.
    """
    from .noise import measure_timing_noise, timed_ratio_noise
    from .report import compute_ratios

    start = time.perf_counter()
    prepared = prepare(model_args, data_args, progress)
    runs = []
    for kind in kinds:
        runs.append(
            run_training(
                model_args,
                data_args,
                args,
                kind,
                prepared=prepared,
                progress=progress,
                output_dir=os.path.join(args.output_dir, kind),
                save_model=True,
            )
        )
    by_name = {r["name"]: r for r in runs}
    ratios = compute_ratios(by_name["trainer"], by_name["grpo"]) if len(by_name) == 2 else {}
    rounds = getattr(args, "cost_noise_rounds", 0) if ratios else 0
    timing_noise = (
        measure_timing_noise(
            model_args, data_args, args, prepared, rounds, getattr(args, "cost_noise_window_steps", 4), progress
        )
        if rounds
        else None
    )
    noise = timed_ratio_noise({"ratios": ratios, "timing_noise": timing_noise})
    return {
        "runs": runs,
        "ratios": ratios,
        "timing_noise": timing_noise,
        "ratio_noise": _jsonable(noise),
        "recipe": recipe_summary(model_args, data_args, args),
        "data": _jsonable(prepared.data_info),
        "eval_before": _jsonable(prepared.eval_before),
        "environment": capture_environment(),
        "wall_seconds": time.perf_counter() - start,
    }
