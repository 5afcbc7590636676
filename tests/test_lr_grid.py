"""The learning-rate sweep's arithmetic (`benchmarks/lr_grid.py`) and summary (`benchmarks/suite.py --lrs`), checked
on synthetic curves whose best point and window are known in closed form."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import lr_grid


ROOT = Path(__file__).resolve().parents[1]


def bowl(best_lr: float, floor: float, width: float = 1.0):
    """A curve `floor * exp(((log10(lr) - log10(best_lr)) / width) ** 2)`: its best at `best_lr`, symmetric in log lr."""
    return lambda lr: floor * math.exp(((math.log10(lr) - math.log10(best_lr)) / width) ** 2)


def sample(curve, learning_rates):
    return {lr: curve(lr) for lr in learning_rates}


def test_grid_is_centred_and_spaced_by_two():
    assert lr_grid.grid(1e-3, 5) == pytest.approx([2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3])
    assert lr_grid.grid(1e-3, 4) == pytest.approx([5e-4, 1e-3, 2e-3, 4e-3])  # an even count: one more above
    assert lr_grid.grid(1e-3, 1) == [1e-3]
    # points of two grids on the same nominal are the same floats (extensions and re-runs hit the same files)
    assert lr_grid.grid(1e-3, 7)[1:6] == lr_grid.grid(1e-3, 5)
    with pytest.raises(ValueError, match="at least one point"):
        lr_grid.grid(1e-3, 0)


def test_best_point_and_edges():
    lrs = lr_grid.grid(1e-3, 5)
    inside = sample(bowl(1e-3, 10.0), lrs)
    assert lr_grid.best_point(inside) == (pytest.approx(1e-3), pytest.approx(10.0))
    assert lr_grid.best_at_edge(inside) is None and lr_grid.extension(inside) is None
    rising = sample(bowl(1e-5, 10.0), lrs)  # best far below the grid
    assert lr_grid.best_at_edge(rising) == "low" and lr_grid.extension(rising) == pytest.approx(1.25e-4)
    falling = sample(bowl(1.0, 10.0), lrs)
    assert lr_grid.best_at_edge(falling) == "high" and lr_grid.extension(falling) == pytest.approx(8e-3)
    assert lr_grid.best_point({1e-3: 5.0, 2e-3: 5.0}) == (1e-3, 5.0)  # a tie goes to the smaller learning rate
    with pytest.raises(ValueError, match="empty curve"):
        lr_grid.best_point({})


def test_extending_a_grid_moves_the_best_inside():
    curve, learning_rates = bowl(3e-2, 10.0, width=0.5), lr_grid.grid(1e-3, 5)
    points = sample(curve, learning_rates)
    while (further := lr_grid.extension(points)) is not None:
        points[further] = curve(further)
    best, _ = lr_grid.best_point(points)
    assert lr_grid.best_at_edge(points) is None
    assert best == pytest.approx(3.2e-2)  # the grid point nearest 3e-2
    assert len(points) == 9  # 8e-3, 1.6e-2 and 3.2e-2 were at the edge in turn, then 6.4e-2 closed it


def test_window_matches_the_closed_form():
    # floor * exp((d / w)^2) <= target * 1.01  <=>  |d| <= w * sqrt(ln(1.01 * target / floor)), d in decades
    floor, target, width = 10.0, 10.0, 1.0
    fine = sample(bowl(1e-3, floor, width), [1e-3 * 10 ** (k / 50) for k in range(-100, 101)])
    expected = 2 * width * math.sqrt(math.log(1.01))
    assert lr_grid.window(fine, target) == pytest.approx(expected, rel=1e-3)
    assert lr_grid.window_closed(fine, target)
    # on the coarse x2 grid the ends are interpolated, so the span is close to the closed form, not a grid multiple
    coarse = sample(bowl(1e-3, floor, width=3.0), lr_grid.grid(1e-3, 9))
    assert lr_grid.window(coarse, target) == pytest.approx(2 * 3.0 * math.sqrt(math.log(1.01)), rel=0.05)
    # a wider curve has a wider window; a curve whose best is 2% above the target has none
    assert lr_grid.window(sample(bowl(1e-3, floor, 2.0), fine), target) > lr_grid.window(fine, target)
    assert lr_grid.window(sample(bowl(1e-3, 1.02 * floor), fine), target) == 0.0


def test_window_reaching_the_edge_is_a_lower_bound():
    flat = {lr: 10.0 for lr in lr_grid.grid(1e-3, 5)}
    assert lr_grid.window(flat, 10.0) == pytest.approx(math.log10(16))  # 2.5e-4 .. 4e-3
    assert not lr_grid.window_closed(flat, 10.0)
    # a second dip within the level, cut off from the best by a bump above it, is not part of the window
    dips = {1e-4: 10.0, 2e-4: 12.0, 4e-4: 10.0, 8e-4: 12.0}
    assert lr_grid.window(dips, 10.0) == pytest.approx(0.0, abs=0.2) and lr_grid.window_closed(dips, 10.0) is False


def _record(row, seed, lr, ppl, sent=1.0):
    per_step = [{"bytes": sent, "step_s": 0.1}] * 10
    return {"row": row, "seed": seed, "learning_rate": lr, "eval_loss": math.log(ppl), "per_step": per_step,
            "dense_fp32_bytes_per_step": 8.0, "steps": 10, "skipped_steps": 0}  # fmt: skip


def test_sweep_summary_compares_best_against_best(tmp_path):
    from benchmarks import suite

    lrs = lr_grid.grid(1e-3, 5)
    dense, sync = bowl(4e-3, 100.0, 0.5), bowl(1e-3, 104.0, 1.0)  # dense is best high, the sync lower and worse
    results = tmp_path / "llama-untied"
    results.mkdir()
    records = [_record("dense", 0, lr, dense(lr), 8.0) for lr in lrs + [8e-3]]
    records += [_record("sync32", 0, lr, sync(lr), 0.1) for lr in lrs]
    for seed, factor in ((1, 1.01), (2, 0.99), (3, 1.02)):  # the other seeds at each row's best only
        records += [_record("dense", seed, 4e-3, 100.0 * factor, 8.0), _record("sync32", seed, 1e-3, 104.0, 0.1)]
    for r in records:
        suite.result_path(results, r["row"], r["seed"], r["learning_rate"]).write_text(json.dumps(r))
    summary = suite.summarize_sweep(suite.load_sweep(results), nominal=1e-3, baseline="dense", search_seed=0)
    assert summary["dense"]["best_lr"] == pytest.approx(4e-3) and summary["dense"]["best_inside"]
    assert summary["dense"]["geomean"] == 1.0
    row = summary["sync32"]
    assert row["best_lr"] == pytest.approx(1e-3) and row["best_inside"]
    assert row["best_vs_best"] == pytest.approx({0: 1.04, 1: 1.04 / 1.01, 2: 1.04 / 0.99, 3: 1.04 / 1.02})
    assert row["worst"] == pytest.approx(1.04 / 0.99)
    assert row["geomean"] == pytest.approx(lr_grid.geomean([1.04, 1.04 / 1.01, 1.04 / 0.99, 1.04 / 1.02]))
    assert row["window"] == 0.0  # never within 1% of dense's best
    # at the nominal 1e-3, dense is off its best: there the sync reads better than dense (what one lr would report)
    assert row["at_nominal"] == pytest.approx(104.0 / dense(1e-3)) and row["at_nominal"] < 1
    assert row["bytes_ratio"] == pytest.approx(80.0)
    table = suite.sweep_markdown({"llama-untied": summary}, {"llama-untied": 1e-3})
    assert "| llama-untied | sync32 | 5 | 0.001 | 1.035 (4) | 1.051 | 0.00 | 0.00x |" in table
    assert not row["earns_default"] and row["window_ratio"] == 0.0


def test_sweep_summary_mixes_new_rows_with_an_older_baseline(tmp_path):
    """A row run today (it records the optimizer's state and peak memory) beside a baseline run before those figures
    were recorded: compared best against best, without the memory suite's ratios."""
    from benchmarks import suite

    results = tmp_path / "llama-untied"
    results.mkdir()
    new = {"optimizer_state_bytes": 64, "optimizer_state_bytes_by_group": {}, "peak_memory_bytes": 1}
    records = [_record("dense", 0, lr, 100.0 + abs(lr - 2e-3) * 1e4) for lr in (1e-3, 2e-3, 4e-3)]
    records += [{**_record("torchft-diloco-h16-lr1-m0", 0, lr, 110.0 + abs(lr - 2e-3) * 1e4), **new}
                for lr in (1e-3, 2e-3, 4e-3)]  # fmt: skip
    for r in records:
        suite.result_path(results, r["row"], r["seed"], r["learning_rate"]).write_text(json.dumps(r))
    summary = suite.summarize_sweep(suite.load_sweep(results), nominal=2e-3, baseline="dense", search_seed=0)
    assert summary["torchft-diloco-h16-lr1-m0"]["geomean"] == pytest.approx(1.1)
    assert "state_bytes" not in summary["torchft-diloco-h16-lr1-m0"]


def test_the_window_rule():
    """A default needs a window at least 2x the baseline's at no more than 1.005x best against best."""
    assert lr_grid.earns_default(0.8, 0.4, 1.005) and lr_grid.earns_default(0.9, 0.4, 0.99)
    assert not lr_grid.earns_default(0.79, 0.4, 1.0)  # 1.98x wider: not enough
    assert not lr_grid.earns_default(0.8, 0.4, 1.006)  # wide enough, but worse at its best
    assert lr_grid.earns_default(0.1, 0.0, 1.0) and not lr_grid.earns_default(0.0, 0.0, 1.0)
    assert lr_grid.window_ratio(0.6, 0.3) == pytest.approx(2.0) and lr_grid.window_ratio(0.6, 0.0) is None


@pytest.mark.slow  # six short DDP launches of the tiny from-scratch task: about 2 min on 2 cores
@pytest.mark.distributed
def test_sweep_smoke_three_learning_rates(tmp_path):
    """The quick form of the sweep: a tiny task, 3 learning rates, one row against dense, then one more seed."""
    command = [sys.executable, "-m", "benchmarks.suite", "comm", "--tasks", "llama-scratch", "--rows", "dense,q8",
               "--lrs", "3", "--max_lrs", "3", "--seeds", "0,1", "--max_steps", "3", "--scaling_world_sizes", "",
               "--output_dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    files = sorted(p.name for p in (tmp_path / "results" / "llama-scratch").glob("[!_]*.json"))
    assert len(files) == 2 * 3 + 2  # every row over the grid on seed 0, then seed 1 at each row's best
    sweep = json.loads((tmp_path / "results.json").read_text())["sweep"]["llama-scratch"]
    assert set(sweep) == {"dense", "q8"} and len(sweep["q8"]["curve"]) == 3
    assert sorted(sweep["q8"]["best_vs_best"]) == ["0", "1"]
    assert 0.8 < sweep["q8"]["geomean"] < 1.25 and sweep["q8"]["bytes_ratio"] > 1.2  # 3 steps, 2 of them dense warm-up
    assert "| llama-scratch | q8 |" in (tmp_path / "report.md").read_text()
    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)  # resumes: no launch
    assert rerun.returncode == 0 and "[llama-scratch seed" not in rerun.stdout


def test_grids_on_one_lattice_meet_on_the_same_keys():
    # a task re-centred from 5e-4 to 4e-3 (x8) reuses the runs of the old grid; odd steps stay named by 4 digits
    assert set(lr_grid.grid(4e-3, 5)) & set(lr_grid.grid(5e-4, 5)) == {1e-3, 2e-3}
    assert (
        lr_grid.key(3e-3 / 64) == 4.688e-05
        and lr_grid.extension({4.688e-05: 1.0, 9.375e-05: 2.0, 1.875e-4: 3.0}) == 2.344e-05
    )


def test_the_memory_suite_compares_state_memory_and_step_best_against_best(tmp_path):
    from benchmarks import suite

    results = tmp_path / "llama-finetune"
    results.mkdir()
    lrs = lr_grid.grid(1e-3, 3)
    adamw, factored = bowl(1e-3, 100.0, 0.5), bowl(2e-3, 100.4, 0.5)
    rows = {"adamw": (adamw, 1e-3, 800, 3000, 0.010), "factored8": (factored, 2e-3, 100, 2000, 0.012)}
    for row, (curve, best, state, peak, step) in rows.items():
        for seed, lr in [(0, lr) for lr in lrs + ([4e-3] if row == "factored8" else [])] + [
            (s, best) for s in (1, 2, 3)
        ]:
            record = _record(row, seed, lr, curve(lr) * (1 + 0.01 * seed))
            record["per_step"] = [{"bytes": 0.0, "step_s": 0.1, "optimizer_s": step}] * 6
            record.update(optimizer_state_bytes=state, peak_memory_bytes=peak * 2**20)
            suite.result_path(results, row, seed, lr).write_text(json.dumps(record))
    summary = suite.summarize_sweep(suite.load_sweep(results), nominal=1e-3, baseline="adamw", search_seed=0)
    row = summary["factored8"]
    assert row["best_lr"] == pytest.approx(2e-3) and row["geomean"] == pytest.approx(1.004)
    assert row["state_bytes_ratio"] == pytest.approx(0.125) and row["peak_memory_bytes_ratio"] == pytest.approx(2 / 3)
    assert row["optimizer_s_ratio"] == pytest.approx(1.2)
    table = suite.memory_markdown({"llama-finetune": summary})
    assert (
        "| llama-finetune | `factored8` | 0.00 MB (0.125) | 2,000 MiB (0.67) | 12.0 ms (1.20) | 1.004 (4) |" in table
    )
