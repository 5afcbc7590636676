"""
The ratios of a comparison and the side-by-side table that shows them: the ratios GRPOTrainer / Trainer, the noise
band of the timed ones, the table's rows (what each shows and how its values print) and its cells with the noise
verdict. [`~grpo_hf.harness.report`] prints and writes the table and draws the ratios
([`~grpo_hf.harness.report.plot_ratios`]), and `grpo-hf publish` puts it on the card of a comparison.

**The noise of the timed ratios.** A comparison ([`~grpo_hf.harness.compare.compare`]) trains the plain `Trainer` and
then `GRPOTrainer`, one after the other, always in that order. The first run pays for warming the machine up (caches,
allocator, the CPU's clock), and on a shared machine the second can meet a busier or a quieter machine, so the full
runs' ratios that follow from wall-clock time (training time, tokens/s, energy, money, cost per quality) move without
any real difference between the trainers (a quickstart read 0.908 where GRPOTrainer does strictly more work). The
runner therefore also times short windows of both trainers, interleaved (`T G`, `G T`, `T G`, ...: alternating the
order cancels the order's advantage and a steady drift of the machine's load;
[`~grpo_hf.harness.compare.measure_timing_noise`]), and [`timed_ratio_noise`] turns them into the headline ratio and
its noise:

1. **Measurements of the ratio**: one ratio per round of windows, `r_i = G_i / T_i` (for cost per quality, the
   round's money ratio times the full runs' quality ratio, which is exact). The full runs' ratio `r_0` is kept
   (`ratio_full_runs`) but decides nothing: its order never alternates.
2. **Headline**: the geometric mean of the `r_i` (`ratio_interleaved`); it is what the table, the plots, `results.json`
   (`ratios`) and a model card show.
3. **Self-spread** `s`: how much the *same* trainer varied between its own windows, `max / min - 1` over the rounds,
   the larger of the two trainers (needs 2 rounds or more), at least [`TIMING_RESOLUTION`] (2%: below it, windows
   of a few steps do not resolve a difference of wall-clock time).
4. **Band**: `[min r_i, max r_i]`, the spread of the interleaved measurement, shown beside the headline.
5. **No difference** when the rounds disagree on the direction (the band contains 1), or when every one of them lies
   closer to 1 than the self-spread (`|ln r_i| <= ln(1 + s)`): the difference is no larger than what the same
   trainer showed against itself. Otherwise the headline is a difference, and the band says how sure it is.

**One source per row.** The columns of a timed row come from the same windows as its ratio: each trainer's
geometric mean over the paired rounds ([`timed_ratio_noise`]'s `window_means`), so that the printed ratio is the
ratio of the printed columns (the geometric mean of the rounds' ratios is the ratio of the geometric means). Every
window figure covers the whole window: its time, its money and its throughput (`tokens / train_seconds`, the tokens
of the same steps), so that the tokens/s ratio is the inverse of the time ratio and, with estimated energy, the cost
ratio equals the time ratio. What each full run cost (measured once each, the Trainer first) is shown apart, without
a ratio ([`full_run_rows`]).

Without windows (`cost_noise_rounds=0`) the columns and the headline are the full runs', marked "noise not measured";
their throughput row is then `tokens / train_seconds` of the whole run too. Ratios of counted quantities (bytes,
steps, tokens, FLOPs) and of deterministic evaluation (perplexity) carry no band: they are exact. Peak memory is
measured once per run, so its noise is unknown: a ratio within [`MEASURED_ONCE_TOLERANCE`] of 1 reads "no
difference".

Example:

```python
>>> from grpo_hf.harness.table import markdown_table, timed_ratio_noise
>>> noise = timed_ratio_noise(results)  # results of compare(), with results["timing_noise"]
>>> noise["train_seconds"]["ratio"], noise["train_seconds"]["within_noise"]  # e.g. 0.991, True (no difference)
>>> print(markdown_table(results))  # results.json of `grpo-hf compare`
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..model_card import format_bytes, markdown_table_of


NO_DIFFERENCE = "no difference"
# The smallest difference of wall-clock time a comparison's timing windows claim (see the module docstring).
TIMING_RESOLUTION = 0.02
NOT_MEASURED = "noise not measured"


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:,.{digits}f}"


def _significant(v: float, digits: int = 4) -> str:
    """`v` with `digits` significant digits, without an exponent (short runs' seconds and kWh stay readable; a
    window's figures, at 4 digits: the ratio of two of them, as printed, gives the printed ratio to its third
    decimal)."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:,.{decimals}f}"


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
    ("train_seconds", "Training time (s)", lambda v: _significant(v, 3)),
    ("tokens_per_second", "Tokens/s", _fixed(0)),
    ("peak_memory_gb", "Peak memory (GB)", _fixed(2)),
    ("optimizer_state_bytes", "Optimizer state", format_bytes),
    ("comm_bytes", "Bytes sent per worker (total)", format_bytes),
    ("comm_bytes_per_step", "Bytes sent per worker per step", format_bytes),
    ("comm_seconds_projected", "Comm time projected (s)", lambda v: _significant(v, 3)),
    ("energy_kwh", "Energy (kWh)", lambda v: _significant(v, 3)),
    ("total_usd", "Cost (USD)", _usd),
    ("cost_per_quality", "Cost per quality (USD x ppl)", _usd),
]


# Rows where a higher value is better (tokens/s, accuracy); lower is better for every other row.
HIGHER_IS_BETTER = frozenset({"tokens_per_second", "accuracy_before", "accuracy_after"})


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _ratio(numerator: Any, denominator: Any) -> float | None:
    a, b = _number(numerator), _number(denominator)
    return a / b if a is not None and b is not None and b > 0 and a > 0 else None


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def compute_ratios(baseline: dict[str, Any], grpo: dict[str, Any], keys: list[str] | None = None) -> dict:
    """
    `grpo[key] / baseline[key]` for every table row (or `keys`); `None` where either value is missing, not a finite
    number, or the baseline is 0.
    """
    ratios = {}
    for key in keys or [row[0] for row in TABLE_ROWS]:
        a, b = _number(baseline.get(key)), _number(grpo.get(key))
        ratios[key] = b / a if a is not None and b is not None and a != 0 else None
    return ratios


# --------------------------------------------------------------------------------------------------------------
# The noise of the timed ratios
# --------------------------------------------------------------------------------------------------------------


# Ratios that follow from wall-clock time on the machine (noisy); every other ratio of the report is exact.
TIMED_KEYS = ("train_seconds", "tokens_per_second", "energy_kwh", "total_usd", "cost_per_quality")
# What each timed ratio is measured from in a window (cost per quality: the money, times the exact quality ratio).
_WINDOW_KEY = {key: key for key in TIMED_KEYS} | {"cost_per_quality": "total_usd"}
METHOD = (
    "ratio measured by each round of short timed windows of both trainers, interleaved (the headline: their geometric "
    "mean; the full runs, always Trainer first, decide nothing); no difference when the rounds disagree on the "
    f"direction (their range contains 1) or all lie closer to 1 than the spread of one trainer's own windows (at least "
    f"{TIMING_RESOLUTION:.0%})"
)


def self_spread(values: list[float]) -> float | None:
    """`max / min - 1` of one trainer's window values (`None` with fewer than 2 positive values)."""
    values = [v for v in values if v is not None and v > 0]
    return max(values) / min(values) - 1 if len(values) >= 2 else None


def classify(ratio: float | None, window_ratios: list[float], spread: float | None) -> dict[str, Any]:
    """
    The headline and noise of one timed ratio: `ratio` measured by the full runs, `window_ratios` by the rounds of
    interleaved windows, `spread` the self-spread of the windows ([`self_spread`]); see the module docstring.

    Returns:
        `dict`: `ratio` (the headline: `ratio_interleaved`, or the full runs' without windows), `ratio_full_runs`,
        `window_ratios`, `ratio_interleaved` (their geometric mean), `band` (`[min, max]` of the window ratios, `None`
        without any), `self_spread`, `resolution` ([`TIMING_RESOLUTION`]) and `within_noise` (`True`: no difference;
        `None` when no window was measured).
    """
    measured = [r for r in window_ratios if r is not None and r > 0]
    interleaved = _geomean(measured)
    entry: dict[str, Any] = {
        "ratio": interleaved if interleaved is not None else ratio,
        "ratio_full_runs": ratio,
        "window_ratios": list(window_ratios),
        "ratio_interleaved": interleaved,
        "band": [min(measured), max(measured)] if measured else None,
        "self_spread": spread,
        "resolution": TIMING_RESOLUTION,
        "within_noise": None,
    }
    if not measured:
        return entry
    straddles = min(measured) <= 1.0 <= max(measured)
    tolerance = math.log1p(max(spread or 0.0, TIMING_RESOLUTION))
    inside_spread = all(abs(math.log(r)) <= tolerance for r in measured)
    entry["within_noise"] = bool(straddles or inside_spread)
    return entry


def _paired_rounds(results: dict[str, Any], baseline: str, candidate: str) -> list[dict[str, dict]]:
    """The rounds of interleaved windows in which both trainers were timed, in round order."""
    windows = (results.get("timing_noise") or {}).get("windows") or []
    rounds: dict[int, dict[str, dict]] = {}
    for window in windows:
        rounds.setdefault(window["round"], {})[window["name"]] = window
    return [r for _, r in sorted(rounds.items()) if baseline in r and candidate in r]


def window_value(window: dict[str, Any], key: str) -> float | None:
    """
    One window's figure for the timed row `key` (cost per quality: its money): every figure covers the whole window,
    throughput included (`tokens / train_seconds`; a window recorded without its `tokens` keeps its own
    `tokens_per_second`).
    """
    source = _WINDOW_KEY[key]
    if source == "tokens_per_second" and _number(window.get("tokens")) is not None:
        return _ratio(window["tokens"], window.get("train_seconds"))
    value = _number(window.get(source))
    return value if value is not None and value > 0 else None


def timed_ratio_noise(results: dict[str, Any], baseline: str = "trainer", candidate: str = "grpo") -> dict:
    """
    The headline and noise of every timed ratio ([`TIMED_KEYS`]) of a comparison's `results`: the full runs' ratios
    (`results["ratios_full_runs"]`, or `results["ratios"]` of results that hold only those) and the interleaved
    windows (`results["timing_noise"]["windows"]`, [`~grpo_hf.harness.compare.compare`]).

    Returns:
        `dict[str, dict]`: per key, [`classify`]'s entry, plus `window_means`: `[baseline, candidate]`, each trainer's
        geometric mean of its window figures ([`window_value`]) over the rounds that measured the ratio (for cost per
        quality, of the money: the table multiplies each by its run's quality), so that their ratio is the headline;
        `None` without windows. Empty when the results hold no ratios.
    """
    ratios = results.get("ratios_full_runs") or results.get("ratios") or {}
    if not ratios:
        return {}
    paired = _paired_rounds(results, baseline, candidate)
    quality = _ratio(ratios.get("cost_per_quality"), ratios.get("total_usd"))  # the exact quality factor
    noise = {}
    for key in TIMED_KEYS:
        window_ratios, used = [], []
        for pair in paired:
            values = [window_value(pair[name], key) for name in (baseline, candidate)]
            r = _ratio(values[1], values[0])
            if r is not None and key == "cost_per_quality":
                r = r * quality if quality is not None else None
            if r is not None:
                window_ratios.append(r)
                used.append(values)
        spreads = [self_spread([window_value(pair[name], key) for pair in paired]) for name in (baseline, candidate)]
        spreads = [s for s in spreads if s is not None]
        entry = classify(_number(ratios.get(key)), window_ratios, max(spreads) if spreads else None)
        entry["window_means"] = [_geomean([v[i] for v in used]) for i in (0, 1)] if used else None
        noise[key] = entry
    return noise


def headline_ratios(ratios: dict[str, Any], noise: dict[str, dict]) -> dict[str, Any]:
    """
    The ratios a reader is shown: `ratios` (the full runs') with every timed ratio measured by interleaved windows
    replaced by its headline ([`classify`]'s `ratio`, the windows' geometric mean).
    """
    shown = dict(ratios)
    for key, entry in noise.items():
        if key in shown and (entry or {}).get("ratio_interleaved") is not None:
            shown[key] = entry["ratio_interleaved"]
    return shown


# Figures measured once per run, with no repeated measurement to tell their noise: a ratio closer to 1 than this is
# no difference (a stated tolerance, not a measured one; the report says so).
MEASURED_ONCE_TOLERANCE = {"peak_memory_gb": 0.05}


def verdict(key: str, ratio: float | None, noise: dict | None = None) -> str | None:
    """
    `"better"`, `"worse"` or `"same"` for GRPOTrainer on the row `key` ([`HIGHER_IS_BETTER`]; lower is better
    elsewhere): `"same"` for a timed ratio with no difference ([`classify`]), a figure measured once whose ratio lies
    within its tolerance of 1 ([`MEASURED_ONCE_TOLERANCE`]: peak memory), or a ratio that prints as `1.000`. `None`
    without a ratio.
    """
    if ratio is None or not ratio > 0:
        return None
    tolerance = MEASURED_ONCE_TOLERANCE.get(key)
    if tolerance is not None and abs(math.log(ratio)) <= math.log1p(tolerance):
        return "same"
    if (noise or {}).get("within_noise") or f"{ratio:.3f}" == "1.000":
        return "same"
    return "better" if (ratio < 1) != (key in HIGHER_IS_BETTER) else "worse"


# --------------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------------


def ratio_cell(ratio: float | None, noise: dict | None = None, key: str | None = None) -> str:
    """
    The ratio column's text: `"0.141"` for an exact ratio; for a timed one ([`classify`]), its headline (the
    interleaved windows' ratio) and their range: `"0.991 (no difference; windows 0.985-0.997)"` inside its noise,
    `"0.700 (windows 0.690-0.710)"` outside it, `"0.908 (noise not measured)"` without windows (the full runs'); for
    a figure measured once (`key` in [`MEASURED_ONCE_TOLERANCE`]) inside its tolerance, `"1.011 (no difference;
    within 5%)"`.
    """
    tolerance = MEASURED_ONCE_TOLERANCE.get(key) if key is not None else None
    if tolerance is not None and ratio is not None and verdict(key, ratio) == "same":
        return f"{ratio:.3f} ({NO_DIFFERENCE}; within {tolerance:.0%})"
    if not noise:
        return "-" if ratio is None else f"{ratio:.3f}"
    headline = noise.get("ratio_interleaved") or ratio
    if headline is None:
        return "-"
    if noise.get("within_noise") is None or not noise.get("band"):
        return f"{headline:.3f} ({NOT_MEASURED})"
    low, high = noise["band"]
    if noise["within_noise"]:
        return f"{headline:.3f} ({NO_DIFFERENCE}; windows {low:.3f}-{high:.3f})"
    return f"{headline:.3f} (windows {low:.3f}-{high:.3f})"


def _cell(formatter, value) -> str:
    if value is None or isinstance(value, str):
        return "-" if value is None else value
    return formatter(value)


def _label(key: str, label: str, runs: list[dict[str, Any]]) -> str:
    """A row's label, saying when the energy was estimated and when the quality is an accuracy."""
    if key == "energy_kwh" and any(r.get("energy_estimated") for r in runs):
        return "Energy (kWh, estimated)"
    if key == "cost_per_quality" and any(r.get("accuracy_after") is not None for r in runs):
        return "Cost per quality (USD / accuracy)"
    return label


def _quality_factor(run: dict[str, Any]) -> float | None:
    """`cost_per_quality / total_usd` of a full run: its perplexity (or `1 / accuracy`), the exact part of the row."""
    return _ratio(run.get("cost_per_quality"), run.get("total_usd"))


def whole_run_throughput(run: dict[str, Any]) -> float | None:
    """`tokens / train_seconds` of a full run (the tokens of the timed `train()` call, `train_tokens`, for a resumed
    one): its throughput over the same time as its time and money rows."""
    tokens = run.get("train_tokens") if run.get("train_tokens") is not None else run.get("tokens")
    return _ratio(tokens, run.get("train_seconds"))


def _shown_noise(results: dict[str, Any]) -> dict[str, dict]:
    """The noise entries of the timed rows, with their `window_means` (recomputed from the windows for results
    written before the entries held them: the same windows give the same headlines)."""
    noise = results.get("ratio_noise") or {}
    measured = [entry for entry in noise.values() if (entry or {}).get("ratio_interleaved") is not None]
    if measured and any("window_means" not in entry for entry in measured):
        noise = timed_ratio_noise(results) or noise
    return noise


def comparison_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """
    Every row the table shows, from one source each: `key`, `label`, `values` (one per run), `cells` (their text),
    `ratio` (GRPOTrainer / Trainer of a comparison, else `None`), `noise` (the timed row's [`classify`] entry) and
    `source` (`"windows"`: the interleaved windows give the columns and the ratio; `"full runs"`). The table, the
    ratio plot ([`~grpo_hf.harness.report.plot_ratios`]) and a card read the same rows, so that no printed ratio
    contradicts its printed columns.
    """
    runs = results["runs"]
    ratios = results.get("ratios") or {}
    with_ratio = len(runs) == 2 and bool(ratios)
    noise = _shown_noise(results) if with_ratio else {}
    steps = (results.get("timing_noise") or {}).get("window_steps")
    rows = []
    for key, label, formatter in TABLE_ROWS:
        if all(r.get(key) is None for r in runs) and ratios.get(key) is None:
            continue  # a metric of another task (accuracy for a causal LM, perplexity for a classifier)
        label = _label(key, label, runs)
        if key == "comm_seconds_projected":
            link = runs[0].get("cost_assumptions", {}).get("cost_link_gbps")
            label = f"Comm time projected @ {link:g} Gbit/s (s)" if link else label
        entry = noise.get(key)
        values = [r.get(key) for r in runs]
        ratio = ratios.get(key) if with_ratio else None
        source = "full runs"
        means = (entry or {}).get("window_means")
        if means and None not in means:  # a timed row: the windows give the columns and the ratio
            values = list(means)
            if key == "cost_per_quality":
                values = [m * q if q is not None else None for m, q in zip(means, map(_quality_factor, runs))]
            label = f"{label}, {'over' if key == 'tokens_per_second' else 'per'} {steps}-step window"
            label += "s" if key == "tokens_per_second" else ""
            formatter = (lambda v: "$" + _significant(v)) if key in ("total_usd", "cost_per_quality") else _significant
            ratio, source = entry["ratio_interleaved"], "windows"
        elif key == "tokens_per_second" and with_ratio:  # the full runs: over the time of the time row
            values = [whole_run_throughput(r) for r in runs]
            label = "Tokens/s (whole run)"
            ratio = _ratio(values[1], values[0])
            entry = dict(entry, ratio_interleaved=None) if entry else entry
        rows.append(
            {
                "key": key,
                "label": label,
                "values": values,
                "cells": [_cell(formatter, v) for v in values],
                "ratio": ratio,
                "noise": entry,
                "source": source,
            }
        )
    return rows


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table, as strings (shared by the terminal and markdown tables): the rows
    of [`comparison_rows`], with the ratio column of a comparison."""
    runs = results["runs"]
    header = ["Metric", *[r["label"] for r in runs]]
    with_ratio = len(runs) == 2 and bool(results.get("ratios"))
    if with_ratio:
        header.append(f"{runs[1]['label']} / {runs[0]['label']}")
    rows = []
    for row in comparison_rows(results):
        cells = [row["label"], *row["cells"]]
        if with_ratio:
            cells.append(ratio_cell(row["ratio"], row["noise"], row["key"]))
        rows.append(cells)
    return header, rows


def full_run_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """
    What each full run cost, when the table's timed rows are the interleaved windows': header and rows (time,
    throughput after the warm-up steps, energy, money, cost per quality), one column per run and no ratio (the runs
    trained one after the other, the Trainer first: they measure each run, not the difference). Empty rows when the
    table shows the full runs itself.
    """
    runs = results["runs"]
    windowed = {row["key"] for row in comparison_rows(results) if row["source"] == "windows"}
    if not windowed:
        return [], []
    skip = (runs[0].get("cost_assumptions") or {}).get("skip_steps")
    rows = []
    for key, label, formatter in TABLE_ROWS:
        if key not in windowed:
            continue
        if key == "tokens_per_second" and skip:
            label = f"Tokens/s (after the first {skip} steps)"
        rows.append([_label(key, label, runs), *[_cell(formatter, r.get(key)) for r in runs]])
    return ["Full run", *[r["label"] for r in runs]], rows


def markdown_table(results: dict[str, Any]) -> str:
    """The table in GitHub markdown."""
    return markdown_table_of(*table_rows(results))


def markdown_full_runs(results: dict[str, Any]) -> str:
    """[`full_run_rows`] in GitHub markdown (`""` when the table shows the full runs itself)."""
    header, rows = full_run_rows(results)
    return markdown_table_of(header, rows) if rows else ""


__all__ = [
    "HIGHER_IS_BETTER",
    "MEASURED_ONCE_TOLERANCE",
    "METHOD",
    "NOT_MEASURED",
    "NO_DIFFERENCE",
    "TABLE_ROWS",
    "TIMED_KEYS",
    "TIMING_RESOLUTION",
    "classify",
    "comparison_rows",
    "compute_ratios",
    "full_run_rows",
    "headline_ratios",
    "markdown_full_runs",
    "markdown_table",
    "ratio_cell",
    "self_spread",
    "table_rows",
    "timed_ratio_noise",
    "verdict",
    "whole_run_throughput",
    "window_value",
]
