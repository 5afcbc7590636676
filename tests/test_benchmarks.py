"""The benchmark scripts of `benchmarks/`: each one parses its arguments, and `bench_step_cost.py` runs end to end.

The benchmarks run as modules from the repository root (`python -m benchmarks.suite`) and import through packages
(`benchmarks.tasks`, `tests.testing_utils`); some import their helpers lazily, so that a moved helper only fails when a
benchmark runs: the smoke run below runs one.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
HELPERS = (
    "tasks.py",
    "revision.py",
    "lr_grid.py",
    "emulated_link.py",
    "replica_rows.py",
    "peers.py",
)  # modules the scripts import, with no command line of their own
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.name not in HELPERS)


# `python -m benchmarks.<script> --help` for every script, in one fresh Python started from the repository root (the
# `sys.path` of `python -m`), as `runpy` runs a module: one import of torch and transformers for all of them rather than
# ~4 s each. Each script's output and exit status are kept apart; an exception is a failure with its traceback.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback

results = {}
for script in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("benchmarks." + script, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            if exit.code is not None and not isinstance(exit.code, int):
                print(exit.code, file=sys.stderr)
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[script] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
sys.__stdout__.write(json.dumps(results))
"""
_HELP_RUNS = []


def start_help():
    """
    Start the `--help` process when the test run begins (tests/conftest.py calls this, from `START_EARLY`, when a test
    that uses `help_outputs` is selected): it imports torch and transformers on the second core while the other tests
    run on the first. Its outputs go to unnamed temporary files, so it never waits on a pipe nobody reads.
    """
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-c", HELP_ALL, *SCRIPTS], cwd=ROOT, stdout=stdout, stderr=stderr,
                               text=True)  # fmt: skip
    _HELP_RUNS.append((process, stdout, stderr))


@pytest.fixture(scope="module")
def help_outputs():
    if not _HELP_RUNS:
        start_help()
    process, stdout, stderr = _HELP_RUNS.pop()
    try:
        returncode = process.wait(timeout=300)
    finally:
        process.kill()  # (once it has exited: nothing)
    stdout.seek(0), stderr.seek(0)
    out, err = stdout.read(), stderr.read()
    stdout.close(), stderr.close()
    assert returncode == 0, err[-2000:]
    return json.loads(out)


START_EARLY = {"help_outputs": start_help}


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_parses_its_arguments(help_outputs, script):
    done = help_outputs[script]
    assert done["returncode"] == 0, done["stderr"][-2000:]
    assert "usage" in done["stdout"].lower()


@pytest.mark.slow
def test_bench_step_cost_smoke_run(tmp_path):
    """Two rows of the tiny Llama under 2-process DDP: both finish, GRPO sends fewer bytes, the table renders."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_step_cost", "--models", "tiny-llama", "--rows", "trainer,grpo",
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


def _cost_row(model: str, row: str, launches: list[list[float]], bytes_per_step: float) -> dict:
    """A pooled `bench_step_cost.py` row from step times per launch (the first, untimed steps included)."""
    from benchmarks.bench_step_cost import _skipped

    per_step = [[{"step_s": 9.9, "bytes": 0.0}] * _skipped(row) + [{"step_s": s, "bytes": 0.0} for s in steps]
                for steps in launches]  # fmt: skip
    timed = [s for steps in launches for s in steps]
    return {"model": model, "row": row, "median_step_s": sorted(timed)[len(timed) // 2],
            "bytes_per_step": bytes_per_step, "per_step": per_step}  # fmt: skip


def test_step_cost_comparisons_say_beats_only_outside_the_noise():
    """GRPO's projected step against a baseline: `loses` / `beats` when the interval excludes zero, else `tie`."""
    from benchmarks.bench_step_cost import comparisons

    steady = [[1.00, 1.01, 0.99, 1.00, 1.02, 0.98] * 3] * 3
    slower = [[s + 0.1 for s in launch] for launch in steady]
    noisy = [[1.00, 1.30, 0.75, 1.10, 0.90, 1.20] * 3, [0.8, 1.25, 1.05, 0.95, 1.15, 0.85] * 3]
    results = [
        _cost_row("m", "trainer", steady, 1e9),  # 8 s per step at 1 Gbit/s, 0.8 at 10, 0.08 at 100
        _cost_row("m", "grpo", slower, 1e8),  # 100 ms slower, a tenth of the bytes
        _cost_row("m", "fp16", noisy, 1e8),
    ]
    lines = comparisons(results, draws=400).splitlines()
    trainer = next(line for line in lines if "| trainer |" in line).split(" | ")
    fp16 = next(line for line in lines if "| fp16 |" in line).split(" | ")
    assert trainer[2].startswith("+100 ms") and trainer[2].endswith("loses")  # the measured step
    assert trainer[3].endswith("beats") and trainer[4].endswith("beats")  # 1 and 10 Gbit/s: 7.2 s and 0.72 s saved
    assert trainer[5].rstrip(" |").endswith("loses")  # 100 Gbit/s: 72 ms saved, 100 ms lost
    assert fp16[2].endswith("tie")  # same bytes, step times spread far wider than the difference
    assert comparisons(results, draws=400) == comparisons(results, draws=400)  # seeded


def test_hook_speed_buckets_are_ddps():
    """`bench_hook_speed.py --bucket_mb`: the first bucket is capped at 1 MiB, then `bucket_mb`; 0 is one bucket."""
    import torch

    from benchmarks.bench_hook_speed import buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (200_000, 100_000, 300_000, 700_000, 50_000)]
    grads = [torch.full((p.numel(),), float(i)) for i, p in enumerate(params)]
    split = buckets(params, grads, bucket_mb=4)  # 4 MiB = 1,048,576 fp32 entries
    assert [[p.numel() for p in b.parameters()] for b in split] == [[200_000], [100_000, 300_000], [700_000, 50_000]]
    assert [b.is_last() for b in split] == [False, False, True] and [b.index() for b in split] == [0, 1, 2]
    assert torch.equal(split[1].buffer(), torch.cat(grads[1:3]))
    assert len(buckets(params, grads, bucket_mb=0)) == 1


def test_step_cost_table_adds_measured_links_only_where_measured():
    """`--link_gbit`: a measured mean step per emulated link beside the projections; results without it render as
    before (the committed ones: `python -m benchmarks.tables --check`)."""
    from benchmarks.bench_step_cost import table

    def row(name: str, step_s: float) -> dict:
        return {"model": "m", "row": name, "trainable_params": 1e6, "median_step_s": step_s, "bytes_per_step": 1e6,
                "peak_rss_mib_by_rank": [100.0, 100.0]}  # fmt: skip

    plain = [row("trainer", 1.0), row("grpo", 1.1)]
    assert "measured" not in table(plain)
    measured = [row("trainer", 1.0), row("grpo", 1.1)]
    measured[0]["measured_link"] = {"1": {"mean_step_s": 1.5}, "10": {"mean_step_s": 1.05}}
    lines = table(measured).splitlines()
    assert lines[0].endswith("| measured mean s @ 1 Gbit/s | measured mean s @ 10 Gbit/s |")
    assert lines[2].endswith("| 1.500 | 1.050 |") and lines[3].endswith("| – | – |")
    assert [line.rsplit(" | ", 2)[0] + " |" for line in lines[2:]] == table(plain).splitlines()[2:]


def test_step_cost_comparisons_add_the_measured_links():
    """Where both rows were measured under an emulated link, the comparison gains its measured difference."""
    from benchmarks.bench_step_cost import comparisons

    steady = [[1.00, 1.01, 0.99, 1.00, 1.02, 0.98] * 3] * 3
    trainer, grpo = _cost_row("m", "trainer", steady, 1e9), _cost_row("m", "grpo", steady, 1e8)
    plain = comparisons([trainer, grpo], draws=400)
    slow = [[s + 0.5 for s in launch] for launch in steady]  # the trainer's all-reduce lands on its step
    trainer["measured_link"] = {"1": _cost_row("m", "trainer", slow, 1e9)}
    grpo["measured_link"] = {"1": _cost_row("m", "grpo", steady, 1e8)}
    lines = comparisons([trainer, grpo], draws=400).splitlines()
    assert lines[0].endswith("| measured @ 1 Gbit/s |")
    assert lines[2].split(" | ")[-1].startswith("-500 ms") and lines[2].endswith("beats |")
    assert [line.rsplit(" | ", 1)[0] + " |" for line in lines[2:]] == plain.splitlines()[2:]
