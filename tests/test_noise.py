"""Noise bands of timed ratios: the rule, hand-written windows, and the marks in the table, plot and results.json."""

import math

import pytest

from grpo_hf.harness.report import plot_ratios
from grpo_hf.harness.table import (
    TABLE_ROWS,
    TIMED_KEYS,
    classify,
    ratio_cell,
    self_spread,
    table_rows,
    timed_ratio_noise,
)


def test_classify_the_overclaim_of_a_busy_machine():
    # The case that prompted it: compression off, the Trainer's half ran on a busier machine; the windows,
    # interleaved, find the two trainers equally fast.
    entry = classify(0.730, [0.99, 1.02], spread=0.03)
    assert entry["within_noise"] is True
    assert entry["band"] == [0.730, 1.02]
    assert entry["ratio_interleaved"] == pytest.approx(math.sqrt(0.99 * 1.02))


def test_classify_a_real_difference_and_a_tiny_one():
    real = classify(0.90, [0.89, 0.91], spread=0.03)  # every measurement agrees, far beyond the self-spread
    assert real["within_noise"] is False and real["band"] == [0.89, 0.91]
    tiny = classify(0.995, [0.993, 0.998], spread=0.01)  # same side of 1, but closer to 1 than the self-spread
    assert tiny["within_noise"] is True
    assert classify(0.995, [0.993, 0.998], spread=0.001)["within_noise"] is False
    unmeasured = classify(0.8, [], spread=None)
    assert unmeasured["within_noise"] is None and unmeasured["band"] == [0.8, 0.8]


def test_self_spread():
    assert self_spread([2.0, 2.5, 2.2]) == pytest.approx(0.25)
    assert self_spread([2.0]) is None and self_spread([None, 3.0]) is None


def _window(round_, name, seconds, usd, tokens_per_second):
    return {
        "round": round_,
        "name": name,
        "train_seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "energy_kwh": seconds * 1e-5,
        "total_usd": usd,
    }


def _results():
    ratios = {key: 1.0 for key, *_ in TABLE_ROWS}
    ratios.update(train_seconds=0.73, tokens_per_second=1.37, energy_kwh=0.73, total_usd=0.73)
    ratios.update(cost_per_quality=0.73 * 1.01, perplexity_after=1.01, comm_bytes=0.141)
    windows = [
        _window(0, "trainer", 10.0, 0.010, 100.0),
        _window(0, "grpo", 10.1, 0.0101, 99.0),
        _window(1, "grpo", 10.4, 0.0104, 96.0),
        _window(1, "trainer", 10.2, 0.0102, 98.0),
    ]
    return {
        "runs": [{"label": "Trainer"}, {"label": "GRPOTrainer"}],
        "ratios": ratios,
        "timing_noise": {"rounds": 2, "window_steps": 4, "seconds": 8.0, "windows": windows},
    }


def test_timed_ratio_noise_pairs_windows_by_round():
    noise = timed_ratio_noise(_results())
    assert set(noise) == set(TIMED_KEYS)
    time = noise["train_seconds"]
    assert time["window_ratios"] == pytest.approx([10.1 / 10.0, 10.4 / 10.2])
    assert time["self_spread"] == pytest.approx(10.4 / 10.1 - 1)  # GRPOTrainer's windows vary the most
    assert time["within_noise"] is True and time["band"][0] == 0.73
    # cost per quality: each round's money ratio times the exact quality ratio of the full runs
    assert noise["cost_per_quality"]["window_ratios"] == pytest.approx([1.01 * 1.01, 1.01 * 0.0104 / 0.0102])
    assert noise["tokens_per_second"]["window_ratios"] == pytest.approx([0.99, 96 / 98])


def test_table_marks_timed_ratios_and_leaves_counted_ones_exact():
    results = _results()
    results["ratio_noise"] = timed_ratio_noise(results)
    results["runs"] = [{"label": "Trainer"}, {"label": "GRPOTrainer"}]
    _, rows = table_rows(results)
    by_label = {row[0]: row[-1] for row in rows}
    assert by_label["Training time (s)"] == "0.730 (within noise)"
    assert by_label["Cost (USD)"] == "0.730 (within noise)"
    assert by_label["Bytes sent per worker (total)"] == "0.141"  # counted: exact, no mark
    assert by_label["Eval perplexity after"] == "1.010"
    outside = classify(0.9, [0.89, 0.91], 0.01)
    assert ratio_cell(0.9, outside) == "0.900 (measured 0.890-0.910)"
    assert ratio_cell(None, None) == "-" and ratio_cell(0.5, classify(0.5, [], None)) == "0.500"


def test_ratio_plot_is_written(tmp_path):
    results = _results()
    results["ratio_noise"] = timed_ratio_noise(results)
    path = plot_ratios(results, tmp_path / "ratios.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
