"""The benchmark scripts of `benchmarks/`: each one parses its arguments, and `bench_step_cost.py` runs end to end.

The benchmarks import their helpers lazily (the torchrun launcher from `tests/testing_utils.py`, the suite's tasks),
so that a moved helper only fails when a benchmark runs: the smoke run below runs one.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "tasks.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_parses_its_arguments(script):
    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


@pytest.mark.slow
def test_bench_step_cost_smoke_run(tmp_path):
    """Two rows of the tiny Llama under 2-process DDP: both finish, GRPO sends fewer bytes, the table renders."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_step_cost.py", "--models", "tiny-llama", "--rows", "trainer,grpo",
         "--steps", "2", "--repeats", "1", "--output_dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "step_cost.json").read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"trainer", "grpo"}
    assert rows["grpo"]["steps"] == rows["trainer"]["steps"] == 2
    assert 0 < rows["grpo"]["bytes_per_step"] < rows["trainer"]["bytes_per_step"]
    assert rows["grpo"]["grpo_totals"]["steps"] > rows["grpo"]["grpo_totals"]["dense_steps"]  # the codec ran
    assert "| tiny-llama | grpo |" in (tmp_path / "step_cost.md").read_text()
