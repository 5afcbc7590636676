"""The benchmark suite (`benchmarks/suite.py`): row names, the statistics of the report, and a smoke run of each suite."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite():
    from benchmarks import suite

    return suite


def test_row_names_resolve_to_settings(suite):
    assert suite.parse_row("comm", "dense") == {
        "name": "dense",
        "kind": "grpo",
        "overrides": {"grpo_compression": "none"},
    }
    assert suite.parse_row("comm", "q8")["overrides"]["grpo_bits"] == "8"
    assert suite.parse_row("comm", "powersgd-r4") == {"name": "powersgd-r4", "kind": "powersgd", "rank": 4}
    assert suite.parse_row("comm", "grpo:grpo_bits=2;grpo_min_compress_numel=1024")["overrides"] == {
        "grpo_bits": "2", "grpo_min_compress_numel": "1024"
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown comm row 'q8s'"):
        suite.parse_row("comm", "q8s")  # the gradient scales' rows went with grpo_scale_gradients
    assert suite.parse_row("lr", "trainer-lr0.5")["lr_factor"] == 0.5
    assert suite.parse_row("lr", "loraplus-16")["ratio"] == 16.0
    with pytest.raises(ValueError, match="unknown comm row 'q3'"):
        suite.parse_row("comm", "q3")
    with pytest.raises(ValueError, match="unknown lr row 'fp16'"):
        suite.parse_row("lr", "fp16")  # a comm row is not an lr row


def test_sync_rows_resolve_to_typed_settings(suite):
    from grpo_hf import GRPOConfig

    row = suite.parse_row("comm", "sync16-q4-f4")["overrides"]
    assert row == {"grpo_sync_every": 16, "grpo_sync_fragments": 4, "grpo_sync_ramp": True,
                   "grpo_compression": "quantize", "grpo_sync_bits": "4"}  # fmt: skip
    assert suite.parse_row("comm", "sync16-fp32")["overrides"]["grpo_compression"] == "none"
    # `sync<H>` alone: GRPOConfig's defaults but the interval (the one knob a user sets)
    assert suite.parse_row("comm", "sync32")["overrides"] == {"grpo_sync_every": 32}
    assert suite.parse_row("comm", "sync32-f2-noramp")["overrides"] == {
        "grpo_sync_every": 32, "grpo_sync_fragments": 2, "grpo_sync_ramp": False
    }  # fmt: skip
    assert suite.parse_row("comm", "sync32-q8-noramp-lr0.5-m0-bf16")["overrides"] == {
        "grpo_sync_every": 32, "grpo_sync_fragments": 1, "grpo_sync_ramp": False, "grpo_compression": "quantize",
        "grpo_sync_bits": "8", "grpo_sync_outer_lr": 0.5, "grpo_sync_outer_momentum": 0.0,
        "grpo_sync_global_dtype": "bfloat16",
    }  # fmt: skip
    assert suite.parse_row("comm", "sync32-q8-lr1-m0-momboth")["overrides"]["grpo_sync_moments"] == "both"
    overlap = suite.parse_row("comm", "sync32-q4-lr1-m0-d2-mix0")["overrides"]
    assert (overlap["grpo_sync_delay"], overlap["grpo_sync_mix"], overlap["grpo_sync_bits"]) == (2, 0.0, "4")
    assert "grpo_sync_moments" not in suite.parse_row("comm", "sync32-q8-lr1-m0")["overrides"]
    # the sync's own codes: `-q2` four 2-bit levels, `-qt` ternary (grpo_sync_bits "2" and "ternary")
    for name, bits in (("sync160-q2-noramp-lr1-m0", "2"), ("sync160-qt-noramp-lr1-m0", "ternary")):
        assert suite.parse_row("comm", name)["overrides"] == {
            "grpo_sync_every": 160, "grpo_sync_fragments": 1, "grpo_sync_ramp": False, "grpo_compression": "quantize",
            "grpo_sync_bits": bits, "grpo_sync_outer_lr": 1.0,
            "grpo_sync_outer_momentum": 0.0,
        }  # fmt: skip
    assert suite.parse_row("comm", "sync32-qt-f2-d1")["overrides"]["grpo_sync_delay"] == 1
    for name in ("sync32-q3", "sync32-qternary", "sync32-q2t"):
        with pytest.raises(ValueError, match="unknown comm row"):
            suite.parse_row("comm", name)
    # the sparse code (SparseLoCo): the top k of every C entries, and the residual's decay
    assert suite.parse_row("comm", "sync32-k64of4096-beta0.95")["overrides"] == {
        "grpo_sync_every": 32, "grpo_sync_density": 0.015625, "grpo_sync_chunk": 4096, "grpo_sync_error_decay": 0.95,
    }  # fmt: skip
    sparse = suite.parse_row("comm", "sync32-q4-f2-lr1-m0-d1-k16of256")["overrides"]
    assert (sparse["grpo_sync_delay"], sparse["grpo_sync_density"], sparse["grpo_sync_chunk"]) == (1, 0.0625, 256)
    assert (
        "grpo_sync_error_decay" not in sparse
        and "grpo_sync_density" not in suite.parse_row("comm", "sync32-q4")["overrides"]
    )
    assert suite.parse_row("comm", "sync16-q8-beta0.9")["overrides"]["grpo_sync_error_decay"] == 0.9
    # the peer: accelerate's LocalSGD is plain averaging of fp32 parameters every H steps, no ramp
    assert suite.parse_row("comm", "localsgd-h8")["overrides"] == {
        "grpo_sync_every": 8, "grpo_sync_outer_lr": 1.0, "grpo_sync_outer_momentum": 0.0, "grpo_compression": "none",
        "grpo_sync_ramp": False,
    }  # fmt: skip
    assert suite.parse_row("comm", "outer-h16")["overrides"]["grpo_sync_outer_only"] is True
    typed = suite._typed(
        suite.parse_row("comm", "grpo:grpo_sync_every=16;grpo_sync_fragments=2;grpo_sync_ramp=false;"
                        "grpo_sync_outer_lr=0.5;grpo_sync_outer_momentum=0;grpo_sync_global_dtype=bfloat16;grpo_sync_outer_only=0")["overrides"]
    )  # fmt: skip
    assert typed == {"grpo_sync_every": 16, "grpo_sync_fragments": 2, "grpo_sync_ramp": False, "grpo_sync_outer_lr": 0.5,
                     "grpo_sync_outer_momentum": 0.0, "grpo_sync_global_dtype": "bfloat16", "grpo_sync_outer_only": False}  # fmt: skip
    for name in (
        "sync32",
        "sync16-q4",
        "sync32-q8",
        "sync16-fp32",
        "localsgd-h16",
        "outer-h16",
        "sync16-q4-f4-bf16",
        "sync32-q8-lr1-m0-momsecond",
        "sync160-q2-noramp-lr1-m0",
        "sync160-qt-noramp-lr1-m0",
        "sync32-k64of4096-beta0.95",
        "sync16-q4-f2-k16of256",
    ):
        GRPOConfig(output_dir="/tmp/unused", **suite._typed(suite.parse_row("comm", name)["overrides"]))


def test_default_rows_are_known(suite):
    for name in suite.DEFAULT_COMM_ROWS.split(","):
        suite.parse_row("comm", name)
    for name in suite.DEFAULT_LR_ROWS.split(","):
        suite.parse_row("lr", name)


def test_ratio_stats_are_geometric(suite):
    stats = suite.ratio_stats([1.1, 0.9, 1.0])
    assert stats["geomean"] == pytest.approx((1.1 * 0.9) ** (1 / 3))
    assert stats["worst"] == 1.1 and stats["best"] == 0.9
    logs = [math.log(r) for r in (1.1, 0.9, 1.0)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert stats["ci95"] == pytest.approx(
        [math.exp(mean - 4.303 * sd / math.sqrt(3)), math.exp(mean + 4.303 * sd / math.sqrt(3))]
    )
    assert math.isnan(suite.ratio_stats([1.2])["ci95"][0])


def test_first_step_reaching(suite):
    history = [{"step": 6, "eval_loss": 2.5}, {"step": 12, "eval_loss": 2.3}, {"step": 18, "eval_loss": 2.2}]
    assert suite.first_step_reaching(history, 2.3) == 12
    assert suite.first_step_reaching(history, 2.0) is None


def _record(loss, steps=4, sent=100.0, dense=400.0, accuracy=None):
    return {"eval_loss": loss, "eval_accuracy": accuracy, "steps": steps, "dense_fp32_bytes_per_step": dense,
            "per_step": [{"bytes": dense, "step_s": 1.0}] * 2 + [{"bytes": sent, "step_s": 0.5}] * (steps - 2),
            "eval_history": [{"step": steps, "eval_loss": loss}]}  # fmt: skip


def test_summary_compares_rows_on_shared_seeds(suite):
    results = {
        "task": {
            "dense": {0: _record(2.0, sent=400.0), 1: _record(2.1, sent=400.0)},
            "q8": {0: _record(2.0 + math.log(1.1)), 1: _record(2.1), 2: _record(9.0)},  # seed 2 has no baseline
        }
    }
    summary = suite.summarize("comm", results, "dense")["task"]["q8"]
    assert summary["seeds"] == [0, 1]
    assert summary["ppl_ratio"] == pytest.approx({0: 1.1, 1: 1.0})
    assert summary["bytes_ratio"] == pytest.approx(4 * 400 / (2 * 400 + 2 * 100))  # whole run: warm-up included
    assert summary["steady_bytes_ratio"] == pytest.approx(4.0)
    table = suite.markdown("comm", {"task": {"q8": summary}}, "dense")
    assert "| task | q8 | 2 | 1.049 | 1.100 |" in table and "1.6x | 4.0x" in table


def _run_suite(*args, timeout=900):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run


@pytest.mark.slow  # two DDP launches and a tokenization of the corpus: ~1-2 min on 2 cores
@pytest.mark.distributed
def test_comm_suite_smoke(tmp_path):
    _run_suite("comm", "--tasks", "llama-scratch", "--rows", "dense,q8", "--seeds", "0", "--max_steps", "4",
               "--scaling_world_sizes", "", "--output_dir", str(tmp_path))  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    q8 = results["summary"]["llama-scratch"]["q8"]
    assert 3.0 < q8["steady_bytes_ratio"] < 4.5  # 8-bit codes and their block absmax against fp32
    assert 0.8 < q8["geomean"] < 1.25
    record = json.loads((tmp_path / "results" / "llama-scratch" / "q8-seed0.json").read_text())
    assert record["world_size"] == 2 and record["grpo_mode"] == "allgather" and record["grpo_totals"]["steps"] == 4
    assert "| llama-scratch | q8 | 1 |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow  # one process, three short runs with evaluations along the way
def test_lr_suite_smoke_grpo_without_ratios_is_the_trainer(tmp_path):
    _run_suite("lr", "--tasks", "gpt2-scratch", "--rows", "trainer,grpo-off,grpo-emb2", "--seeds", "0",
               "--max_steps", "2", "--eval_points", "1", "--output_dir", str(tmp_path))  # fmt: skip
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]["gpt2-scratch"]
    assert summary["grpo-off"]["ppl_ratio"] == {"0": 1.0}  # static GRPO without ratios: the Trainer, bit for bit
    assert summary["grpo-emb2"]["ppl_ratio"]["0"] != 1.0  # a ratio changes the run
    assert summary["trainer"]["steps_to_baseline"] == {"0": 2}  # the baseline reaches its own final loss


@pytest.mark.slow  # one process, two learning rates of two short runs
def test_memory_suite_smoke_records_state_bytes_and_compares_best_against_best(tmp_path):
    _run_suite("memory", "--tasks", "gpt2-scratch", "--rows", "adamw,factored8", "--seeds", "0", "--lrs", "2",
               "--max_lrs", "2", "--max_steps", "3", "--eval_points", "1", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    sweep = json.loads((tmp_path / "results.json").read_text())["sweep"]["gpt2-scratch"]
    assert sweep["adamw"]["state_bytes_ratio"] == 1.0
    assert 0.05 < sweep["factored8"]["state_bytes_ratio"] < 0.3  # factored second moments and 8-bit first moments
    assert sweep["factored8"]["peak_memory_bytes"] > 0 and sweep["factored8"]["optimizer_s"] > 0
    assert "| gpt2-scratch | `factored8` |" in (tmp_path / "report.md").read_text()
