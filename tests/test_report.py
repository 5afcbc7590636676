"""What a reader of `report.md` sees is true: each printed ratio is the ratio of its printed columns (one source per
row), time, throughput and cost ratios agree, plots with fewer than two points are left out and said so, identical
lines are labelled, a one-trainer report is titled for one trainer, peak memory is coloured only beyond its stated
tolerance, and a resumed run states the learning rate and codec it used."""

import math
import re
import warnings

import pytest

from grpo_hf.harness.report import (
    _merge_identical,
    markdown_report,
    plot_omissions,
    write_report,
)
from grpo_hf.harness.table import (
    MEASURED_ONCE_TOLERANCE,
    TABLE_ROWS,
    comparison_rows,
    headline_ratios,
    ratio_cell,
    timed_ratio_noise,
    verdict,
)


# --- reading a report back ------------------------------------------------------------------------------------------

_UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _number(cell: str) -> tuple[float, float] | None:
    """A printed cell as `(value, half a unit of its last printed digit)`; `None` when it is no plain number."""
    match = re.fullmatch(r"\$?(-?[\d,]*\.?\d+)(?:e([+-]\d+))?(?: (B|kB|MB|GB|TB))?", cell.strip())
    if not match:
        return None
    digits, exponent, unit = match.groups()
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    scale = 10 ** int(exponent or 0) * _UNITS.get(unit or "B", 1)
    return float(digits.replace(",", "")) * scale, 0.5 * 10**-decimals * scale


def main_table(report: str) -> dict[str, list[str]]:
    """The first table of a report (the side-by-side one): cells by row label."""
    lines = report.split("| Metric |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def printed_ratio(cell: str) -> float:
    return float(cell.split(" ", 1)[0])


def assert_report_consistent(report: str) -> None:
    """
    Every ratio of the report's table is the ratio of its printed columns, within the rounding of all three; the
    time, tokens/s and cost ratios agree (same tokens: tokens/s is the inverse of time; estimated energy: cost is time).
    """
    rows = main_table(report)
    checked = 0
    for label, (trainer, grpo, ratio) in rows.items():
        a, b = _number(trainer), _number(grpo)
        if a is None or b is None or ratio == "-" or a[0] - a[1] <= 0 or b[0] - b[1] <= 0:
            continue
        low, high = (b[0] - b[1]) / (a[0] + a[1]), (b[0] + b[1]) / (a[0] - a[1])
        shown = printed_ratio(ratio)
        assert low - 5e-4 <= shown <= high + 5e-4, f"{label}: {trainer} / {grpo} is not {ratio}"
        checked += 1
    assert checked >= 5, rows
    by_start = {label.split(" (")[0].split(",")[0]: cells[-1] for label, cells in rows.items()}
    time, throughput = printed_ratio(by_start["Training time"]), printed_ratio(by_start["Tokens/s"])
    assert abs(time * throughput - 1) <= 5e-4 * (time + throughput) + 1e-9, (time, throughput)  # printed to 3 decimals
    if any(label.startswith("Energy (kWh, estimated)") for label in rows):
        assert printed_ratio(by_start["Cost"]) == pytest.approx(time, abs=1.5e-3)


# --- a comparison whose full runs and windows disagree (issue 60, item 3) ------------------------------------------


def _run(name, label, seconds, tokens, ppl, usd_per_second=2.0 / 3600 + 28e-6 / 3600):
    usd = seconds * usd_per_second
    return {
        "name": name,
        "label": label,
        "perplexity_after": ppl,
        "train_seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / (seconds * 0.6),  # the cost callback's rate, after its warm-up steps
        "peak_memory_gb": 0.62,
        "energy_kwh": seconds * 20 / 3.6e6,
        "energy_estimated": True,
        "total_usd": usd,
        "cost_per_quality": usd * ppl,
        "comm_bytes": 376830.0 if name == "trainer" else 167120.0,
        "world_size": 1,
        "comm_mode": "dense" if name == "trainer" else "q8",
        "cost_assumptions": {"skip_steps": 2, "cost_link_gbps": 10.0},
        "loss_curve": [[2, 6.4], [4, 6.2], [6, 6.1], [8, 6.0]],
    }


def _window(round_, name, seconds, tokens=2048, usd_per_second=2.0 / 3600 + 28e-6 / 3600):
    return {"round": round_, "name": name, "train_seconds": seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds, "tokens_per_second_steady": tokens / (seconds * 0.55),
            "energy_kwh": seconds * 20 / 3.6e6, "total_usd": seconds * usd_per_second}  # fmt: skip


def comparison(windows=((1.02, 1.26), (1.31, 1.05)), rounds=True):
    """sft_tiny's case: the full runs read 24.4 s and 4.6 s (the first paid the machine's one-time costs); the
    interleaved windows, (Trainer, GRPOTrainer) seconds per round, disagree with them."""
    runs = [_run("trainer", "Trainer", 24.4, 8192, 480.398), _run("grpo", "GRPOTrainer", 4.6, 8192, 480.396)]
    ratios = {key: None for key, *_ in TABLE_ROWS}
    for key, *_ in TABLE_ROWS:
        a, b = runs[0].get(key), runs[1].get(key)
        ratios[key] = b / a if a and b is not None else None
    timed = []
    for index, (t, g) in enumerate(windows if rounds else ()):
        pair = [_window(index, "trainer", t), _window(index, "grpo", g)]
        timed += pair if index % 2 == 0 else pair[::-1]
    timing = {"rounds": len(windows), "window_steps": 4, "seconds": 30.0, "windows": timed} if rounds else None
    noise = timed_ratio_noise({"ratios": ratios, "timing_noise": timing})
    return {
        "runs": runs,
        "ratios": headline_ratios(ratios, noise),
        "ratios_full_runs": ratios,
        "timing_noise": timing,
        "ratio_noise": noise,
        "recipe": {"training": {"max_steps": 8, "logging_steps": 2, "learning_rate": 5e-3}},
        "data": {"python_version": "3.11.7"},
    }


def test_each_timed_row_shows_the_windows_in_its_columns_and_its_ratio():
    results = comparison()
    report = markdown_report(results)
    assert_report_consistent(report)
    rows = main_table(report)
    time = rows["Training time (s), per 4-step window"]
    headline = math.sqrt(1.26 / 1.02 * 1.05 / 1.31)  # the geometric mean of the rounds' ratios
    assert time == [f"{math.sqrt(1.02 * 1.31):.3f}", f"{math.sqrt(1.26 * 1.05):.3f}",
                    f"{headline:.3f} (no difference; windows {1.05 / 1.31:.3f}-{1.26 / 1.02:.3f})"]  # fmt: skip
    assert rows["Tokens/s, over 4-step windows"][2].startswith(f"{1 / headline:.3f} ")  # the same tokens
    # The full runs (24.4 s, 4.6 s) are told apart, in a table of their own without a ratio.
    full = report.split("| Full run |", 1)[1].split("\n\n", 1)[0]
    assert "| Training time (s) | 24.4 | 4.60 |" in full and "Tokens/s (after the first 2 steps)" in full
    assert "GRPOTrainer / Trainer" not in full
    assert "0.189" not in report.split("## How")[0]  # the full runs' time ratio is no headline


def test_windows_recorded_without_their_tokens_still_give_one_source_per_row():
    results = comparison()
    for window in results["timing_noise"]["windows"]:  # results.json of an earlier version
        del window["tokens"]
    for entry in results["ratio_noise"].values():
        entry.pop("window_means")
    rows = {row["key"]: row for row in comparison_rows(results)}
    for key in ("train_seconds", "tokens_per_second", "total_usd", "cost_per_quality"):
        trainer, grpo = rows[key]["values"]
        assert rows[key]["source"] == "windows" and grpo / trainer == pytest.approx(rows[key]["ratio"])


def test_without_windows_the_full_runs_give_columns_and_ratios_that_agree():
    report = markdown_report(comparison(rounds=False))
    assert_report_consistent(report)
    rows = main_table(report)
    assert rows["Training time (s)"] == ["24.4", "4.60", "0.189 (noise not measured)"]
    assert rows["Tokens/s (whole run)"][2] == "5.304 (noise not measured)"  # 24.4 / 4.6: the same tokens
    assert "| Full run |" not in report


def test_peak_memory_is_a_difference_only_beyond_its_stated_tolerance():
    tolerance = MEASURED_ONCE_TOLERANCE["peak_memory_gb"]
    assert verdict("peak_memory_gb", 1.011) == "same" and verdict("peak_memory_gb", 1 + 2 * tolerance) == "worse"
    assert ratio_cell(1.011, None, "peak_memory_gb") == f"1.011 (no difference; within {tolerance:.0%})"
    report = markdown_report(comparison())
    assert f"Peak memory (GB) within {tolerance:.0%} of 1 is *no difference*" in report


# --- plots and titles (issue 60, item 5) ----------------------------------------------------------------------------


def one_run(**changes):
    run = _run("grpo", "GRPOTrainer", 6.2, 4096, 349.8)
    run.update(learning_rates={g: [[2, 1e-3], [4, 3e-3], [6, 2e-3]] for g in ("attn_qk", "ffn", "norms")})
    run.update(bytes_per_step=[170248.0] * 8, **changes)
    recipe = {"training": {"max_steps": 8, "logging_steps": 2, "learning_rate": 3e-3, "lr_scheduler_type": "cosine"}}
    return {"runs": [run], "ratios": {}, "recipe": recipe, "data": {"python_version": "3.11.7"}}


def test_a_one_trainer_report_is_titled_for_one_trainer(tmp_path):
    report = markdown_report(one_run())
    assert report.startswith("# GRPOTrainer run\n") and "vs" not in report.splitlines()[0]
    assert "both trainers" not in report and "GRPOTrainer / Trainer" not in report


def test_a_plot_with_fewer_than_two_points_is_left_out_and_said(tmp_path):
    # logging_steps 20 for 8 steps: one logged loss (the Trainer logs none before the end), so no curve to draw
    results = one_run(loss_curve=[[8, 6.0]], learning_rates={"ffn": [[8, 1e-4]]})
    results["recipe"]["training"]["logging_steps"] = 20
    (tmp_path / "loss_curves.png").write_bytes(b"an earlier run's plot")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" included
        paths = write_report(results, tmp_path)
    assert set(paths) == {"results", "report", "bytes"}
    assert not (tmp_path / "loss_curves.png").exists() and not (tmp_path / "learning_rates.png").exists()
    report = (tmp_path / "report.md").read_text()
    assert "loss_curves.png" not in report and "![Bytes](bytes_per_step.png)" in report
    assert (
        "Plots left out: the training loss, fewer than two logged points (logging_steps 20 for max_steps 8); the "
        "learning rate used per group, fewer than two logged points" in report
    )
    assert plot_omissions(one_run()) == {}


def test_identical_lines_are_drawn_once_and_labelled_so(tmp_path):
    same = [(2, 1e-3), (4, 3e-3)]
    merged = _merge_identical([("attn_qk", same), ("ffn", same), ("norms", [(2, 1e-3), (4, 1.5e-3)])])
    assert merged == [("attn_qk, ffn (identical)", same), ("norms", [(2, 1e-3), (4, 1.5e-3)])]
    # the losses of two trainers that differ in the fifth digit would hide each other too
    close = _merge_identical([("Trainer", [(2, 6.1639)]), ("GRPOTrainer", [(2, 6.1641)]), ("other", [(2, 6.3)])])
    assert [label for label, _ in close] == ["Trainer, GRPOTrainer (overlapping: within 0.1%)", "other"]
    paths = write_report(one_run(), tmp_path)
    assert {"loss", "learning_rates", "bytes"} <= set(paths)


# --- a resumed run states what it used (issue 60, item 2) -----------------------------------------------------------


def test_a_resumed_run_states_the_rate_and_codecs_it_used():
    results = one_run(steps=12)
    results["recipe"]["training"].update(learning_rate=3e-3, learning_rate_requested=0.01, max_steps=12)
    results["runs"][0]["resumed"] = {
        "checkpoint": "runs/ckpt/checkpoint-8",
        "step": 8,
        "applied": {"grpo_compression": ["quantize", "none"]},
        "codec": {"checkpoint": "quantize, 8 bits", "run": "nothing compressed"},
        "learning_rate": {"schedule": 3e-3, "requested": 0.01},
    }
    report = markdown_report(results)
    assert "lr 0.003 (cosine; the checkpoint's schedule, which the Trainer continues: learning_rate 0.01 was not used)" in report  # fmt: skip
    assert "lr 0.01" not in report
    assert "from `runs/ckpt/checkpoint-8` at step 8: steps 1-8 ran before, steps 9-12 in this run." in report
    assert "Steps 1-8 sent quantize, 8 bits; steps 9-12 sent nothing compressed" in report
    assert "Settings changed at the resume, applied from step 9: `grpo_compression` quantize -> none." in report
