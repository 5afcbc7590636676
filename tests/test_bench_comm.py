"""Smoke test of `benchmarks/bench_comm.py` at tiny size: one command launches the gloo workers, runs the rows and
prints one markdown table; the byte accounting of each row follows the ring model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


# Launches the benchmark's gloo workers: ~20-40 s on 2 cores, so it runs with `-m slow` (CI runs both sets).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_comm.py"


def test_bench_comm_smoke(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable,
        str(SCRIPT),
        "--output_dir",
        str(out),
        "--rows",
        "dense,grpo-allreduce-d0.15",
        "--max_steps",
        "4",
        "--seeds",
        "0",
        "--scaling_steps",
        "0",
        "--hidden_size",
        "32",
        "--layers",
        "1",
        "--vocab_size",
        "384",
        "--tokenizer_chars",
        "100000",
        "--batch_size",
        "2",
        "--seq_len",
        "32",
        "--eval_tokens",
        "512",
        "--timeout",
        "150",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("| method |") == 1  # one table

    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert set(summary) == {"dense", "grpo-allreduce-d0.15"}
    dense, grpo = summary["dense"], summary["grpo-allreduce-d0.15"]
    run = results["runs"]["dense-seed0"]
    numel = run["numel"]
    assert run["world_size"] == 2 and run["steps"] == 4
    assert dense["bytes"] == pytest.approx(4 * numel)  # ring all-reduce at W = 2: 2 (W - 1) / W * 4 N
    assert dense["ratio_fp32"] == pytest.approx(1.0) and dense["ppl_ratio"] == pytest.approx(1.0)
    # two dense warm-up steps, then compressed ones: fewer bytes than dense, but not more than 10x fewer on average
    assert 1.2 < grpo["ratio_fp32"] < 10
    grpo_run = results["runs"]["grpo-allreduce-d0.15-seed0"]
    assert grpo_run["grpo_totals"]["dense_steps"] == 2
    assert grpo_run["per_step"][0]["bytes"] == pytest.approx(4 * numel)
    assert all(s["bytes"] < numel for s in grpo_run["per_step"][2:])
    assert grpo_run["bytes_by_rank"][0] == pytest.approx(grpo_run["bytes_by_rank"][1])  # same figure on every rank
    assert all(0 < e["ppl"] < 2 * 384 for e in summary.values())  # trained a little from ~vocab-size perplexity
    assert (out / "table.md").read_text().startswith("tiny Llama")
