"""Held-out quality of a model through the offline `evaluate` metric scripts of `grpo_hf/harness/metrics/`.

- [`load_metric`]: a local metric (`accuracy`, `perplexity`) with `evaluate.load`, offline;
- [`evaluate_perplexity`], [`evaluate_accuracy`]: one pass over a held-out set, the model's mode restored;
- [`evaluate_quality`]: the one of them a prepared task needs, and [`quality_fields`]: its keys in a comparison row.

Example:

```python
>>> from grpo_hf.harness.evaluation import evaluate_perplexity
>>> evaluate_perplexity(model, eval_dataset, batch_size=8)["perplexity"]
```
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RecipeError


if TYPE_CHECKING:
    import evaluate

    from .data import Prepared


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


def _batches(dataset, batch_size: int, collate_fn, device, desc: str, show_progress: bool):
    """The dataset in order, `batch_size` rows at a time, collated (padded) and moved to `device`."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import default_data_collator

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn or default_data_collator)
    for batch in tqdm(loader, desc=desc, disable=not show_progress, dynamic_ncols=True):
        yield {key: value.to(device) for key, value in batch.items()}


@torch.no_grad()
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
    start = time.perf_counter()
    metric = load_metric("perplexity")
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for batch in _batches(dataset, batch_size, collate_fn, device, "eval perplexity", show_progress):
            input_ids = batch["input_ids"]
            labels = batch.get("labels", input_ids)
            logits = model(input_ids=input_ids, attention_mask=batch.get("attention_mask")).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none"
            ).sum(-1)
            counts = (shift_labels != -100).sum(-1)
            if not torch.isfinite(nll).all():
                raise RecipeError(
                    f"the held-out loss is not finite ({nll[~torch.isfinite(nll)][0].item()}): the model's weights "
                    "overflowed. After training, the learning rate was too high for this model: lower learning_rate "
                    "(or the ratios of grpo_lr_ratios); before it, the model does not run in this dtype (try float32)."
                )
            metric.add_batch(predictions=nll.double().cpu().tolist(), references=counts.cpu().tolist())
        result = metric.compute()
    finally:
        model.train(was_training)
    result["num_examples"] = len(dataset)
    result["seconds"] = time.perf_counter() - start
    return result


@torch.no_grad()
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
    start = time.perf_counter()
    metric = load_metric("accuracy")
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0
    try:
        for batch in _batches(dataset, batch_size, collate_fn, device, "eval accuracy", show_progress):
            labels = batch.pop("labels")
            logits = model(**batch).logits.float()
            loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            count += labels.numel()
            metric.add_batch(predictions=logits.argmax(-1).cpu().tolist(), references=labels.cpu().tolist())
        result = metric.compute()
    finally:
        model.train(was_training)
    result["eval_loss"] = loss_sum / max(count, 1)
    result["num_examples"] = len(dataset)
    result["seconds"] = time.perf_counter() - start
    return result


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


__all__ = [
    "AVAILABLE_METRICS",
    "METRICS_DIR",
    "evaluate_accuracy",
    "evaluate_perplexity",
    "evaluate_quality",
    "load_metric",
    "metric_path",
    "quality_fields",
]
