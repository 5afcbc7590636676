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


def _fault_run(row: str, seed: int, wall_s: float, perplexity: float, lost: int = 0, discarded=0) -> dict:
    """A `bench_faults.py` result file's fields that the report reads."""
    return {"row": row, "seed": seed, "wall_s": wall_s, "perplexity": perplexity, "steps_lost": lost,
            "syncs_discarded": discarded, "replica_steps_in_model": 360 - lost - (40 if row != "no-fault" else 0),
            "bytes_per_replica": 2e6 if row != "torchft-diloco" else 9e6, "replicas": 3, "max_steps": 120,
            "sync_every": 32, "step_seconds": 0.0, "ft_timeout": 10.0, "relaunch_delay": 5.0}  # fmt: skip


def test_bench_faults_report_is_generated_from_the_result_files(tmp_path):
    """The goodput table: per row, its ratios to no-fault on the same seeds (geometric mean, worst seed), written to
    faults.md."""
    from benchmarks.bench_faults import report

    runs = [
        _fault_run("no-fault", 0, 100.0, 200.0), _fault_run("no-fault", 1, 120.0, 210.0),
        _fault_run("grpo-torchft", 0, 110.0, 202.0, lost=8), _fault_run("grpo-torchft", 1, 120.0, 210.0, lost=8),
        _fault_run("restart", 0, 150.0, 200.0, lost=24, discarded=None),
        _fault_run("restart", 1, 180.0, 210.0, lost=26, discarded=None),
        _fault_run("torchft-diloco", 0, 105.0, 204.0, lost=8, discarded=1),
    ]  # fmt: skip
    for run in runs:
        (tmp_path / f"{run['row']}-seed{run['seed']}.json").write_text(json.dumps(run))
    text = report(tmp_path)
    assert (tmp_path / "faults.md").read_text() == text + "\n"
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ") for line in text.splitlines() if line.startswith("| `")
    }
    assert list(rows) == ["no-fault", "restart", "grpo-torchft", "torchft-diloco"]  # the order of the docstring
    assert rows["no-fault"][3] == "1.000 (1.000)" and rows["no-fault"][-1] == "1.000 (1.000) |"
    assert rows["grpo-torchft"][3] == f"{(1.1 * 1.0) ** 0.5:.3f} (1.100)"  # wall: geomean of 1.1 and 1.0, worst 1.1
    assert rows["grpo-torchft"][4] == "8.0 (8)" and rows["grpo-torchft"][5] == "312 / 360"
    assert rows["grpo-torchft"][-1] == f"{1.01**0.5:.3f} (1.010) |"  # perplexity
    assert rows["restart"][3] == f"{(1.5 * 1.5) ** 0.5:.3f} (1.500)" and rows["restart"][6] == "–"  # no sync discarded
    assert rows["torchft-diloco"][1] == "1" and rows["torchft-diloco"][6] == "1.0 (1)"  # one seed
    assert rows["torchft-diloco"][7] == "9.00 MB"


def test_bench_faults_counts_the_steps_the_final_model_does_not_hold():
    """Steps lost: a killed process's steps since its last kept sync, every step of a discarded interval, nothing of a
    finished process whose syncs were all kept; the restart row: every rank's steps since the checkpoint it resumed."""
    from benchmarks.bench_faults import aggregate

    def record(first, last, syncs, done=True, sent=10.0):
        return {"first_step": first, "last_step": last, "steps": last - first, "syncs": syncs, "bytes_start": 0.0,
                "bytes": sent, "done": done, "digest": "d"}  # fmt: skip

    kept = [[32, 3], [64, 2], [96, 3], [120, 3]]
    torchft = {
        "r0-a0": record(0, 120, kept),
        "r1-a0": record(0, 120, [[32, 3], [64, 0], [96, 3], [120, 3]]),  # its sync at 64 was discarded: 32 steps lost
        "r2-a0": record(0, 40, [[32, 3]], done=False, sent=4.0),  # killed after step 40: 8 steps since its last sync
        "r2-a1": record(64, 120, [[96, 3], [120, 3]], sent=6.0),  # healed at 64
    }
    result = aggregate("grpo-torchft", torchft, 120, eval_loss=5.0)
    assert result["steps_lost"] == 8 + 32 and result["syncs_discarded"] == 1
    assert result["replica_steps_trained"] == 120 + 120 + 40 + 56
    assert result["replica_steps_in_model"] == 336 - 40 and result["bytes_per_replica"] == 10.0
    assert result["replicas_identical"] and result["perplexity"] == pytest.approx(148.413159, rel=1e-6)
    restart = {
        "r0-a0": record(0, 41, [], done=False), "r1-a0": record(0, 40, [], done=False),
        "r2-a0": record(0, 40, [], done=False),
        **{f"r{r}-a1": record(32, 120, []) for r in range(3)},
    }  # fmt: skip
    result = aggregate("restart", restart, 120, eval_loss=5.0)
    assert result["steps_lost"] == 9 + 8 + 8 and result["syncs_discarded"] is None


@pytest.mark.slow
@pytest.mark.peers
def test_bench_faults_smoke_of_the_grpo_rows_on_torchft(tmp_path):
    """`no-fault` and `grpo-torchft` at the smallest size: the killed group died by SIGKILL (the launcher checks its
    exit code), was relaunched, healed, and every group ended on one model; the killed one lost one step (killed after
    step 8, synced after step 7)."""
    pytest.importorskip("torchft")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_faults", "--max_steps", "24", "--sync_every", "4", "--step_seconds",
         "1", "--relaunch_delay", "2", "--seeds", "0", "--rows", "no-fault,grpo-torchft", "--output_dir",
         str(tmp_path), "--results_dir", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {row: json.loads((tmp_path / "results" / f"{row}-seed0.json").read_text()) for row in ("no-fault",
                                                                                                  "grpo-torchft")}  # fmt: skip
    assert runs["no-fault"]["steps_lost"] == 0 and runs["no-fault"]["replica_steps_in_model"] == 72
    faulty = runs["grpo-torchft"]
    assert faulty["kill_codes"] == [-9] and faulty["heals"] == 1 and faulty["replicas_identical"]
    assert faulty["steps_lost"] == 1 and faulty["syncs_discarded"] == 0
    assert faulty["instances"]["r0-a0"]["first_step"] == 0 and faulty["instances"]["r0-a0"]["steps"] == 24  # survivors
    assert "| `grpo-torchft` | 1 |" in (tmp_path / "results" / "faults.md").read_text()
