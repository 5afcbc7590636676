"""
The report of a comparison ([`~grpo_hf.harness.compare.compare`]) or a run: one side-by-side table
([`grpo_hf.harness.table`]; rich in the terminal, markdown in `report.md`), `results.json`, and PNG plots (matplotlib,
Agg backend, no display needed), each file written whole or not at all ([`~grpo_hf.files.atomic_write`]).

Every row of the table is a key of a run's result; the last column is the ratio GRPOTrainer / Trainer
([`~grpo_hf.harness.table.comparison_rows`]): below 1 means GRPOTrainer needed less (time, bytes, money) or reached a
lower perplexity; for tokens/s and accuracy above 1 is better. Each row has one source: the rows that follow from
wall-clock time (time, tokens/s, energy, money) show in both columns and in the ratio the interleaved timing windows,
each figure over the whole window ([`~grpo_hf.harness.table.timed_ratio_noise`]; the full runs always train the
Trainer first, and what each cost is shown apart, without a ratio): inside their noise they read "no difference" in the
table, the ratio plot and `results.json` (`ratio_noise`); peak memory, measured once per run, reads "no difference"
within a stated tolerance; ratios of counted quantities (bytes, steps) are exact. A report of one run is titled for
it; a resumed run's says what it resumed, the learning rate its schedule followed and what it sent before and after.

The plots ([`write_plots`]): loss curves, the learning rate GRPO used per group, bytes sent (or, on one process,
projected) per step, and the ratios GRPOTrainer / Trainer coloured better / worse / no difference, with the range of
the timed ones. Lines that would hide each other are drawn once, labelled "(identical)" or "(overlapping)"; a plot
none of whose lines has two points is left out, and the report says why ([`plot_omissions`]).

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
    MEASURED_ONCE_TOLERANCE,
    NO_DIFFERENCE,
    NOT_MEASURED,
    TABLE_ROWS,
    TIMING_RESOLUTION,
    comparison_rows,
    full_run_rows,
    markdown_full_runs,
    markdown_table,
    table_rows,
    verdict,
)


ROW_LABELS = {key: label for key, label, _ in TABLE_ROWS}
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
PLOT_FILES = {
    "loss": "loss_curves.png",
    "learning_rates": "learning_rates.png",
    "bytes": "bytes_per_step.png",
    "ratios": "ratios.png",
}


def report_title(results: dict[str, Any]) -> str:
    """`"Trainer vs GRPOTrainer"` for a comparison, `"GRPOTrainer run"` (or the plain Trainer's) for one run."""
    labels = [r["label"] for r in results["runs"]]
    return " vs ".join(labels) if len(labels) > 1 else f"{labels[0]} run"


def _rich(header: list[str], rows: list[list[str]], title: str, caption: str | None = None):
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def rich_table(results: dict[str, Any], title: str | None = None):
    """The table as a [`rich.table.Table`]."""
    return _rich(*table_rows(results), title or report_title(results), _caption(results))


def print_table(results: dict[str, Any], title: str | None = None, console=None) -> None:
    """Print the table to the terminal with rich, and below it what each full run cost when the table's timed rows
    are the interleaved windows' ([`~grpo_hf.harness.table.full_run_rows`])."""
    from rich.console import Console

    console = console or Console(width=max(120, Console().width))
    console.print(rich_table(results, title))
    header, rows = full_run_rows(results)
    if rows:
        console.print(
            _rich(header, rows, "Each full run (one after the other, Trainer first: what it cost, not a comparison)")
        )


def _caption(results: dict[str, Any]) -> str:
    runs = results["runs"]
    parts = [f"{r['label']}: {r.get('comm_mode', '')}" for r in runs]
    if any(row["source"] == "windows" for row in comparison_rows(results)):
        parts.append(
            "time, tokens/s, energy and cost: columns and ratio from the same interleaved timing windows (each full "
            "run: below)"
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
        else f"- **Data**: {_corpus_name(info)} ({info.get('kind', data.get('corpus'))}), per-file hash split "
        f"({info.get('val_percent')}% held out), corpus fingerprint `{info.get('fingerprint')}`, "
        f"Python `{str(info.get('python_version', '')).split()[0]}`; {info.get('train_tokens', 0):,} train tokens, "
        f"{info.get('eval_tokens', 0):,} held-out tokens, {info.get('seq_len')} tokens per example.",
        f"- **Training**: {training.get('max_steps')} steps x batch {training.get('per_device_train_batch_size')}, "
        f"lr {_learning_rate(run, training, training.get('lr_scheduler_type'))}, seed {training.get('seed')}"
        + ("; identical data, seed and steps for both trainers." if len(results["runs"]) > 1 else "."),
    ]
    lines += _describe_resume(results)
    return lines


def _corpus_name(info: dict[str, Any]) -> str:
    """The corpus of a run on Python files: the standard library, or the folder `corpus_root` named (its record's
    `source`, [`~grpo_hf.harness.data.data_origin`])."""
    if info.get("source") == "python_files":
        return f"the Python files of `{info.get('corpus_root')}`"
    return "Python standard library"


def _learning_rate(run: dict[str, Any], training: dict[str, Any], scheduler: str | None) -> str:
    """The peak learning rate the run's schedule followed, with the schedule: the checkpoint's for a resumed run (the
    Trainer restores its optimizer and scheduler), whatever was asked."""
    rate = ((run.get("resumed") or {}).get("learning_rate") or {}).get("schedule")
    if rate is None:
        return f"{training.get('learning_rate')} ({scheduler})"
    requested = training.get("learning_rate_requested", training.get("learning_rate"))
    if isinstance(requested, (int, float)) and not math.isclose(rate, requested, rel_tol=1e-9):
        return (
            f"{rate:g} ({scheduler}; the checkpoint's schedule, which the Trainer continues: learning_rate "
            f"{requested:g} was not used)"
        )
    return f"{rate:g} ({scheduler})"


def _describe_resume(results: dict[str, Any]) -> list[str]:
    """One line per resumed run: the checkpoint and its step, the codec of each part, the settings changed."""
    lines = []
    for run in results["runs"]:
        resumed = run.get("resumed")
        if not resumed:
            continue
        step, steps = resumed.get("step") or 0, run.get("steps")
        codec = resumed.get("codec") or {}
        before, after = codec.get("checkpoint"), codec.get("run")
        said = [f"steps 1-{step} ran before, steps {step + 1}-{steps} in this run."]
        if after is not None and before in (None, after):
            unsaved = "" if before else " (the checkpoint's settings were not saved with it)"
            said.append(f"It sent {after} throughout{unsaved}.")
        elif after is not None:
            said.append(f"Steps 1-{step} sent {before}; steps {step + 1}-{steps} sent {after}.")
        applied = resumed.get("applied") or {}
        if applied:
            changed = ", ".join(f"`{name}` {a} -> {b}" for name, (a, b) in applied.items())
            said.append(f"Settings changed at the resume, applied from step {step + 1}: {changed}.")
        said.append("Time, tokens/s, energy and money are this run's steps only; bytes are counted from step 1.")
        lines.append(
            f"- **Resumed** ({run['label']}) from `{resumed.get('checkpoint')}` at step {step}: {' '.join(said)}"
        )
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
    if len(runs) == 2:
        tolerance = ", ".join(
            f"{ROW_LABELS[key]} within {share:.0%}" for key, share in MEASURED_ONCE_TOLERANCE.items()
        )
        notes.append(
            "- **What counts as different**: a timed ratio (time, tokens/s, energy, money) beyond the noise of its "
            "interleaved windows (the rule above); a figure measured once per run, with no repeated measurement to "
            f"tell its noise, beyond a stated tolerance ({tolerance} of 1 is *no difference*); a counted or "
            "evaluated figure (bytes, optimizer state, perplexity, loss): any change at the printed precision."
        )
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
    bands = []
    for key, entry in noise.items():
        if entry.get("band") and entry.get("within_noise") is not None:
            said = NO_DIFFERENCE if entry["within_noise"] else "a difference"
            spread = entry.get("self_spread")
            full = entry.get("ratio_full_runs")
            bands.append(
                f"{ROW_LABELS.get(key, key)} {entry['ratio']:.3f} (rounds {entry['band'][0]:.3f}-{entry['band'][1]:.3f}"
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
    """The whole `report.md`: setup, the table, what each full run cost (when the table's timed rows are the
    interleaved windows'), how each figure was measured, and the plots (and which were left out, and why)."""
    lines = [f"# {report_title(results)}", ""]
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
    windows = any(row["source"] == "windows" for row in comparison_rows(results))
    if len(results["runs"]) == 2 and results.get("ratios"):
        lines += [
            "Ratios are GRPOTrainer / Trainer: below 1 means less time, bytes or money"
            + (", and above 1 a higher accuracy" if classifier else ", or a lower perplexity")
            + "; for tokens/s above 1 is faster. "
            + (
                "Time, tokens/s, energy and money: both columns and the ratio come from the same interleaved timing "
                "windows (each trainer's geometric mean over the rounds; the range of the rounds' ratios in brackets; "
                "*no difference* inside the noise), each figure over the whole window."
                if windows
                else "Every row compares the full runs (the noise of the timed rows was not measured)."
            ),
            "",
        ]
    full_runs = markdown_full_runs(results)
    if full_runs:
        lines += [
            "What each full run cost, measured once each, one after the other (the Trainer first, paying the "
            "machine's one-time costs): what the run cost, not a comparison of the trainers.",
            "",
            full_runs,
            "",
        ]
    lines += ["## How each figure was measured", ""] + _notes(results) + [""]
    left_out = plot_omissions(results)
    for key, title in (
        ("loss", "Training loss"),
        ("learning_rates", "Learning rate used per group"),
        ("bytes", "Bytes"),
        ("ratios", "Ratios: better, worse or no difference"),
    ):
        if plots and key in plots:
            lines += [f"![{title}]({Path(plots[key]).name})", ""]
    if left_out:
        lines += ["Plots left out: " + "; ".join(f"{PLOT_TITLES[k]}, {why}" for k, why in left_out.items()) + ".", ""]
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


PLOT_TITLES = {
    "loss": "the training loss",
    "learning_rates": "the learning rate used per group",
    "bytes": "the bytes per step",
    "ratios": "the ratios",
}


def _plotted_series(results: dict[str, Any], kind: str) -> list[tuple[str, list]]:
    """`(label, [(x, y), ...])` of every line of the plot `kind` (`loss`, `learning_rates`, `bytes`)."""
    runs = results["runs"]
    if kind == "loss":
        return [(run["label"], list(map(tuple, run.get("loss_curve") or []))) for run in runs]
    if kind == "learning_rates":
        return [
            (group, list(map(tuple, points)))
            for run in runs
            if run.get("name") == "grpo"
            for group, points in sorted((run.get("learning_rates") or {}).items())
        ]
    # bytes: from the first step of this `train()` call (after a checkpoint's)
    return [
        (run["label"], list(enumerate(run.get("bytes_per_step") or [], run.get("bytes_first_step") or 1)))
        for run in runs
    ]


# Lines closer than this (relative to the largest value of either) would hide each other on a plot: drawn once.
OVERLAP = 1e-3


def _overlap(a: list, b: list) -> bool:
    if [x for x, _ in a] != [x for x, _ in b]:
        return False
    scale = max((abs(y) for _, y in a + b), default=0.0)
    return all(abs(ya - yb) <= OVERLAP * scale for (_, ya), (_, yb) in zip(a, b))


def _merge_identical(series: list[tuple[str, list]]) -> list[tuple[str, list]]:
    """
    Lines that would hide each other drawn once, labelled with every name: `"(identical)"` when their points are
    equal, `"(overlapping: within 0.1%)"` when they differ by less than [`OVERLAP`] of their largest value.
    """
    lines: list[dict] = []
    for label, points in series:
        line = next((line for line in lines if _overlap(line["points"], points)), None)
        if line is None:
            lines.append({"labels": [label], "points": points, "equal": True})
        else:
            line["labels"].append(label)
            line["equal"] = line["equal"] and line["points"] == points
    named = []
    for line in lines:
        label = ", ".join(line["labels"])
        if len(line["labels"]) > 1:
            label += " (identical)" if line["equal"] else f" (overlapping: within {OVERLAP:.1%})"
        named.append((label, line["points"]))
    return named


def plot_omissions(results: dict[str, Any]) -> dict[str, str]:
    """
    The plots [`write_plots`] leaves out, and why: a line plot none of whose lines has two points would be an empty
    frame (the loss with `logging_steps` above `max_steps`, a one-step resume's bytes), and the ratio plot of a run
    without a comparison.
    """
    training = (results.get("recipe") or {}).get("training") or {}
    reasons = {}
    for kind in ("loss", "learning_rates", "bytes"):
        series = _plotted_series(results, kind)
        if kind == "learning_rates" and not any(r.get("name") == "grpo" for r in results["runs"]):
            reasons[kind] = "no GRPOTrainer run"
        elif not any(len(points) >= 2 for _, points in series):
            logged = kind != "bytes"
            why = "fewer than two logged points" if logged else "fewer than two steps trained"
            if logged and training.get("logging_steps") and training.get("max_steps"):
                why += f" (logging_steps {training['logging_steps']} for max_steps {training['max_steps']})"
            reasons[kind] = why
    return reasons


def plot_loss_curves(runs: list[dict], path: str | Path) -> Path:
    """Training loss against the optimizer step, one line per run (identical curves drawn once, labelled so)."""
    fig, ax = _figure("Training loss", "optimizer step", "loss")
    for label, points in _merge_identical(_plotted_series({"runs": runs}, "loss")):
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _save(fig, Path(path))


def plot_learning_rates(runs: list[dict], path: str | Path) -> Path:
    """
    The learning rate GRPOTrainer's optimizer used for each group (`grpo/lr/<group>`) against the optimizer step; the
    title says whether importance multipliers were applied ("importance off: not applied" when they were not). Groups
    that used the same rates at every step share one line, labelled with all their names and "(identical)".
    """
    applied = any(run.get("importance_applied") for run in runs)
    title = "GRPOTrainer: learning rate used per group"
    title += "\nimportance multipliers applied" if applied else "\nimportance off: not applied"
    fig, ax = _figure(title, "optimizer step", "learning rate")
    plotted = False
    for label, points in _merge_identical(_plotted_series({"runs": runs}, "learning_rates")):
        ax.plot(*zip(*points), marker=".", label=label)
        plotted = True
    if plotted:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no learning rates logged", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, Path(path))


def plot_bytes_per_step(runs: list[dict], path: str | Path) -> Path:
    """
    Bytes one worker sends at every optimizer step, one line per run (log scale when they differ a lot; identical
    lines drawn once, labelled so). On one process nothing is sent: the title says that the bytes are projected for
    the `comm_workers` of the runs.
    """
    world = max((run.get("world_size") or 1) for run in runs) if runs else 1
    workers = next((run.get("comm_workers") for run in runs if run.get("comm_workers")), None)
    if world > 1:
        title = f"Bytes sent per worker per step ({world} processes)"
    else:
        title = f"Bytes one of {workers or 'N'} workers would send per step\n(projected: one process sent nothing)"
    fig, ax = _figure(title, "optimizer step", "bytes (MB)")
    values = []
    for label, points in _merge_identical(_plotted_series({"runs": runs}, "bytes")):
        if points:
            steps, sent = zip(*points)
            ax.plot(steps, [b / 1e6 for b in sent], marker=".", label=label)
            values += [b for b in sent if b > 0]
    if values and max(values) / min(values) > 20:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if ax.get_legend_handles_labels()[0]:
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
    Every ratio GRPOTrainer / Trainer of the table ([`~grpo_hf.harness.table.comparison_rows`]: the same ratios) on a
    log axis, coloured by what it means for GRPOTrainer: green better, red worse, grey no difference (a timed ratio
    inside its noise, peak memory within its stated tolerance, or exactly 1); rows where higher is better (tokens/s,
    accuracy) say so. Timed ratios are the interleaved windows' ([`~grpo_hf.harness.table.classify`]), with the range
    of the rounds as a bar.
    """
    noise, shown = {}, {}
    for row in comparison_rows(results):  # the table's rows: the same ratios, from the same measurement
        value = row["ratio"]
        if isinstance(value, (int, float)) and value > 0:
            shown[row["key"]], noise[row["key"]] = value, row["noise"] or {}
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
    names = [ROW_LABELS[k] + (" (higher is better)" if k in HIGHER_IS_BETTER else "") for k in reversed(keys)]
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
        "Green: GRPOTrainer better; red: worse; grey: no difference (a timed ratio inside its noise, peak memory\n"
        f"within {MEASURED_ONCE_TOLERANCE['peak_memory_gb']:.0%}, or equal). Timed ratios: the interleaved timing "
        "windows'; bars: their range over the rounds.",
        fontsize=6,
        va="bottom",
    )
    return _save(fig, Path(path), bottom=0.3 / fig.get_size_inches()[1])


def write_plots(results: dict[str, Any], output_dir: str | Path) -> dict[str, str]:
    """
    Write the PNG plots into `output_dir`; returns their paths by kind (`loss`, `learning_rates`, `bytes`, and `ratios`
    for a comparison). A plot none of whose lines has two points is left out ([`plot_omissions`]; the report says
    so), and an earlier plot of that name in `output_dir` removed.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    grpo_runs = [r for r in runs if r.get("name") == "grpo"]
    draw = {
        "loss": lambda path: plot_loss_curves(runs, path),
        "learning_rates": lambda path: plot_learning_rates(grpo_runs, path),
        "bytes": lambda path: plot_bytes_per_step(runs, path),
    }
    if results.get("ratios"):
        draw["ratios"] = lambda path: plot_ratios(results, path)
    left_out = plot_omissions(results)
    paths = {}
    for kind, plot in draw.items():
        path = output_dir / PLOT_FILES[kind]
        if kind in left_out:
            path.unlink(missing_ok=True)  # an earlier report's plot of this folder would not be this run's
            continue
        paths[kind] = str(plot(path))
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
    texts = {  # both made first: a failure here writes nothing
        RESULTS_FILE: json.dumps(results, indent=2, default=str) + "\n",
        REPORT_FILE: markdown_report(results, command, plots) + "\n",
    }
    for name, text in texts.items():
        with atomic_write(output_dir / name) as handle:
            handle.write(text)
    return {"results": str(output_dir / RESULTS_FILE), "report": str(output_dir / REPORT_FILE), **plots}


__all__ = [
    "PLOT_FILES",
    "PLOT_TITLES",
    "REPORT_FILE",
    "RESULTS_FILE",
    "markdown_report",
    "plot_bytes_per_step",
    "plot_learning_rates",
    "plot_loss_curves",
    "plot_omissions",
    "plot_ratios",
    "print_table",
    "report_title",
    "rich_table",
    "write_plots",
    "write_report",
]
