"""
GRPO on FSDP2 and DeepSpeed, 2 gloo processes on CPU: `torchrun` runs the scripts in `tests/distributed/`, each rank
writes a JSON result, the assertions live here. One launch per script (module-scoped fixtures, each well under 2 min
on 2 cores).

What runs where: raw `fully_shard` wired as Accelerate's FSDP2 path wires it (`fsdp2_pieces.py`); GRPOTrainer through
the Trainer on a model sharded at load time with transformers' `DistributedConfig` (`trainer_fsdp2.py`; Accelerate's own
FSDP plugin needs a GPU: see benchmarks/gpu_check.sh); GRPOTrainer with the Trainer's `deepspeed=` on ZeRO 1/2/3
(`trainer_deepspeed.py`, DeepSpeed's CPU accelerator).
"""

import json
from pathlib import Path

import pytest
import torch
from testing_utils import ROOT, run_accelerate_launch, run_torchrun

from grpo_hf.compression.codes import code_for
from grpo_hf.compression.spec import CodecSpec


pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "distributed"
RATIOS = {"norms": 0.5, "embeddings": 2.0}  # the scripts' grpo_lr_ratios


def torchrun(script: str, out_dir: Path, *args: str, timeout: int = 240) -> list[dict]:
    run = run_torchrun(SCRIPTS / script, out_dir, *args, nproc=2, timeout=timeout, cwd=ROOT)
    if run.timed_out:
        pytest.fail(f"torchrun {script} did not finish in {timeout} s\n{run.logs()}")
    assert run.returncode == 0, f"torchrun {script} exited with {run.returncode}\n{run.logs()}"
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(r["world_size"] == 2 for r in results)
    return results


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp2_pieces")
    return torchrun("fsdp2_pieces.py", out_dir), out_dir


@pytest.fixture(scope="module")
def trainer_fsdp2(tmp_path_factory):
    return torchrun("trainer_fsdp2.py", tmp_path_factory.mktemp("trainer_fsdp2"))


@pytest.fixture(scope="module")
def trainer_deepspeed(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return torchrun("trainer_deepspeed.py", tmp_path_factory.mktemp("trainer_deepspeed"))


def _is_sharded(record: dict) -> None:
    assert record["is_fsdp"] and record["all_dtensor"]
    assert record["groups_follow_model"] and record["optimizer_holds_model_params"]


# --- raw fully_shard -----------------------------------------------------------------------------------------------


def test_lossless_reduce_scatter_matches_fsdp2s_own(pieces):
    results, out_dir = pieces
    for rank, result in enumerate(results):
        builtin, fp32 = result["lossless"]["builtin"], result["lossless"]["fp32"]
        _is_sharded(fp32)
        assert fp32["params_replaced"]  # fully_shard swapped every parameter object
        assert fp32["hook_calls"] > 0 and fp32["comm_steps"] == 6  # the custom reduce-scatter really ran
        assert fp32["bytes_sent"] == fp32["bytes_dense_fp32"]
        saved = torch.load(out_dir / f"lossless_rank{rank}.pt", weights_only=True)
        for kind in ("grads", "params"):
            for name, tensor in saved["builtin"][kind].items():
                torch.testing.assert_close(saved["fp32"][kind][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
        assert fp32["eval_loss"] == pytest.approx(builtin["eval_loss"], rel=1e-6)


def test_group_norms_and_multipliers_agree_across_ranks(pieces):
    results, _ = pieces
    records = [r["groups"] for r in results]
    for record in records:
        _is_sharded(record)
        assert record["multipliers_identical"] and record["params_identical"]
        assert max(record["norm_gap"]) < 1e-6  # the shards' sums of squares = the gathered full gradient's norm
        assert max(record["coherence_gap"]) < 1e-9  # the cosines with Adam's momentum, over the shards
        assert len(set(record["multipliers"])) > 1  # importance scaling acted
    assert records[0]["digest"] == records[1]["digest"]
    assert records[0]["losses"] != records[1]["losses"]  # the ranks trained on different batches


def test_per_group_learning_rates_over_shards(pieces):
    results, _ = pieces
    record = results[0]["groups"]
    first = record["lrs"][0]  # importance warm-up: multipliers are 1, the ratios apply
    assert first["norms"] == pytest.approx(3e-3 * RATIOS["norms"]) and first["attn_qk"] == pytest.approx(3e-3)
    assert first["embeddings"] == pytest.approx(3e-3 * RATIOS["embeddings"])
    last = record["lrs"][-1]
    multipliers = dict(zip(sorted(first), [None] * len(first)))
    assert len({round(last[g] / (3e-3 * RATIOS.get(g, 1.0)), 9) for g in multipliers}) > 1


@pytest.mark.parametrize("setting", ["q8-none", "q8-worker-bf16", "q4-worker-bf16", "q4-worker-int8"])
def test_compressed_runs_agree_and_count_their_bytes(pieces, setting):
    results, _ = pieces
    records = [r["compressed"][setting] for r in results]
    assert records[0]["digest"] == records[1]["digest"]
    bits = int(setting[1])
    for record in records:
        _is_sharded(record)
        assert record["params_identical"] and record["multipliers_identical"]
        assert record["comm_steps"] == 8 and record["hook_calls"] > 0
        ratio = record["bytes_dense_fp32"] / record["bytes_sent"]
        # codes plus one fp32 scale per block of 128; the last block of each chunk is padded (a few % on this tiny model)
        assert ratio == pytest.approx(32 / (bits + 32 / 128), rel=0.05)
        if setting.endswith("none"):
            assert record["residual_nbytes"] == 0
        else:
            assert record["bytes_sent"] == record["bytes_expected"]
            if setting.endswith("bf16"):  # (W - 1) chunks of S entries per unit, 2 bytes each
                assert record["residual_nbytes"] == 2 * record["residual_entries"]
            else:  # stored as 8-bit blocks: the message format
                assert record["residual_nbytes"] == sum(
                    code_for(CodecSpec(bits=8)).row_nbytes(n // 2) for n in record["flat_sizes"]
                )


def test_compressed_loss_stays_near_uncompressed(pieces):
    results, _ = pieces
    plain = results[0]["groups"]["eval_loss"]
    for setting, record in results[0]["compressed"].items():
        assert record["eval_loss"] == pytest.approx(plain, rel=0.02), setting  # 8 steps: a sanity bound only


def test_nonfinite_step_is_skipped_on_every_rank(pieces):
    results, _ = pieces
    for result in results:
        record = result["nonfinite"]
        assert record["unchanged"] and record["residuals_unchanged"]
        assert record["nonfinite_steps"] == 1 and record["comm_nonfinite"] == 1
        assert record["params_identical"] and record["moved_after"]


def test_resume_from_checkpoint_is_exact(pieces):
    results, _ = pieces
    for result in results:
        run = result["resume"]
        assert run["restored"] and run["state_file"]
        assert run["resumed"]["digest"] == run["straight"]["digest"]
        assert run["resumed"]["residual_digest"] == run["straight"]["residual_digest"]
        assert run["resumed"]["multipliers"] == run["straight"]["multipliers"]
    assert results[0]["resume"]["resumed"]["residual_digest"] != results[1]["resume"]["resumed"]["residual_digest"]


# --- GRPOTrainer through the Trainer (FSDP2 sharded at load time) -------------------------------------------------


def test_trainer_fsdp2_groups_ratios_importance(trainer_fsdp2):
    records = [r["groups"] for r in trainer_fsdp2]
    assert records[0]["digest"] == records[1]["digest"]
    for record in records:
        assert record["engine"] == "fsdp2" and record["compression"] == "none" and not record["fsdp_comm"]
        _is_sharded(record)
        assert record["optimizer_groups"] == sorted(["attn_qk", "attn_vo", "embeddings", "ffn", "norms"])
        assert record["global_step"] == 8 and record["multipliers_identical"] and record["params_identical"]
        lrs = record["logs"][-1]
        assert lrs["grpo/lr/norms"] < lrs["grpo/lr/attn_vo"] < lrs["grpo/lr/embeddings"]
        assert len(set(record["multipliers"])) > 1


def test_trainer_fsdp2_compressed_by_default(trainer_fsdp2):
    records = [r["compressed"] for r in trainer_fsdp2]
    assert records[0]["digest"] == records[1]["digest"]
    for record in records:
        assert record["engine"] == "fsdp2" and record["compression"] == "quantize" and record["fsdp_comm"]
        _is_sharded(record)
        assert record["comm_steps"] == record["global_step"] == 8 and record["hook_calls"] > 0
        # gradient_accumulation_steps=2: one reduce-scatter per unit and optimizer step, not per micro-batch
        assert record["hook_calls"] % 8 == 0 and record["hook_calls"] <= 8 * record["units"]
        assert record["params_identical"] and record["multipliers_identical"]
        assert record["totals"]["dense_steps"] == 2  # grpo_dense_warmup_steps
        last = record["logs"][-1]
        assert last["grpo/comm/ratio_fp32"] == pytest.approx(32 / (8 + 32 / 128), rel=0.05)
        assert last["cost/comm_bytes"] > 0


def test_trainer_fsdp2_checkpoints_carry_each_ranks_state(trainer_fsdp2):
    digests = set()
    for rank, result in enumerate(trainer_fsdp2):
        record = result["checkpoint"]
        assert record["saved_mode"] == "fsdp-reduce-scatter" and record["saved_rank"] == rank
        assert record["saved_world_size"] == 2 and record["restored"] and record["restored_step"] == 8
        assert record["restored_residual_digest"] == record["trained"]["residual_digest"]
        assert record["restored_multipliers"] == record["trained"]["multipliers"]
        digests.add(record["restored_residual_digest"])
    assert len(digests) == 2  # each rank its own residuals


# --- GRPOTrainer on DeepSpeed ZeRO 1/2/3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_keeps_groups_ratios_and_importance(trainer_deepspeed, stage):
    records = [r["zero"][f"zero{stage}"] for r in trainer_deepspeed]
    for record in records:
        assert record["engine"] == "deepspeed" and record["wrapper"] == "DeepSpeedEngine"
        assert record["zero_stage"] == stage
        assert record["compression"] == "none" and not record["comm_state"]
        assert record["compression_off_lines"] == (1 if record is records[0] else 0)  # once, on the main process
        assert record["optimizer_groups"] == sorted(["attn_qk", "attn_vo", "embeddings", "ffn", "norms"])
        assert record["global_step"] == 8 and record["importance_steps"] == 8
        assert record["multipliers_identical"] and len(set(record["multipliers"])) > 1
        first_step = {k: v for seen in record["seen_lrs"][:5] for k, v in seen.items()}
        assert first_step == pytest.approx({g: 3e-3 * RATIOS.get(g, 1.0) for g in first_step})
        last_step = {k: v for seen in record["seen_lrs"][-5:] for k, v in seen.items()}
        scales = {g: lr / (3e-3 * RATIOS.get(g, 1.0)) for g, lr in last_step.items()}
        assert all(0.5 - 1e-9 <= s <= 2.0 + 1e-9 for s in scales.values()) and len(set(scales.values())) > 1
        if stage < 3:
            assert record["params_identical"]
    assert records[0]["seen_lrs"] == records[1]["seen_lrs"]


def test_deepspeed_refuses_compression_settings(trainer_deepspeed):
    for result in trainer_deepspeed:
        assert result["refused"]["error"].startswith("grpo_compression='quantize' under DeepSpeed")


# --- the accelerate config files of recipes/accelerate/ ---------------------------------------------------------------


def _launch_env(config_file: Path, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    run = run_accelerate_launch(config_file, SCRIPTS / "launch_env.py", out_dir, nproc=2, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.logs()
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_accelerate_config_files_are_accepted_and_fsdp1_or_blocks_refused(tmp_path):
    pytest.importorskip("deepspeed")
    accelerate_dir = ROOT / "grpo_hf" / "recipes" / "accelerate"
    for result in _launch_env(accelerate_dir / "fsdp2.yaml", tmp_path / "fsdp2"):
        assert result["env"]["ACCELERATE_USE_FSDP"] == "true" and result["env"]["FSDP_VERSION"] == "2"
        assert result["error"] is None and result["world_size"] == 2
    for result in _launch_env(accelerate_dir / "deepspeed_zero2.yaml", tmp_path / "zero2"):
        assert result["env"]["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "recipes/accelerate/ds_zero2.json"
        assert result["error"] is None
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text((accelerate_dir / "fsdp2.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    for result in _launch_env(fsdp1, tmp_path / "fsdp1"):
        assert result["error"].startswith("accelerate launch with FSDP version 1: GRPOTrainer runs on FSDP2")
    blocks = tmp_path / "ds_blocks.json"
    blocks.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}))
    zero2 = tmp_path / "zero2_blocks.yaml"
    zero2.write_text(
        (accelerate_dir / "deepspeed_zero2.yaml").read_text().replace("recipes/accelerate/ds_zero2.json", str(blocks))
    )
    for result in _launch_env(zero2, tmp_path / "zero2_blocks"):
        assert "the DeepSpeed config has the block 'optimizer'" in result["error"]


def test_deepspeed_zero2_resume_is_exact(tmp_path):
    """benchmarks/gpu_engines.py's ZeRO-2 mode runs on CPU too: train 12 steps, resume from step 6, same parameters."""
    pytest.importorskip("deepspeed")
    run = run_torchrun(ROOT / "benchmarks" / "gpu_engines.py", "zero2", tmp_path, nproc=2, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.logs()
    lines = [line for line in run.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 9 and all(line.startswith("PASS") for line in lines), "\n".join(lines)
    assert "PASS zero2: resumed run equals the straight one" in lines
