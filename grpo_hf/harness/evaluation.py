"""Evaluation and measurement helpers of a run: held-out perplexity or accuracy, and a peak-memory counter reset."""

import time

import torch

from ..errors import RecipeError


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
    ([`~grpo_hf.harness.metrics.load_metric`]`("perplexity")`).

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
    from .metrics import load_metric

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
    ([`~grpo_hf.harness.metrics.load_metric`]`("accuracy")`): the predicted class is the argmax of the logits. The mean
    cross-entropy of the true class is returned too. The model's mode (train / eval) is restored afterwards.

    Args:
        collate_fn (`Callable`, *optional*):
            Batch collator (e.g. [`~transformers.DataCollatorWithPadding`]); defaults to
            [`~transformers.default_data_collator`].

    Returns:
        `dict`: `accuracy`, `eval_loss` (mean cross-entropy), `num_examples` and `seconds`.
    """
    from .metrics import load_metric

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


__all__ = ["evaluate_accuracy", "evaluate_perplexity", "reset_peak_memory"]
