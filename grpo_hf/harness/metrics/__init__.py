"""
Local [`evaluate`](https://huggingface.co/docs/evaluate) metric modules that load offline.

`evaluate` 0.4.6 ships no metric scripts: `evaluate.load("accuracy")` fetches one from the Hub, and the Hub's
`perplexity` downloads and runs GPT-2. The modules here are plain `evaluate.Metric` scripts inside the package, so
`evaluate.load(<path>.py)` works without network:

- `perplexity`: `predictions` are per-example summed token NLLs (nats), `references` the per-example token counts;
  returns `perplexity = exp(sum(nll) / sum(tokens))`, `mean_nll` and `num_tokens`.
- `accuracy`: `predictions` and `references` are class ids; returns `accuracy` (config `"multilabel"`: exact match
  of label lists).

Example:

```python
>>> from grpo_hf.harness.metrics import load_metric
>>> load_metric("perplexity").compute(predictions=[2.0, 4.0], references=[1, 2])["mean_nll"]
2.0
```
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    import evaluate

METRICS_DIR = Path(__file__).resolve().parent
AVAILABLE_METRICS = ("accuracy", "perplexity")

__all__ = ["AVAILABLE_METRICS", "METRICS_DIR", "load_metric", "metric_path"]


def metric_path(name: str) -> str:
    """
    Path of the script of metric `name` (`<package>/metrics/<name>/<name>.py`).

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
