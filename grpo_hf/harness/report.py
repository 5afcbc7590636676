"""
The report of a comparison ([`~grpo_hf.harness.compare.compare`]) or a run: one side-by-side table
([`grpo_hf.harness.table`]; rich in the terminal, markdown in `report.md`), `results.json`, and PNG plots (matplotlib,
Agg backend, no display needed), each file written whole or not at all ([`~grpo_hf.files.atomic_write`]).

Every row of the table is a key of a run's result; the last column is the ratio GRPOTrainer / Trainer
([`~grpo_hf.harness.table.compute_ratios`]): below 1 means GRPOTrainer needed less (time, bytes, money) or reached a
lower perplexity; for tokens/s and accuracy above 1 is better. Ratios that follow from wall-clock time (time, tokens/s,
energy, money) are those of the interleaved timing windows, with their range
([`~grpo_hf.harness.table.timed_ratio_noise`]; the full runs always train the Trainer first): inside their noise they
read "no difference" in the table, the ratio plot and `results.json` (`ratio_noise`); ratios of counted quantities
(bytes, steps) are exact and carry none.

The plots ([`write_plots`]): loss curves, the learning rate GRPO used per group, bytes sent (or, on one process,
projected) per step, and the ratios GRPOTrainer / Trainer coloured better / worse / no difference, with the range of
the timed ones.

Example:

```python
>>> from grpo_hf.harness.report import print_table, write_report
>>> print_table(results)
>>> write_report(results, "runs/quickstart")  # results.json, report.md, loss_curves.png, learning_rates.png, ...
```
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..files import atomic_write
from .table import (
    HIGHER_IS_BETTER,
    NO_DIFFERENCE,
    NOT_MEASURED,
    TABLE_ROWS,
    TIMING_RESOLUTION,
    markdown_table,
    table_rows,
    verdict,
)


RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
PLOT_FILES = {
    "loss": "loss_curves.png",
    "learning_rates": "learning_rates.png",
    "bytes": "bytes_per_step.png",
    "ratios": "ratios.png",
}


def rich_table(results: dict[str, Any], title: str | None = None):
    """The table as a [`rich.table.Table`]."""
    from rich.table import Table

    header, rows = table_rows(results)
    table = Table(title=title or "Trainer vs GRPOTrainer", caption=_caption(results))
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def print_table(results: dict[str, Any], title: str | None = None, console=None) -> None:
    """Print the table to the terminal with rich."""
    from rich.console import Console

    console = console or Console(width=max(120, Console().width))
    console.print(rich_table(results, title))


def _caption(results: dict[str, Any]) -> str:
    runs = results["runs"]
    parts = [f"{r['label']}: {r.get('comm_mode', '')}" for r in runs]
    if any(
        (entry or {}).get("ratio_interleaved") is not None for entry in (results.get("ratio_noise") or {}).values()
    ):
        parts.append(
            "time, tokens/s, energy and cost ratios: interleaved timing windows (the full runs: Trainer first)"
        )
    wall = results.get("wall_seconds")
    if wall is not None:
        parts.append(f"total wall time {wall:.0f} s")
    return "; ".join(parts)


def _describe(results: dict[str, Any]) -> list[str]:
    recipe = results.get("recipe", {})
    model, data, training = recipe.get("model", {}), recipe.get("data", {}), recipe.get("training", {})
    info = results.get("data", {})
    run = results["runs"][0]
    lora = f"LoRA r={model.get('lora_r')}" if model.get("lora_r") else "full fine-tune"
    world = run.get("world_size") or 1
    lines = [
        f"- **Model**: `{model.get('model_name_or_path')}`, {lora}, {run.get('trainable_params', 0):,} trainable of "
        f"{run.get('total_params', 0):,} parameters"
        + (f"; {world}-process DDP (model wrapped: {run.get('ddp_wrapped')})." if world > 1 else "."),
        _describe_data(info, data)
        if info.get("dataset_name")
        else f"- **Data**: Python standard library ({info.get('kind', data.get('corpus'))}), per-file hash split "
        f"({info.get('val_percent')}% held out), corpus fingerprint `{info.get('fingerprint')}`, "
        f"Python `{str(info.get('python_version', '')).split()[0]}`; {info.get('train_tokens', 0):,} train tokens, "
        f"{info.get('eval_tokens', 0):,} held-out tokens, {info.get('seq_len')} tokens per example.",
        f"- **Training**: {training.get('max_steps')} steps x batch {training.get('per_device_train_batch_size')}, "
        f"lr {training.get('learning_rate')} ({training.get('lr_scheduler_type')}), seed {training.get('seed')}; "
        "identical data, seed and steps for both trainers.",
    ]
    return lines


def _describe_data(info: dict[str, Any], data: dict[str, Any]) -> str:
    """The data line of a run on your data: source, format, rows and tokens, fingerprint."""
    masked = ", completion-only loss" if info.get("completion_only_loss") else ""
    labels = f", {info.get('num_labels')} classes {info.get('labels')}" if info.get("labels") else ""
    return (
        f"- **Data**: `{info.get('dataset_name')}` ({info.get('source')}, format `{info.get('format')}`{masked}"
        f"{labels}), fingerprint `{info.get('fingerprint')}`; {info.get('train_rows', 0):,} train rows "
        f"({info.get('train_tokens', 0):,} tokens), {info.get('eval_rows', 0):,} held-out rows from "
        f"{info.get('dataset_eval_split')} ({info.get('eval_tokens', 0):,} tokens); at most {data.get('seq_len')} "
        f"tokens per row ({info.get('truncated_rows', 0)} truncated, {info.get('dropped_rows', 0)} dropped)."
    )


def _notes(results: dict[str, Any]) -> list[str]:
    runs = results["runs"]
    assumptions = runs[0].get("cost_assumptions", {})
    distributed = (runs[0].get("world_size") or 1) > 1
    quality = (
        "- **Accuracy**: share of held-out rows whose argmax class is right, through the offline `evaluate` metric "
        "`grpo_hf.harness.compare.load_metric('accuracy')`; eval loss is the mean cross-entropy."
        if runs[0].get("accuracy_after") is not None
        else "- **Perplexity**: `exp(sum NLL / tokens)` over the held-out tokens that have a label (completion tokens "
        "only with completion-only loss), through the offline `evaluate` metric "
        "`grpo_hf.harness.compare.load_metric('perplexity')`."
    )
    bytes_note = (
        "- **Bytes**: what one rank sent per optimizer step to the others: "
        if distributed
        else "- **Bytes**: one process sends nothing, so each row counts what one worker would send per optimizer step: "
    )
    notes = [
        quality,
        bytes_note
        + "; ".join(f"{r['label']}: {r.get('comm_mode')}" for r in runs)
        + ". The baseline is `2 (W-1)/W * 4 * trainable_params` per step.",
        f"- **Energy**: {assumptions.get('energy_source')}"
        + (
            f" ({assumptions.get('power_watts'):g} W assumed: set `cost_device_power_watts` for your machine)"
            if assumptions.get("energy_estimated") and assumptions.get("power_watts")
            else ""
        )
        + f"; cost = device-hours x ${assumptions.get('cost_gpu_hour_usd')}/h + energy x "
        f"${assumptions.get('cost_energy_kwh_usd')}/kWh x PUE {assumptions.get('cost_pue')}.",
        f"- **Peak memory**: {assumptions.get('peak_memory_source')}"
        + (", reset before each run" if all(r.get("peak_memory_reset") for r in runs) else "")
        + ".",
        "- **Cost per quality**: `total_usd * perplexity_after` (the article's cost / quality with quality = 1 / ppl), "
        "or `total_usd / accuracy_after` for a classifier.",
    ]
    cores = results.get("environment", {}).get("usable_cpus") or results.get("environment", {}).get("cpu_count")
    loads = [r.get("load_average") for r in runs]
    notes += _noise_notes(results)
    if cores and all(load is not None for load in loads):
        busy = [f"{r['label']} {load:.1f}" for r, load in zip(runs, loads)]
        warning = (
            ": **above the core count, so other processes shared the CPUs and times, energy and cost are inflated**"
            if max(loads) > cores + 0.5
            else ""
        )
        notes.append(
            f"- **Machine load** (1-min load average at the end of training, {cores} cores): "
            f"{', '.join(busy)}{warning}."
        )
    return notes


_NOISE_RULE = (
    "each timed ratio of the table is the geometric mean of the rounds' ratios (the full runs, always Trainer first, "
    "decide nothing), and reads *no difference* when the rounds disagree on its direction or all lie closer to 1 than "
    f"one trainer's windows vary among themselves (at least {TIMING_RESOLUTION:.0%})."
)


def _noise_notes(results: dict[str, Any]) -> list[str]:
    noise = results.get("ratio_noise") or {}
    timing = results.get("timing_noise") or {}
    if not noise:
        return []
    if not timing.get("windows"):
        return [
            "- **Noise**: not measured (`cost_noise_rounds=0`), so the time, energy and money ratios are the full runs' "
            "(the Trainer always first) and carry no range; on a shared machine read them with care."
        ]
    labels = {key: label for key, label, _ in TABLE_ROWS}
    bands = []
    for key, entry in noise.items():
        if entry.get("band") and entry.get("within_noise") is not None:
            said = NO_DIFFERENCE if entry["within_noise"] else "a difference"
            spread = entry.get("self_spread")
            full = entry.get("ratio_full_runs")
            bands.append(
                f"{labels.get(key, key)} {entry['ratio']:.3f} (rounds {entry['band'][0]:.3f}-{entry['band'][1]:.3f}"
                + (f", self-spread {spread:.1%}" if spread is not None else "")
                + (f", full runs {full:.3f}" if full is not None else "")
                + f"): {said}"
            )
    loads = [w.get("load_average") for w in timing["windows"] if w.get("load_average") is not None]
    load_text = f"; 1-min load average over the windows {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    return [
        f"- **Timed ratios and their noise**: {timing.get('rounds')} rounds of {timing.get('window_steps')}-step "
        f"windows of both trainers, interleaved ({timing.get('seconds', 0):.0f} s{load_text}); "
        + _NOISE_RULE
        + " Ranges: "
        + "; ".join(bands)
        + ". Bytes, steps and perplexity are exact."
    ]


def markdown_report(results: dict[str, Any], command: str | None = None, plots: dict[str, str] | None = None) -> str:
    """The whole `report.md`: setup, the table, how each figure was measured, and the plots."""
    lines = ["# Trainer vs GRPOTrainer", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    wall = results.get("wall_seconds")
    env = results.get("environment", {})
    hardware = f"{env.get('usable_cpus') or env.get('cpu_count')} CPU cores" if not env.get("cuda") else env["cuda"]
    if wall is not None:
        lines += [
            f"Wall time: {wall:.0f} s on {hardware} (torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}).",
            "",
        ]
    lines += _describe(results) + ["", markdown_table(results), ""]
    classifier = results["runs"][0].get("accuracy_after") is not None
    lines += [
        "Ratios are GRPOTrainer / Trainer: below 1 means less time, bytes or money"
        + (", and above 1 a higher accuracy" if classifier else ", or a lower perplexity")
        + "; for tokens/s above 1 is faster. Time, tokens/s, energy and money are measured by interleaved timing "
        "windows (their range in brackets; *no difference* inside the noise).",
        "",
    ]
    lines += ["## How each figure was measured", ""] + _notes(results) + [""]
    for key, title in (
        ("loss", "Training loss"),
        ("learning_rates", "Learning rate used per group"),
        ("bytes", "Bytes"),
        ("ratios", "Ratios: better, worse or no difference"),
    ):
        if plots and key in plots:
            lines += [f"![{title}]({Path(plots[key]).name})", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# The plots
# --------------------------------------------------------------------------------------------------------------


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


def _save(fig, path: Path, bottom: float = 0.0) -> Path:
    fig.tight_layout(rect=(0, bottom, 1, 1))  # `bottom`: a share of the height kept free for a footnote
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
    """
    Bytes one worker sends at every optimizer step, one line per run (log scale when they differ a lot). On one
    process nothing is sent: the title says that the bytes are projected for the `comm_workers` of the runs.
    """
    world = max((run.get("world_size") or 1) for run in runs) if runs else 1
    workers = next((run.get("comm_workers") for run in runs if run.get("comm_workers")), None)
    if world > 1:
        title = f"Bytes sent per worker per step ({world} processes)"
    else:
        title = f"Bytes one of {workers or 'N'} workers would send per step\n(projected: one process sent nothing)"
    fig, ax = _figure(title, "optimizer step", "bytes (MB)")
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


_VERDICT_COLORS = {"better": "tab:green", "worse": "tab:red", "same": "grey", None: "tab:blue"}


def _ratio_ticks(span: float) -> list[float]:
    """Ticks of a log axis from `10**-span` to `10**span`, 1 always among them, none closer than a tenth of the axis."""
    candidates = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 0.8, 1, 1.25, 2, 5, 10, 20, 50, 100)
    gap = 2 * span / 10
    ticks = [1.0]
    for side in (sorted((t for t in candidates if t < 1), reverse=True), sorted(t for t in candidates if t > 1)):
        last = 0.0
        for tick in side:
            distance = abs(math.log10(tick))
            if distance < span and distance - last >= gap:
                ticks.append(tick)
                last = distance
    return sorted(ticks)


def plot_ratios(results: dict[str, Any], path: str | Path) -> Path:
    """
    Every ratio GRPOTrainer / Trainer of the table on a log axis, coloured by what it means for GRPOTrainer: green
    better, red worse, grey no difference (a timed ratio inside its noise, or exactly 1); rows where higher is better
    (tokens/s, accuracy) say so. Timed ratios are the interleaved windows' ([`~grpo_hf.harness.table.classify`]), with
    the range of the rounds as a bar.
    """
    labels = {key: label for key, label, _ in TABLE_ROWS}
    ratios = results.get("ratios") or {}
    noise = results.get("ratio_noise") or {}
    shown = {}
    for key, *_ in TABLE_ROWS:
        entry = noise.get(key) or {}
        value = entry.get("ratio_interleaved") or ratios.get(key)
        if isinstance(value, (int, float)) and value > 0:
            shown[key] = value
    keys = list(shown)
    fig, ax = _figure("GRPOTrainer / Trainer", "ratio GRPOTrainer / Trainer (log scale)", "")
    fig.set_size_inches(7, 0.35 * len(keys) + 1.8)
    for y, key in enumerate(reversed(keys)):
        ratio, entry = shown[key], noise.get(key) or {}
        said = verdict(key, ratio, entry)
        color = _VERDICT_COLORS[said]
        if entry.get("band") and entry.get("within_noise") is not None:
            ax.plot(entry["band"], [y, y], color=color, linewidth=5, alpha=0.35, solid_capstyle="butt")
        ax.plot([ratio], [y], "o", color=color)
        if entry and entry.get("within_noise") is None:
            note = f"  {NOT_MEASURED}"
        else:
            note = {"better": "  better", "worse": "  worse", "same": f"  {NO_DIFFERENCE}"}.get(said, "")
        ax.annotate(f"{ratio:.3f}{note}", (ratio, y), textcoords="offset points", xytext=(6, 4), fontsize=7,
                    color=color)  # fmt: skip
    names = [labels[k] + (" (higher is better)" if k in HIGHER_IS_BETTER else "") for k in reversed(keys)]
    ax.set_yticks(range(len(keys)), names, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    if keys:
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

        values = list(shown.values()) + [b for k in keys for b in ((noise.get(k) or {}).get("band") or [])]
        span = max(abs(math.log10(v)) for v in values) + 0.1
        ax.set_xscale("log")
        ax.set_xlim(10**-span, 10**span)
        ticks = _ratio_ticks(span)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.text(
        0.01,
        0.005,
        "Green: GRPOTrainer better; red: worse; grey: no difference (a timed ratio inside its noise, or equal).\n"
        "Timed ratios: the interleaved timing windows'; bars: their range over the rounds.",
        fontsize=6,
        va="bottom",
    )
    return _save(fig, Path(path), bottom=0.3 / fig.get_size_inches()[1])


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


def write_report(results: dict[str, Any], output_dir: str | Path, command: str | None = None) -> dict[str, str]:
    """
    Write `results.json`, `report.md` and the plots into `output_dir`, each file whole or not at all
    ([`~grpo_hf.files.atomic_write`]: a crash leaves the previous file, never half of one).

    Returns:
        `dict[str, str]`: the paths written, by kind (`results`, `report`, `loss`, `learning_rates`, `bytes`, `ratios`).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, output_dir)
    results = dict(results, command=command, files={k: Path(v).name for k, v in plots.items()})
    results_path = output_dir / RESULTS_FILE
    text = json.dumps(results, indent=2, default=str) + "\n"  # serialized first: a failure here writes nothing
    with atomic_write(results_path) as handle:
        handle.write(text)
    report_path = output_dir / REPORT_FILE
    text = markdown_report(results, command, plots) + "\n"
    with atomic_write(report_path) as handle:
        handle.write(text)
    return {"results": str(results_path), "report": str(report_path), **plots}


__all__ = [
    "PLOT_FILES",
    "REPORT_FILE",
    "RESULTS_FILE",
    "markdown_report",
    "plot_bytes_per_step",
    "plot_learning_rates",
    "plot_loss_curves",
    "plot_ratios",
    "print_table",
    "rich_table",
    "write_plots",
    "write_report",
]
