"""
The side-by-side table of a comparison: its rows (what each shows and how its values print), the ratios GRPOTrainer /
Trainer, and their cells with the noise verdict. [`~grpo_hf.harness.report`] prints and writes it,
[`~grpo_hf.harness.report.plot_ratios`] draws its ratios, and `grpo-hf publish` puts it on the card of a comparison.

Example:

```python
>>> from grpo_hf.harness.table import markdown_table
>>> print(markdown_table(results))  # results.json of `grpo-hf compare`
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..model_card import format_bytes


WITHIN_NOISE = "within noise"


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:,.{digits}f}"


def _usd(v: float) -> str:
    return f"${v:.4f}" if abs(v) >= 1e-3 else f"${v:.2e}"


# (key of a run's result, row label, formatter). The ratio column is GRPOTrainer / Trainer for every row.
# Rows whose value is missing in every run (accuracy for a language model, perplexity for a classifier) are left out.
TABLE_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("perplexity_before", "Eval perplexity before", _fixed(3)),
    ("perplexity_after", "Eval perplexity after", _fixed(3)),
    ("accuracy_before", "Eval accuracy before", _fixed(4)),
    ("accuracy_after", "Eval accuracy after", _fixed(4)),
    ("eval_loss_after", "Eval loss after", _fixed(4)),
    ("train_loss", "Train loss (last log)", _fixed(4)),
    ("train_seconds", "Training time (s)", _fixed(1)),
    ("tokens_per_second", "Tokens/s", _fixed(0)),
    ("peak_memory_gb", "Peak memory (GB)", _fixed(2)),
    ("comm_bytes", "Bytes sent per worker (total)", format_bytes),
    ("comm_bytes_per_step", "Bytes sent per worker per step", format_bytes),
    ("comm_seconds_projected", "Comm time projected (s)", lambda v: f"{v:.3f}"),
    ("energy_kwh", "Energy (kWh)", lambda v: f"{v:.5f}"),
    ("total_usd", "Cost (USD)", _usd),
    ("cost_per_quality", "Cost per quality (USD x ppl)", _usd),
]


def compute_ratios(baseline: dict[str, Any], grpo: dict[str, Any], keys: list[str] | None = None) -> dict:
    """
    `grpo[key] / baseline[key]` for every table row (or `keys`); `None` where either value is missing, not a finite
    number, or the baseline is 0.
    """
    ratios = {}
    for key in keys or [row[0] for row in TABLE_ROWS]:
        a, b = baseline.get(key), grpo.get(key)
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (a, b))
        ratios[key] = b / a if ok and a != 0 else None
    return ratios


def ratio_cell(ratio: float | None, noise: dict | None = None) -> str:
    """
    The ratio column's text: `"0.141"` for an exact ratio, `"0.730 (within noise)"` for a timed ratio inside its noise
    band, `"0.900 (measured 0.890-0.910)"` for a timed ratio outside it ([`~grpo_hf.harness.noise.classify`]).
    """
    if ratio is None:
        return "-"
    if not noise or noise.get("within_noise") is None:
        return f"{ratio:.3f}"
    if noise["within_noise"]:
        return f"{ratio:.3f} ({WITHIN_NOISE})"
    low, high = noise["band"]
    return f"{ratio:.3f} (measured {low:.3f}-{high:.3f})"


def _cell(formatter, value) -> str:
    if value is None or isinstance(value, str):
        return "-" if value is None else value
    return formatter(value)


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table, as strings (shared by the terminal and markdown tables)."""
    runs = results["runs"]
    header = ["Metric", *[r["label"] for r in runs]]
    ratios = results.get("ratios") or {}
    with_ratio = len(runs) == 2 and bool(ratios)
    if with_ratio:
        header.append(f"{runs[1]['label']} / {runs[0]['label']}")
    rows = []
    for key, label, formatter in TABLE_ROWS:
        if all(r.get(key) is None for r in runs) and ratios.get(key) is None:
            continue  # a metric of another task (accuracy for a causal LM, perplexity for a classifier)
        if key == "energy_kwh" and any(r.get("energy_estimated") for r in runs):
            label = "Energy (kWh, estimated)"
        if key == "cost_per_quality" and any(r.get("accuracy_after") is not None for r in runs):
            label = "Cost per quality (USD / accuracy)"
        if key == "comm_seconds_projected":
            link = runs[0].get("cost_assumptions", {}).get("cost_link_gbps")
            label = f"Comm time projected @ {link:g} Gbit/s (s)" if link else label
        row = [label, *[_cell(formatter, r.get(key)) for r in runs]]
        if with_ratio:
            row.append(ratio_cell(ratios.get(key), (results.get("ratio_noise") or {}).get(key)))
        rows.append(row)
    return header, rows


def markdown_table(results: dict[str, Any]) -> str:
    """The table in GitHub markdown."""
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


__all__ = ["TABLE_ROWS", "WITHIN_NOISE", "compute_ratios", "markdown_table", "ratio_cell", "table_rows"]
