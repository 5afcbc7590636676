"""
The PNG plots of a report ([`~grpo_hf.harness.report.write_report`]): loss curves, the learning rate GRPO used per group,
bytes sent per step, and the ratios GRPOTrainer / Trainer with their noise bands. matplotlib's Agg backend draws them
(no display needed), and each file is written whole or not at all ([`~grpo_hf.files.atomic_write`]).

Example:

```python
>>> from grpo_hf.harness.plots import write_plots
>>> write_plots(results, "runs/quickstart")  # loss_curves.png, learning_rates.png, bytes_per_step.png, ratios.png
```
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..files import atomic_write
from .table import TABLE_ROWS, WITHIN_NOISE


PLOT_FILES = {
    "loss": "loss_curves.png",
    "learning_rates": "learning_rates.png",
    "bytes": "bytes_per_step.png",
    "ratios": "ratios.png",
}


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_write(path, "wb") as handle:  # a crash leaves the old plot or none, never half a PNG
        fig.savefig(handle, format="png")
    return path


def plot_loss_curves(runs: list[dict], path: str | Path) -> Path:
    """Training loss against the optimizer step, one line per run."""
    fig, ax = _figure("Training loss", "optimizer step", "loss")
    for run in runs:
        curve = run.get("loss_curve") or []
        if curve:
            ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", markersize=3, label=run["label"])
    ax.legend()
    return _save(fig, Path(path))


def plot_learning_rates(runs: list[dict], path: str | Path) -> Path:
    """
    The learning rate GRPOTrainer's optimizer used for each group (`grpo/lr/<group>`) against the optimizer step; the
    title says whether importance multipliers were applied ("importance off: not applied" when they were not).
    """
    applied = any(run.get("importance_applied") for run in runs)
    title = "GRPOTrainer: learning rate used per group"
    title += "\nimportance multipliers applied" if applied else "\nimportance off: not applied"
    fig, ax = _figure(title, "optimizer step", "learning rate")
    plotted = False
    for run in runs:
        for group, points in sorted((run.get("learning_rates") or {}).items()):
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=group)
            plotted = True
    if plotted:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no learning rates logged", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, Path(path))


def plot_bytes_per_step(runs: list[dict], path: str | Path) -> Path:
    """Bytes one worker sends at every optimizer step, one line per run (log scale when they differ a lot)."""
    fig, ax = _figure("Bytes sent per worker per step", "optimizer step", "bytes (MB)")
    values = []
    for run in runs:
        series = run.get("bytes_per_step") or []
        if series:
            ax.plot(range(1, len(series) + 1), [b / 1e6 for b in series], marker=".", label=run["label"])
            values += [b for b in series if b > 0]
    if values and max(values) / min(values) > 20:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.legend()
    return _save(fig, Path(path))


def plot_ratios(results: dict[str, Any], path: str | Path) -> Path:
    """
    Every ratio GRPOTrainer / Trainer of the table on a log axis: exact ratios as dots, timed ratios with their noise
    band as a bar, grayed and labeled "within noise" when inside it.
    """
    labels = {key: label for key, label, _ in TABLE_ROWS}
    ratios = results.get("ratios") or {}
    noise = results.get("ratio_noise") or {}
    keys = [key for key, *_ in TABLE_ROWS if isinstance(ratios.get(key), (int, float)) and ratios[key] > 0]
    fig, ax = _figure("GRPOTrainer / Trainer", "ratio (log scale; below 1: GRPOTrainer needs less)", "")
    fig.set_size_inches(7, 0.35 * len(keys) + 1.6)
    for y, key in enumerate(reversed(keys)):
        ratio, entry = ratios[key], noise.get(key) or {}
        within = entry.get("within_noise")
        color = "grey" if within else ("tab:blue" if within is None else "tab:red")
        if entry.get("band") and within is not None:
            ax.plot(entry["band"], [y, y], color=color, linewidth=5, alpha=0.35, solid_capstyle="butt")
        ax.plot([ratio], [y], "o", color=color)
        text = f"{ratio:.3f}" + (f"  {WITHIN_NOISE}" if within else "")
        ax.annotate(text, (ratio, y), textcoords="offset points", xytext=(6, 4), fontsize=7, color=color)
    ax.set_yticks(range(len(keys)), [labels[k] for k in reversed(keys)], fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    if keys:
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

        values = [ratios[k] for k in keys] + [b for k in keys for b in ((noise.get(k) or {}).get("band") or [])]
        span = max(abs(math.log10(v)) for v in values) + 0.1
        ax.set_xscale("log")
        ax.set_xlim(10**-span, 10**span)
        ticks = [
            t
            for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 0.8, 1, 1.25, 2, 5, 10, 20, 50, 100)
            if abs(math.log10(t)) < span
        ]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.text(
        0.01,
        0.005,
        "Bars: noise band of a timed ratio (grey: within noise, red: outside it). Blue: exact or untimed.",
        fontsize=6,
        va="bottom",
    )
    return _save(fig, Path(path))


def write_plots(results: dict[str, Any], output_dir: str | Path) -> dict[str, str]:
    """
    Write the PNG plots into `output_dir`; returns their paths by kind (`loss`, `learning_rates`, `bytes`, and `ratios`
    for a comparison).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    grpo_runs = [r for r in runs if r.get("name") == "grpo"]
    paths = {
        "loss": str(plot_loss_curves(runs, output_dir / PLOT_FILES["loss"])),
        "learning_rates": str(plot_learning_rates(grpo_runs, output_dir / PLOT_FILES["learning_rates"])),
        "bytes": str(plot_bytes_per_step(runs, output_dir / PLOT_FILES["bytes"])),
    }
    if results.get("ratios"):
        paths["ratios"] = str(plot_ratios(results, output_dir / PLOT_FILES["ratios"]))
    return paths


__all__ = [
    "PLOT_FILES",
    "plot_bytes_per_step",
    "plot_learning_rates",
    "plot_loss_curves",
    "plot_ratios",
    "write_plots",
]
