"""Evaluation and measurement helpers of a run: held-out perplexity, and a peak-memory counter reset per run."""

import time

import torch


@torch.no_grad()
def evaluate_perplexity(model, dataset, batch_size: int = 8, device=None, show_progress: bool = True) -> dict:
    """
    Held-out perplexity through the offline `evaluate` metric ([`~grpo_hf.metrics.load_metric`]`("perplexity")`).

    For every example: the summed negative log-likelihood (nats) of its predicted tokens (labels shifted by one,
    `-100` ignored) and their count go to the metric, which returns `exp(sum(nll) / sum(tokens))`. The model's mode
    (train / eval) is restored afterwards.

    Returns:
        `dict`: `perplexity`, `mean_nll`, `num_tokens` (from the metric), `num_examples` and `seconds`.
    """
    from tqdm.auto import tqdm

    from .metrics import load_metric

    start = time.perf_counter()
    metric = load_metric("perplexity")
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        batches = range(0, len(dataset), batch_size)
        for begin in tqdm(batches, desc="eval perplexity", disable=not show_progress, dynamic_ncols=True):
            batch = dataset[begin : begin + batch_size]
            input_ids = torch.as_tensor(batch["input_ids"], device=device)
            labels = torch.as_tensor(batch.get("labels", batch["input_ids"]), device=device)
            attention_mask = batch.get("attention_mask")
            if attention_mask is not None:
                attention_mask = torch.as_tensor(attention_mask, device=device)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none"
            ).sum(-1)
            counts = (shift_labels != -100).sum(-1)
            metric.add_batch(predictions=nll.double().cpu().tolist(), references=counts.cpu().tolist())
        result = metric.compute()
    finally:
        model.train(was_training)
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


__all__ = ["evaluate_perplexity", "reset_peak_memory"]
