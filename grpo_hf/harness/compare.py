"""The comparison runner: trains `Trainer` and `GRPOTrainer` side by side on a recipe and measures both runs.

- [`make_trainer`]: the trainer of one run, the plain `Trainer` or `GRPOTrainer`, built in one place for the full
  runs and the timed windows alike, so that both count the bytes of the same number of workers ([`comm_workers`]) and
  measure cost alike;
- [`run_training`]: one run: load a fresh model, evaluate it, train it, evaluate it again, one row of the comparison;
  its held-out quality is perplexity ([`evaluate_perplexity`]) or accuracy ([`evaluate_accuracy`]) through the
  offline `evaluate` metric scripts of `grpo_hf/harness/metrics/` ([`load_metric`]);
- [`measure_timing_noise`]: short timed windows of both trainers, interleaved, that measure the timed ratios and their
  noise ([`~grpo_hf.harness.table.timed_ratio_noise`] turns them into the headline ratios and their ranges);
- [`compare`]: both runs on identical data, seed and steps, their ratios (the timed ones from the interleaved windows)
  and the noise windows.

Example:

```python
>>> from grpo_hf.harness.compare import compare
>>> from grpo_hf.harness.arguments import load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> results = compare(model_args, data_args, args)
>>> results["ratios"]["perplexity_after"]  # GRPOTrainer / Trainer
```
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..checkpoints import resolve_resume_checkpoint, resume_changes, tied_missing_keys
from ..compression.codes import code_for
from ..compression.traffic import dense_allreduce_bytes
from ..config import grpo_field_names
from ..errors import RecipeError
from ..provenance import SUMMARY_TRAINING_KEYS, capture_environment, jsonable
from .arguments import DataArguments, ModelArguments, recipe_field_names
from .data import Prepared, prepare, report_progress
from .models import build_model
from .table import METHOD, compute_ratios, headline_ratios, timed_ratio_noise, whole_run_throughput


if TYPE_CHECKING:
    import evaluate


def recipe_summary(
    model_args: ModelArguments, data_args: DataArguments, args, resumed: dict | None = None
) -> dict[str, Any]:
    """
    The settings a run depends on: every model and data field, and the training and GRPO fields that matter. For a
    run resumed from a checkpoint (`resumed`: a row's record, see [`run_training`]) they are the settings it used:
    `learning_rate` the peak of the schedule it followed (the checkpoint's; `learning_rate_requested` the one given),
    and each setting changed at the resume `"<checkpoint's> until step N, <this run's> from step N+1"`, so that a
    report or a card built from them states what the run used.
    """
    summary = jsonable(
        {
            "model": dataclasses.asdict(model_args),
            "data": dataclasses.asdict(data_args),
            "training": {k: getattr(args, k) for k in SUMMARY_TRAINING_KEYS},
            # the commands' own fields too, as before they left GRPOConfig
            "grpo": {k: getattr(args, k) for k in grpo_field_names() + recipe_field_names() if hasattr(args, k)},
        }
    )
    if resumed:
        rate = (resumed.get("learning_rate") or {}).get("schedule")
        if rate is not None and not math.isclose(rate, summary["training"]["learning_rate"], rel_tol=1e-9):
            summary["training"]["learning_rate_requested"] = summary["training"]["learning_rate"]
            summary["training"]["learning_rate"] = rate
        step = resumed.get("step") or 0
        for name, (before, after) in (resumed.get("applied") or {}).items():
            if name in summary["grpo"]:
                summary["grpo"][name] = f"{before} until step {step}, {after} from step {step + 1}"
    return summary


# --------------------------------------------------------------------------------------------------------------
# The trainers
# --------------------------------------------------------------------------------------------------------------


TRAINER_KINDS = ("trainer", "grpo")
LABELS = {"trainer": "Trainer", "grpo": "GRPOTrainer"}


def plain_training_arguments(args):
    """
    A plain [`~transformers.TrainingArguments`] with every `TrainingArguments` field of `args` and nothing else, so
    that the baseline `Trainer` cannot be influenced by a `grpo_*` or `cost_*` field.
    """
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    return TrainingArguments(**{name: getattr(args, name) for name in names})


def exchanging_workers(args) -> int:
    """The processes that exchange: the world size, times the planned replica groups of a fault-tolerant run
    (`grpo_fault_tolerance`: each launch is one group, and its sync sends to the others)."""
    groups = (getattr(args, "grpo_ft_replicas", None) or 1) if getattr(args, "grpo_fault_tolerance", False) else 1
    return args.world_size * groups


def comm_workers(args, settings) -> int:
    """`W`, the workers whose bytes a run counts: `cost_num_workers`, else the processes that exchange (DDP's world
    size, or the fault-tolerant replica groups), else 2 (on one process nothing is sent: the bytes are those one of two
    workers would send)."""
    workers = exchanging_workers(args)
    return settings.cost_num_workers or (workers if workers > 1 else 2)


def make_trainer(kind: str, args, model, prepared, seq_len: int | None = None, callbacks=()) -> tuple[Any, Any, int]:
    """
    The trainer of one run on `prepared`'s data (train split, tokenizer, collator): the plain `Trainer`
    (`kind="trainer"`, with [`plain_training_arguments`] and a [`~grpo_hf.CostCallback`] of the `cost_*` settings) or
    `GRPOTrainer` (`"grpo"`, its own cost callback; its codec, applied locally on one process, counts the bytes of one
    of `W` workers).

    Returns:
        `tuple`: the trainer, its [`~grpo_hf.CostCallback`] and `W` ([`comm_workers`]).
    """
    from transformers import Trainer, default_data_collator

    from ..cost import CostSettings
    from ..cost.callback import CostCallback
    from ..trainer import GRPOTrainer

    if kind not in TRAINER_KINDS:
        raise ValueError(f"trainer_kind={kind!r}: use one of {TRAINER_KINDS}.")
    settings = CostSettings.from_args(args)
    world = comm_workers(args, settings)
    common = dict(
        model=model,
        train_dataset=prepared.train_dataset,
        processing_class=prepared.tokenizer,
        data_collator=getattr(prepared, "collator", None) or default_data_collator,  # rows of your data are padded
    )
    if kind == "trainer":
        cost = CostCallback(settings, seq_len=seq_len)
        trainer = Trainer(args=plain_training_arguments(args), callbacks=[cost, *callbacks], **common)
        return trainer, cost, world
    trainer = GRPOTrainer(args=args, **common)
    for callback in callbacks:  # after GRPOTrainer's own callbacks
        trainer.add_callback(callback)
    if trainer.grpo_comm_state is not None:  # on one process: the bytes one of W workers would send (2 by default)
        trainer.grpo_comm_state.count_bytes_for(world)
    return trainer, trainer.cost_callback, world


# --------------------------------------------------------------------------------------------------------------
# Measuring a run: held-out quality through the offline `evaluate` metrics, peak memory
# --------------------------------------------------------------------------------------------------------------


# The offline `evaluate` metric scripts (`evaluate` 0.4.6 ships none: `evaluate.load("accuracy")` fetches one from
# the Hub, and the Hub's `perplexity` downloads and runs GPT-2). `perplexity`: per-example summed token NLLs (nats) and
# token counts in, `perplexity = exp(sum(nll) / sum(tokens))`, `mean_nll`, `num_tokens` out; `accuracy`: class ids
# in, `accuracy` out (config `"multilabel"`: exact match of label lists).
METRICS_DIR = Path(__file__).resolve().parent / "metrics"
AVAILABLE_METRICS = ("accuracy", "perplexity")


def metric_path(name: str) -> str:
    """
    Path of the script of metric `name` (`grpo_hf/harness/metrics/<name>/<name>.py`).

    Raises:
        `ValueError`: if `name` is not one of `AVAILABLE_METRICS`.
    """
    if name not in AVAILABLE_METRICS:
        raise ValueError(f"Unknown metric {name!r}; choose one of {', '.join(AVAILABLE_METRICS)}.")
    return str(METRICS_DIR / name / f"{name}.py")


def load_metric(name: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """
    Load the local metric `name` with `evaluate.load`, offline.

    Args:
        name (`str`):
            One of `"accuracy"`, `"perplexity"`.
        kwargs:
            Passed to `evaluate.load` (`config_name`, `keep_in_memory`, `num_process`, `process_id`, ...).
    """
    path = metric_path(name)  # validate the name before the (slow) import
    import evaluate

    return evaluate.load(path, **kwargs)


@torch.no_grad()
def _evaluate(model, dataset, name: str, step, batch_size: int, device, show_progress: bool, collate_fn) -> dict:
    """The metric `name` of `dataset`, in order, `batch_size` rows at a time, collated (padded) and moved to `device`:
    `step(batch)` gives each batch's `predictions` and `references`. The model's mode is restored afterwards."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import default_data_collator

    start = time.perf_counter()
    metric = load_metric(name)
    device = device if device is not None else next(model.parameters()).device
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn or default_data_collator)
    was_training = model.training
    model.eval()
    try:
        for batch in tqdm(loader, desc=f"eval {name}", disable=not show_progress, dynamic_ncols=True):
            metric.add_batch(**step({key: value.to(device) for key, value in batch.items()}))
        result = metric.compute()
    finally:
        model.train(was_training)
    return dict(result, num_examples=len(dataset), seconds=time.perf_counter() - start)


def evaluate_perplexity(
    model, dataset, batch_size: int = 8, device=None, show_progress: bool = True, collate_fn=None
) -> dict:
    """
    Held-out perplexity through the offline `evaluate` metric
    ([`load_metric`]`("perplexity")`).

    For every example: the summed negative log-likelihood (nats) of its predicted tokens (labels shifted by one,
    `-100` ignored: padding, and the prompt with completion-only loss) and their count go to the metric, which
    returns `exp(sum(nll) / sum(tokens))`. The model's mode (train / eval) is restored afterwards.

    Args:
        collate_fn (`Callable`, *optional*):
            Batch collator for rows of different lengths (e.g. [`~transformers.DataCollatorForSeq2Seq`], which pads
            `labels` with `-100`); defaults to [`~transformers.default_data_collator`] (equal-length rows).

    Returns:
        `dict`: `perplexity`, `mean_nll`, `num_tokens` (from the metric), `num_examples` and `seconds`.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: a held-out loss is not finite (a run that diverged): no perplexity to report.
    """

    def step(batch):
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        logits = model(input_ids=input_ids, attention_mask=batch.get("attention_mask")).logits.float()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none"
        ).sum(-1)
        if not torch.isfinite(nll).all():
            raise RecipeError(
                f"the held-out loss is not finite ({nll[~torch.isfinite(nll)][0].item()}): the model's weights "
                "overflowed. After training, the learning rate was too high for this model: lower learning_rate "
                "(or the ratios of grpo_lr_ratios); before it, the model does not run in this dtype (try float32)."
            )
        return {"predictions": nll.double().cpu().tolist(), "references": (shift_labels != -100).sum(-1).tolist()}

    return _evaluate(model, dataset, "perplexity", step, batch_size, device, show_progress, collate_fn)


def evaluate_accuracy(
    model, dataset, batch_size: int = 8, device=None, show_progress: bool = True, collate_fn=None
) -> dict:
    """
    Held-out accuracy of a sequence classifier through the offline `evaluate` metric
    ([`load_metric`]`("accuracy")`): the predicted class is the argmax of the logits. The mean
    cross-entropy of the true class is returned too. The model's mode (train / eval) is restored afterwards.

    Args:
        collate_fn (`Callable`, *optional*):
            Batch collator (e.g. [`~transformers.DataCollatorWithPadding`]); defaults to
            [`~transformers.default_data_collator`].

    Returns:
        `dict`: `accuracy`, `eval_loss` (mean cross-entropy), `num_examples` and `seconds`.
    """
    losses = []  # (summed cross-entropy, rows) of each batch

    def step(batch):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        losses.append((torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item(), labels.numel()))
        return {"predictions": logits.argmax(-1).cpu().tolist(), "references": labels.cpu().tolist()}

    result = _evaluate(model, dataset, "accuracy", step, batch_size, device, show_progress, collate_fn)
    return dict(result, eval_loss=sum(loss for loss, _ in losses) / max(sum(n for _, n in losses), 1))


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """
    Reset the peak-memory counter [`~grpo_hf.cost.peak_memory_bytes`] reads, so that a run's peak is its own:
    `torch.cuda.reset_peak_memory_stats` on CUDA; on Linux the process's peak RSS (`ru_maxrss`, `VmHWM`) through
    `/proc/self/clear_refs`. Returns whether it could (elsewhere the peak is the process's since it started).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def evaluate_quality(model, prepared: Prepared, args) -> dict[str, Any]:
    """
    The held-out quality of `model`: accuracy and mean loss for a classifier
    ([`evaluate_accuracy`]), else perplexity
    ([`evaluate_perplexity`], on the tokens whose label is not `-100`).
    """
    evaluate = evaluate_accuracy if prepared.task == "sequence_classification" else evaluate_perplexity
    return evaluate(
        model,
        prepared.eval_dataset,
        args.per_device_eval_batch_size,
        show_progress=not args.disable_tqdm,
        collate_fn=prepared.collator,
    )


def quality_fields(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The row keys of a run's quality: perplexity and mean NLL, or accuracy and eval loss, before and after."""
    if "accuracy" in after:
        return {
            "accuracy_before": before["accuracy"],
            "accuracy_after": after["accuracy"],
            "eval_loss_before": before["eval_loss"],
            "eval_loss_after": after["eval_loss"],
            "eval_examples": after["num_examples"],
            "eval_seconds": after["seconds"],
        }
    return {
        "perplexity_before": before["perplexity"],
        "perplexity_after": after["perplexity"],
        "mean_nll_before": before["mean_nll"],
        "mean_nll_after": after["mean_nll"],
        "eval_tokens": after["num_tokens"],
        "eval_seconds": after["seconds"],
    }


# --------------------------------------------------------------------------------------------------------------
# Callbacks of a measured run
# --------------------------------------------------------------------------------------------------------------


class CommBytesCallback(TrainerCallback):
    """
    Bytes one worker sends at every optimizer step of this `train()` call (`per_step`, from step `first_step`): a
    constant for the dense baseline (`bytes_per_step`), or the growth of GRPO's codec counter
    (`comm_state.totals()["bytes_sent"]`, which a resumed run restores from its checkpoint); and what the run had
    counted when the call began (`bytes_before`, `tokens_before`: a resumed run's checkpoint), so that its totals
    cover the whole run and its rates this call.
    """

    def __init__(self, bytes_per_step: float | None = None, comm_state=None, cost=None):
        self.bytes_per_step = bytes_per_step
        self.comm_state = comm_state
        self.cost = cost  # the run's CostCallback: the tokens it had counted when this call began
        self.per_step: list[float] = []
        self.first_step = 1  # the optimizer step of `per_step[0]` (after the checkpoint's, in a resumed run)
        self.bytes_before = 0.0  # bytes of the steps before this call (a resumed run's checkpoint)
        self.tokens_before = 0.0
        self._seen = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        # After the trainer's own callbacks (GRPOTrainer's restores a checkpoint's counted totals): count from them.
        self.first_step = state.global_step + 1
        if self.comm_state is not None:
            self._seen = self.bytes_before = float(self.comm_state.totals()["bytes_sent"])
        else:
            self.bytes_before = float(self.bytes_per_step or 0.0) * state.global_step
        counted = self.cost.counted_metrics() if self.cost is not None else {}
        self.tokens_before = float(counted.get("cost/tokens") or 0.0)

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
# Runner
# --------------------------------------------------------------------------------------------------------------


def _cost_per_quality(cost_per_quality, total_usd: float | None, after: dict[str, Any]) -> float | None:
    """
    `total_usd * perplexity` or `total_usd / accuracy`; `None` for a diverged run, an accuracy of 0, or a resumed
    run that had nothing left to train (no cost).
    """
    if total_usd is None:
        return None
    if "accuracy" in after:
        return cost_per_quality(total_usd, accuracy=after["accuracy"]) if after["accuracy"] > 0 else None
    return cost_per_quality(total_usd, perplexity=after["perplexity"]) if math.isfinite(after["perplexity"]) else None


def check_train_batches(rows: int, args) -> None:
    """
    Refuse, before the model is loaded, train data that fills no batch: with `dataloader_drop_last`, fewer rows per
    process than `per_device_train_batch_size` leave the Trainer an empty epoch, and it trains zero steps without a
    word (a report of "train loss 0").

    Raises:
        [`~grpo_hf.errors.RecipeError`]: naming the row count and the fields to change.
    """
    per_process = math.ceil(rows / max(args.world_size, 1))
    if args.dataloader_drop_last and per_process < args.train_batch_size:
        raise RecipeError(
            f"the train data has {rows} row(s) ({per_process} per process), fewer than one batch of "
            f"{args.train_batch_size} (per_device_train_batch_size), and dataloader_drop_last=True drops it: no step "
            "would train. Lower per_device_train_batch_size, add rows, or set dataloader_drop_last: false."
        )


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

    1. builds the tokenizer and the datasets ([`~grpo_hf.harness.data.prepare`]: your data, or the Python standard
       library corpus), unless `prepared` holds them;
    2. loads the model ([`~grpo_hf.harness.models.build_model`]: a causal LM, or a classifier for
       `task="sequence_classification"`) and wraps it with a LoRA adapter (`lora_r > 0`), the adapter initialized
       from the run's seed, so both trainers of a comparison start from the same weights;
    3. evaluates the held-out quality with the offline `evaluate` metrics: perplexity
       ([`evaluate_perplexity`], on the completion tokens with completion-only loss) or
       accuracy ([`evaluate_accuracy`]), unless `prepared` holds it;
    4. trains with the plain `Trainer` (a plain `TrainingArguments` built from the same values, so no GRPO field can
       influence it) or with `GRPOTrainer`, measuring cost with a [`~grpo_hf.CostCallback`];
    5. evaluates again and collects the logs, the bytes communicated per step and the cost figures.

    Bytes communicated on one process: nothing is sent, so both rows count what one of `W` workers would send per
    optimizer step (`W = cost_num_workers`, else 2): the baseline a dense fp32 ring all-reduce of every trainable
    gradient, `2 (W - 1) / W * 4 * trainable_params`; GRPO what its compression codec (applied locally, with error
    feedback) would send ([`~grpo_hf.compression.hook.compress_locally`]). Under DDP (`torchrun`, `accelerate
    launch`), `W` is the world size and GRPO's bytes are those its hook sent; the row records `world_size`,
    `ddp_wrapped` (the trainer's model is a `DistributedDataParallel`) and `hook_calls` / `hook_steps`.

    Args:
        model_args ([`ModelArguments`]), data_args ([`DataArguments`]), args ([`~grpo_hf.GRPOConfig`]):
            The recipe. The plain `Trainer` gets
            [`plain_training_arguments`]`(args)`; the cost settings (`cost_*`)
            price both runs alike.
        trainer_kind (`str`, *optional*, defaults to `"grpo"`):
            `"trainer"` or `"grpo"`.
        prepared ([`Prepared`], *optional*):
            Tokenizer, datasets and the quality before training, shared by the runs of a comparison; built when
            missing (and the quality before measured when it holds none; `prepared` itself is left as it is).
        progress (`Callable[[str], None]`, *optional*, defaults to `print`):
            Receives one line per phase (`"loading model"`, `"evaluating before"`, `"training Trainer"`, ...).
        output_dir (`str`, *optional*):
            The trainer's `output_dir` (checkpoints); defaults to `args.output_dir`.
        save_model (`bool`, *optional*, defaults to `False`):
            Save the trained model (the adapter with LoRA) and the tokenizer into the trainer's `output_dir`.

    Returns:
        `dict`: one row of the comparison: `name`, `label`, perplexity before/after (causal LM) or accuracy
        before/after and eval loss (classification), `train_seconds`, `tokens_per_second`, `peak_memory_gb`, `comm_*`
        (bytes one worker sends), `energy_kwh`, dollars, `cost_per_quality` (`total_usd * perplexity_after`, or
        `total_usd / accuracy_after`), the loss curve, the per-group LR multipliers, the bytes of every step of this
        call (`bytes_per_step`, from step `bytes_first_step`), the cost assumptions and the distributed set-up. A run
        resumed from a checkpoint (`resume_from_checkpoint`) counts `tokens` and bytes from step 1 and times this call
        (`train_tokens`: its tokens); its `resumed` says from where, the settings changed and applied, the codec of
        each part and the learning rate the schedule followed ([`~grpo_hf.checkpoints.resume_changes`]).
    """
    return _run_training(model_args, data_args, args, trainer_kind, prepared, progress, output_dir, save_model)[0]


def _run_training(model_args, data_args, args, kind, prepared, progress, output_dir, save_model):
    """[`run_training`]'s phases; returns the row and the quality before training (measured if `prepared` had none)."""
    if kind not in TRAINER_KINDS:
        raise ValueError(f"trainer_kind={kind!r}: use one of {TRAINER_KINDS}.")
    label = LABELS[kind]
    if prepared is None:
        prepared = prepare(model_args, data_args, progress)
    check_train_batches(len(prepared.train_dataset), args)
    output_dir = output_dir or args.output_dir
    args = dataclasses.replace(args, output_dir=output_dir)
    if kind == "grpo":  # the report plots each group's learning rate (its printed lines stay compact)
        args.grpo_log_groups = True
    if args.include_num_input_tokens_seen == "no":  # the plain Trainer's token count, for tokens/s
        args.include_num_input_tokens_seen = "all"

    report_progress(progress, f"loading model ({label})")
    model = _fresh_model(model_args, data_args, args, prepared)
    eval_before = prepared.eval_before
    if eval_before is None:
        report_progress(progress, "evaluating before")
        eval_before = evaluate_quality(model, prepared, args)
    run = _measured_trainer(kind, args, model, prepared, data_args.seq_len)
    timing = _train(run, kind, args, output_dir, progress, label)
    report_progress(progress, f"evaluating after ({label})")
    eval_after = evaluate_quality(model, prepared, args)
    if save_model:
        run.trainer.save_model(output_dir)
    row = _row(run, kind, args, timing, quality_fields(eval_before, eval_after), eval_after)
    run.trainer.accelerator.free_memory()
    del run, model
    gc.collect()
    return jsonable(row), eval_before


def _fresh_model(model_args, data_args, args, prepared: Prepared):
    """The recipe's model, loaded afresh from the run's seed (a classifier with its class names), on the device."""
    model, _ = build_model(model_args, data_args, seed=args.seed, tokenizer=prepared.tokenizer, labels=prepared.labels)
    return model.to(args.device)


@dataclasses.dataclass
class _MeasuredTrainer:
    """A run's trainer with what measures it: its cost callback, the bytes recorder and the workers counted."""

    trainer: Any
    cost: Any
    recorder: CommBytesCallback
    world: int
    comm_mode: str
    trainable: int
    total_params: int


def _measured_trainer(kind: str, args, model, prepared: Prepared, seq_len: int) -> _MeasuredTrainer:
    """[`make_trainer`] with a [`CommBytesCallback`] and a compact progress line."""
    from ..cost import CostSettings

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    world = comm_workers(args, CostSettings.from_args(args))
    if kind == "trainer":
        recorder = CommBytesCallback(dense_allreduce_bytes(trainable, world))
        trainer, cost, world = make_trainer(kind, args, model, prepared, seq_len=seq_len, callbacks=[recorder])
        comm_mode = f"dense fp32 all-reduce (W={world})"
    else:
        recorder = CommBytesCallback()
        trainer, cost, world = make_trainer(kind, args, model, prepared, callbacks=[recorder])
        comm_state = trainer.grpo_comm_state
        recorder.comm_state = comm_state
        if comm_state is None:
            recorder.bytes_per_step = dense_allreduce_bytes(trainable, world)
        codes = dict.fromkeys(code_for(spec).describe() for spec in trainer.grpo_plan.values() if spec is not None)
        comm_mode = (  # the codes as they describe themselves: "bits 8", "top 64 of every 4096, bits 2", ...
            f"{trainer.grpo_compression} ({', '.join([comm_state.mode, f'W={world}', *codes, 'error feedback'])})"
            if comm_state is not None
            else f"dense fp32 all-reduce (W={world}, grpo_compression={trainer.grpo_compression})"
        )
    recorder.cost = cost
    _use_compact_progress(trainer)
    return _MeasuredTrainer(trainer, cost, recorder, world, comm_mode, trainable, total_params)


_MISSING_KEYS = "There were missing keys in the checkpoint model loaded:"


class _TiedWeightsNote(logging.Filter):
    """Adds to the Trainer's "missing keys" warning of a resume which of the keys are tied weights (restored through
    their twin: see [`~grpo_hf.checkpoints.tied_missing_keys`]), so that it does not read as a failure."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_MISSING_KEYS):
            with contextlib.suppress(ValueError, SyntaxError):
                keys = ast.literal_eval(message[len(_MISSING_KEYS) :].strip().rstrip("."))
                tied = tied_missing_keys(self.model, keys)
                if tied:
                    twins = ", ".join(f"{key} is tied to {twin}" for key, twin in tied.items())
                    whole = len(tied) == len(keys)
                    record.msg = (
                        f"{message} (grpo-hf: {twins}, which the checkpoint holds: safetensors saves a shared tensor "
                        f"once, and the resume restored it with its twin{': nothing is missing' if whole else ''}.)"
                    )
                    record.args = ()
        return True


def _train(run: _MeasuredTrainer, kind: str, args, output_dir: str, progress, label: str) -> dict[str, Any]:
    """
    Train (resuming as the recipe says) and time it: the train output, wall seconds, load average, memory reset, and
    for a resumed run what it resumed ([`~grpo_hf.checkpoints.resume_changes`], read before training).
    """
    # The checkpoint is resolved here for both trainers (the plain Trainer does not know "last"), and GRPOTrainer gets
    # the folder, so that its settings can be compared and named in the report.
    checkpoint = resolve_resume_checkpoint(output_dir, args.resume_from_checkpoint, grpo=kind == "grpo")
    resumed = None
    if checkpoint is not None:
        comm_state = getattr(run.trainer, "grpo_comm_state", None)
        mode = comm_state.mode if comm_state is not None else None
        resumed = resume_changes(checkpoint, run.trainer.args, comm_mode=mode if kind == "grpo" else None)
    memory_reset = reset_peak_memory(args.device)
    report_progress(progress, f"training {label}" + (f" (resuming {checkpoint})" if checkpoint else ""))
    trainer_logger, note = logging.getLogger("transformers.trainer"), _TiedWeightsNote(run.trainer.model)
    trainer_logger.addFilter(note)  # for this train() call
    start = time.perf_counter()
    try:
        output = run.trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        trainer_logger.removeFilter(note)
    wall = time.perf_counter() - start
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "output": output,
        "wall": wall,
        "load_average": load_average,
        "memory_reset": memory_reset,
        "resumed": resumed,
    }


def _resumed_record(trainer, resumed: dict | None) -> dict | None:
    """What a report says of a resumed run: the checkpoint, its step, the settings changed and applied, the codec of
    each part, and the learning rate the schedule followed (the scheduler's after training: the checkpoint's)."""
    if resumed is None:
        return None
    scheduler = getattr(trainer, "lr_scheduler", None)
    rates = [float(r) for r in getattr(scheduler, "base_lrs", None) or []]
    schedule = max(rates) if rates else resumed["learning_rate"]["schedule"]
    return {
        "checkpoint": resumed["checkpoint"],
        "step": resumed["step"],
        "applied": resumed["applied"],
        "codec": resumed["codec"],
        "settings_known": resumed["settings"] is not None,
        "learning_rate": {"schedule": schedule, "requested": resumed["learning_rate"]["requested"]},
    }


def _row(run: _MeasuredTrainer, kind: str, args, timing: dict, quality: dict, eval_after: dict) -> dict[str, Any]:
    """One row of the comparison (see [`run_training`])."""
    from torch.nn.parallel import DistributedDataParallel

    from ..cost import CostSettings, comm_time_seconds, cost_per_quality
    from ..optim.builder import state_nbytes

    trainer, world, trainable = run.trainer, run.world, run.trainable
    summary = run.cost.summary()
    metrics = summary["metrics"]
    history = [dict(h) for h in trainer.state.log_history]
    loss_curve = [(h["step"], h["loss"]) for h in history if "loss" in h]

    def per_group(prefix: str) -> dict[str, list]:  # `{group: [(step, value), ...]}` of the logged `<prefix><group>`
        series: dict[str, list] = {}
        for h in history:
            for key in (k for k in h if k.startswith(prefix)):
                series.setdefault(key.removeprefix(prefix), []).append((h["step"], h[key]))
        return series

    comm_bytes = run.recorder.bytes_before + float(sum(run.recorder.per_step))  # the whole run's, resumed or not
    steps = trainer.state.global_step
    row: dict[str, Any] = {
        "name": kind,
        "label": LABELS[kind],
        **quality,
        "train_loss": loss_curve[-1][1] if loss_curve else timing["output"].training_loss,
        "train_loss_mean": timing["output"].training_loss,
        "steps": steps,
        "train_seconds": metrics.get("cost/train_seconds", timing["wall"]),
        "train_wall_seconds": timing["wall"],
        "tokens": metrics.get("cost/tokens"),
        # this train() call's (a resumed run counts `tokens` from step 1, and times only this call)
        "train_tokens": metrics["cost/tokens"] - run.recorder.tokens_before if "cost/tokens" in metrics else None,
        "tokens_per_second": metrics.get("cost/tokens_per_second"),
        "peak_memory_gb": metrics.get("cost/peak_memory_gb"),
        "peak_memory_reset": timing["memory_reset"],
        "optimizer_state_bytes": sum(state_nbytes(trainer.optimizer).values()) if trainer.optimizer else None,
        # 1-minute load average at the end of training: above the core count, other processes shared the CPUs and
        # the times (and the estimated energy and cost) are inflated.
        "load_average": timing["load_average"],
        "trainable_params": trainable,
        "total_params": run.total_params,
        "comm_mode": run.comm_mode,
        "comm_workers": world,
        "comm_bytes": comm_bytes,
        "comm_bytes_per_step": comm_bytes / steps if steps else 0.0,
        "comm_bytes_dense_fp32": dense_allreduce_bytes(trainable, world) * steps,
        "comm_seconds_projected": comm_time_seconds(comm_bytes, CostSettings.from_args(args).cost_link_gbps),
        "energy_kwh": metrics.get("cost/energy_kwh"),
        "energy_source": metrics.get("cost/energy_source"),
        "energy_estimated": bool(metrics.get("cost/energy_estimated")),
        "gpu_usd": metrics.get("cost/gpu_usd"),
        "energy_usd": metrics.get("cost/energy_usd"),
        "cooling_usd": metrics.get("cost/cooling_usd"),
        "total_usd": metrics.get("cost/total_usd"),
        "cost_per_quality": _cost_per_quality(cost_per_quality, metrics.get("cost/total_usd"), eval_after),
        "loss_curve": loss_curve,
        # GRPOTrainer's: the learning rate the optimizer used per group, and the importance multipliers it applied
        "learning_rates": per_group("grpo/lr/"),
        "lr_scales": per_group("grpo/lr_scale/"),
        "importance_applied": kind == "grpo" and bool(args.grpo_importance),
        "bytes_per_step": list(run.recorder.per_step),
        "bytes_first_step": run.recorder.first_step,
        "resumed": _resumed_record(trainer, timing.get("resumed")),
        "cost_assumptions": summary["assumptions"],
        "world_size": exchanging_workers(args),
        "ddp_wrapped": isinstance(trainer.model_wrapped, DistributedDataParallel),
    }
    if kind == "grpo":
        row["groups"] = {g.name: g.numel for g in trainer.grpo_groups}
        if trainer.grpo_comm_state is not None:
            row["comm_totals"] = trainer.grpo_comm_state.totals()
            row["hook_calls"] = trainer.grpo_comm_state.hook_calls
            row["hook_steps"] = trainer.grpo_comm_state.step
            row["comm_ratio_fp32"] = row["comm_bytes_dense_fp32"] / comm_bytes if comm_bytes else None
    else:
        row["comm_ratio_fp32"] = 1.0
    return row


# --------------------------------------------------------------------------------------------------------------
# The timed windows of the noise measurement
# --------------------------------------------------------------------------------------------------------------


def _timed_window(model_args, data_args, args, kind: str, prepared, steps: int, output_dir: str) -> dict:
    """Train a fresh model for `steps` optimizer steps with `kind`'s trainer and return what it cost (no evaluation)."""
    args = dataclasses.replace(
        args,
        output_dir=output_dir,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        push_to_hub=False,
        disable_tqdm=True,
    )
    if args.include_num_input_tokens_seen == "no":
        args.include_num_input_tokens_seen = "all"
    model = _fresh_model(model_args, data_args, args, prepared)
    trainer, cost, _ = make_trainer(kind, args, model, prepared, seq_len=data_args.seq_len)  # as the full run's
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics = cost.summary()["metrics"]
    window = {key: metrics.get(f"cost/{key}") for key in ("train_seconds", "tokens", "energy_kwh", "total_usd")}
    # Every figure of a window covers the whole window: its throughput too (the cost callback's rate leaves out the
    # first steps), so that the window's tokens/s, time and money ratios agree.
    seconds, tokens = window["train_seconds"], window["tokens"]
    window["tokens_per_second"] = tokens / seconds if tokens and seconds else None
    window["tokens_per_second_steady"] = metrics.get("cost/tokens_per_second")
    window["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return window


def measure_timing_noise(
    model_args,
    data_args,
    args,
    prepared,
    rounds: int = 2,
    steps: int = 4,
    progress: Callable[[str], None] | None = None,
    kinds: tuple[str, ...] = ("trainer", "grpo"),
) -> dict[str, Any]:
    """
    Time short windows of both trainers, interleaved, to measure the noise of a comparison's timed ratios.

    Each round trains a fresh model for `steps` optimizer steps with each trainer (same data, seed and settings as
    the full runs, no evaluation), in the order `T G` in even rounds and `G T` in odd ones, so that a steady drift of
    the machine's load falls on both trainers alike. [`~grpo_hf.harness.table.timed_ratio_noise`] turns the windows
    into one noise band per ratio.

    Args:
        model_args ([`~grpo_hf.harness.arguments.ModelArguments`]), data_args ([`~grpo_hf.harness.arguments.DataArguments`]),
        args ([`~grpo_hf.GRPOConfig`]):
            The recipe of the comparison; window checkpoints go to `<output_dir>/noise/<kind>`.
        prepared ([`~grpo_hf.harness.data.Prepared`]):
            The tokenizer and datasets of the comparison.
        rounds (`int`, *optional*, defaults to `2`), steps (`int`, *optional*, defaults to `4`):
            Rounds of windows and optimizer steps per window.
        progress (`Callable[[str], None]`, *optional*):
            Receives one line per window.

    Returns:
        `dict`: `method`, `rounds`, `window_steps`, `seconds` (wall time of the measurement) and `windows` (one entry
        per window: `round`, `name`, `train_seconds`, `tokens`, `tokens_per_second` (`tokens / train_seconds`: the
        whole window, as its time and money), `tokens_per_second_steady` (after the cost callback's warm-up steps),
        `energy_kwh`, `total_usd`, `load_average`).
    """
    start = time.perf_counter()
    windows = []
    for index in range(rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            report_progress(progress, f"timing window {index + 1}/{rounds} ({LABELS[kind]}, {steps} steps)")
            output_dir = os.path.join(args.output_dir, "noise", kind)
            window = _timed_window(model_args, data_args, args, kind, prepared, steps, output_dir)
            windows.append({"round": index, "name": kind, **window})
    return jsonable(
        {
            "method": METHOD,
            "rounds": rounds,
            "window_steps": steps,
            "seconds": time.perf_counter() - start,
            "windows": windows,
        }
    )


# --------------------------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------------------------


def compare(
    model_args: ModelArguments,
    data_args: DataArguments,
    args,
    progress: Callable[[str], None] | None = print,
    kinds: tuple[str, ...] = TRAINER_KINDS,
) -> dict[str, Any]:
    """
    Train the plain `Trainer` and `GRPOTrainer` on identical data, seed and steps and compare them.

    The tokenizer, the datasets and the quality before training (perplexity or accuracy) are computed once; each
    run loads the model afresh (same weights, same LoRA initialization). Each run's checkpoints and trained model (the
    adapter with LoRA, and the tokenizer: what `grpo-hf publish` uploads) go to `<output_dir>/<kind>`. Then, with
    `cost_noise_rounds > 0`, [`measure_timing_noise`] times interleaved windows of both trainers
    (checkpoints in `<output_dir>/noise`).

    Returns:
        `dict`: `runs` (one row per trainer, see [`run_training`]), `ratios` (GRPOTrainer / Trainer per metric, see
        [`~grpo_hf.harness.table.compute_ratios`]; the timed ones measured by the interleaved windows when there are
        some: the full runs always train the Trainer first), `ratios_full_runs` (every ratio of the full runs),
        `timing_noise` (the windows) and `ratio_noise` (the headline, the range of the windows and a `within_noise` flag
        per timed ratio, see [`~grpo_hf.harness.table.timed_ratio_noise`]), `recipe`, `data`
        (corpus fingerprint, `sys.version`, sizes), `environment` and `wall_seconds`.
    """
    start = time.perf_counter()
    prepared = prepare(model_args, data_args, progress)
    runs = []
    for kind in kinds:
        output_dir = os.path.join(args.output_dir, kind)
        row, eval_before = _run_training(model_args, data_args, args, kind, prepared, progress, output_dir, True)
        prepared = dataclasses.replace(prepared, eval_before=eval_before)  # measured once, shared by the next runs
        runs.append(row)
    by_name = {r["name"]: r for r in runs}
    full_runs = compute_ratios(by_name["trainer"], by_name["grpo"]) if len(by_name) == 2 else {}
    rounds = getattr(args, "cost_noise_rounds", 0) if full_runs else 0
    timing_noise = (
        measure_timing_noise(
            model_args, data_args, args, prepared, rounds, getattr(args, "cost_noise_window_steps", 4), progress
        )
        if rounds
        else None
    )
    noise = timed_ratio_noise({"ratios": full_runs, "timing_noise": timing_noise})
    ratios = headline_ratios(full_runs, noise)  # timed ones: the interleaved windows', not the full runs'
    if full_runs and timing_noise is None:  # the full runs' throughput over the time of their time row
        whole = [whole_run_throughput(by_name[name]) for name in ("trainer", "grpo")]
        ratios["tokens_per_second"] = whole[1] / whole[0] if None not in whole else None
    resumed = next((r.get("resumed") for r in reversed(runs) if r.get("resumed")), None)
    return {
        "runs": runs,
        "ratios": ratios,
        "ratios_full_runs": full_runs,
        "timing_noise": timing_noise,
        "ratio_noise": jsonable(noise),
        "recipe": recipe_summary(model_args, data_args, args, resumed=resumed),
        "data": jsonable(prepared.data_info),
        "eval_before": jsonable(prepared.eval_before),
        "environment": capture_environment(),
        "wall_seconds": time.perf_counter() - start,
    }


__all__ = [
    "AVAILABLE_METRICS",
    "CommBytesCallback",
    "CompactProgressCallback",
    "LABELS",
    "METRICS_DIR",
    "TRAINER_KINDS",
    "check_train_batches",
    "comm_workers",
    "compare",
    "evaluate_accuracy",
    "evaluate_perplexity",
    "evaluate_quality",
    "load_metric",
    "make_trainer",
    "measure_timing_noise",
    "metric_path",
    "plain_training_arguments",
    "quality_fields",
    "recipe_summary",
    "reset_peak_memory",
    "run_training",
]
