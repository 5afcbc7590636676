"""The fine-tuning recipes: every packaged recipe documents itself, and each runs from one command through its tiny
local-files twin (SFT, classification, and full fine-tuning under 2-process DDP with torchrun and accelerate launch,
exchanging gradients every step or syncing every H steps)."""

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from testing_utils import ROOT, run_accelerate_launch, run_torchrun

from grpo_hf.cli.main import main
from grpo_hf.compression.outer_sync import OUTER_MODE, fragments_due
from grpo_hf.harness.arguments import builtin_recipe, load_recipe
from grpo_hf.harness.recipe_files import builtin_recipe_names


RECIPES = ROOT / "recipes"
# Each real recipe and its tiny local-files twin.
TWINS = {
    "sft_smollm2_lora": "sft_tiny", "classify_minilm_lora": "classify_tiny", "full_ft_ddp": "full_ft_tiny",
    "full_ft_sync": "full_ft_sync_tiny",
}  # fmt: skip
# The recipes of the sync every H steps, and the per-step recipe each is otherwise the same as.
SYNCED = {"full_ft_sync": "full_ft_ddp", "full_ft_sync_tiny": "full_ft_tiny"}
QUIET = ["--disable_tqdm", "true"]


# What a copied measurement looks like: a ratio (1.005x), a duration (235 s, 4 min) or a perplexity.
MEASURED_FIGURE = re.compile(r"\d(\.\d+)?x\b|\d+ (s|min)\b|perplexity [\d.]+|ppl [\d.]+")


def header(name: str) -> str:
    text = (RECIPES / f"{name}.yaml").read_text()
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))


@pytest.mark.parametrize("name", sorted(TWINS) + sorted(TWINS.values()))
def test_recipes_say_how_to_run_them_and_where_their_runs_are_logged(name):
    text = header(name)
    assert f"recipes/{name}.yaml" in text and "recipes/LOG.md" in text  # the command; the dated log of its runs
    assert not MEASURED_FIGURE.search(text), MEASURED_FIGURE.search(text)  # figures live in the log, not here
    model_args, data_args, args = builtin_recipe(name)  # parses, and checks the shipped data
    from_file = load_recipe(RECIPES / f"{name}.yaml")  # the same file through the recipes/ link
    assert Path(data_args.dataset_name).samefile(from_file[1].dataset_name)  # found next to the recipe either way
    assert model_args == from_file[0]
    assert {**asdict(data_args), "dataset_name": None} == {**asdict(from_file[1]), "dataset_name": None}
    if name in SYNCED:  # one knob: the codec of the pseudo-gradient is grpo_compression's "auto" (quantize under DDP)
        assert args.grpo_compression == "auto" and args.grpo_sync_every > 1
    else:
        assert args.grpo_compression == "quantize"


def _syncs(every: int, steps: int) -> list[int]:
    """The optimizer steps after which one fragment syncs (the default ramp, then every `every`; the last step)."""
    return [step for step in range(1, steps + 1) if fragments_due(step, every) or step == steps]


@pytest.mark.parametrize("name", sorted(SYNCED))
def test_sync_recipes_turn_one_knob_of_their_per_step_recipe(name):
    import yaml

    synced = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    per_step = yaml.safe_load((RECIPES / f"{SYNCED[name]}.yaml").read_text())
    assert [key for key in synced if key.startswith("grpo_")] == ["grpo_sync_every"]  # the rest: GRPOConfig's
    every, steps = synced["grpo_sync_every"], synced["max_steps"]
    assert every == (32 if name == "full_ft_sync" else 4)
    assert len(_syncs(every, steps)) >= 5  # long enough for several syncs
    shared = {key: value for key, value in synced.items() if key not in ("output_dir", "max_steps", "grpo_sync_every")}
    assert shared == {key: value for key, value in per_step.items() if key in shared}  # model, data, optimizer alike
    assert set(per_step) - set(synced) <= {"grpo_compression", "grpo_lr_scale_warmup_steps"}
    _, _, args = builtin_recipe(name)
    assert (args.grpo_sync_fragments, args.grpo_sync_ramp, args.grpo_sync_outer_only) == (1, True, False)


def test_twins_share_the_data_and_the_pipeline_of_their_recipe():
    assert set(TWINS) | set(TWINS.values()) <= set(builtin_recipe_names())
    for real, twin in TWINS.items():
        real_model, real_data, _ = builtin_recipe(real)
        twin_model, twin_data, _ = builtin_recipe(twin)
        assert twin_data.dataset_name == real_data.dataset_name and twin_data.task == real_data.task
        assert twin_data.completion_only_loss == real_data.completion_only_loss
        assert (twin_model.lora_r > 0) == (real_model.lora_r > 0)
        assert twin_model.model_name_or_path.startswith("tiny-")


def test_multi_gpu_launch_files_are_documented():
    import yaml

    single = yaml.safe_load((RECIPES / "accelerate" / "multi_gpu.yaml").read_text())
    multi = yaml.safe_load((RECIPES / "accelerate" / "multi_node.yaml").read_text())
    assert single["distributed_type"] == multi["distributed_type"] == "MULTI_GPU"  # DDP, not FSDP / DeepSpeed
    assert (single["num_machines"], multi["num_machines"]) == (1, 2) and multi["main_process_ip"]
    ddp = header("full_ft_ddp")
    for line in ("torchrun --nproc_per_node 2 -m grpo_hf.cli train recipes/full_ft_ddp.yaml --use_cpu true",
                 "--nnodes 2", "--node_rank 0", "--master_addr", "accelerate launch --config_file "
                 "recipes/accelerate/multi_gpu.yaml", "recipes/accelerate/multi_node.yaml --machine_rank 0"):  # fmt: skip
        assert line in ddp, line


def test_sync_recipe_says_how_to_launch_it_on_two_machines():
    sync = header("full_ft_sync")
    assert "slow link" in sync and 'docs/compression.md, "Sync every H steps"' in sync
    for line in ("torchrun --nproc_per_node 2 -m grpo_hf.cli train recipes/full_ft_sync.yaml --use_cpu true",
                 "torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --master_addr MASTER --master_port 29500",
                 "accelerate launch --config_file recipes/accelerate/multi_node.yaml --machine_rank 0"):  # fmt: skip
        assert line in sync, line
    docs = (ROOT / "docs" / "recipes.md").read_text()
    assert "## Two machines, a slow link" in docs and "`full_ft_sync.yaml`" in docs


# --- the twins, end to end ---


@pytest.mark.slow  # a whole recipe twin, tokenizer to report: ~30-60 s on 2 cores
def test_sft_twin_trains_on_the_assistant_turns(tmp_path):
    out = tmp_path / "sft"
    assert main(["compare", str(RECIPES / "sft_tiny.yaml"), "--max_steps", "4", *QUIET, "--output_dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    data = results["data"]
    assert data["format"] == "messages" and data["completion_only_loss"] is True
    assert 0 < data["train_label_tokens"] < data["train_tokens"]  # prompts and system turns are masked
    trainer, grpo = results["runs"]
    assert trainer["perplexity_before"] == grpo["perplexity_before"]
    assert trainer["eval_tokens"] == data["eval_label_tokens"]  # perplexity on the replies only
    for run in (trainer, grpo):
        assert run["perplexity_after"] < run["perplexity_before"] and run["steps"] == 4
    dense = trainer["bytes_per_step"][0]
    assert grpo["bytes_per_step"][:2] == [dense, dense]  # the dense warm-up steps
    assert max(grpo["bytes_per_step"][2:]) < dense / 3  # then the codec (grpo_min_compress_numel: 256)
    report = (out / "report.md").read_text()
    assert "format `messages`, completion-only loss" in report and data["fingerprint"] in report


@pytest.mark.slow  # a whole recipe twin, tokenizer to report: ~30-60 s on 2 cores
def test_classification_twin_reports_accuracy_and_cost(tmp_path):
    out = tmp_path / "cls"
    args = ["compare", str(RECIPES / "classify_tiny.yaml"), "--max_steps", "4", *QUIET, "--output_dir", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["data"]["labels"] == ["computing", "cooking", "sports", "weather"]
    trainer, grpo = results["runs"]
    for run in (trainer, grpo):
        assert 0 <= run["accuracy_after"] <= 1 and run["eval_examples"] == 40
        assert "perplexity_after" not in run
        assert run["cost_per_quality"] == pytest.approx(run["total_usd"] / run["accuracy_after"])
    assert trainer["accuracy_before"] == grpo["accuracy_before"]
    assert results["ratios"]["accuracy_after"] == pytest.approx(grpo["accuracy_after"] / trainer["accuracy_after"])
    report = (out / "report.md").read_text()
    assert "| Eval accuracy after |" in report and "USD / accuracy" in report
    assert "perplexity" not in report.split("## How")[0].lower()  # no empty perplexity rows in a classifier's table


def _ddp_result(run, out: Path) -> dict:
    assert not run.timed_out, run.logs()
    assert run.returncode == 0, run.logs()
    return json.loads((out / "results.json").read_text())["runs"][0]


def _assert_ddp_and_hooked(row: dict, steps: int) -> None:
    assert row["world_size"] == 2 and row["ddp_wrapped"] is True  # the Trainer's model is a DDP wrapper
    assert row["hook_steps"] == row["steps"] == steps and row["hook_calls"] >= steps  # the GRPO hook ran every step
    dense = row["comm_bytes_dense_fp32"] / steps
    assert max(row["bytes_per_step"][2:]) < dense / 3  # and sent compressed gradients after the dense warm-up
    assert row["perplexity_after"] < row["perplexity_before"]


@pytest.mark.slow  # launches worker processes: ~20-30 s on 2 cores
@pytest.mark.distributed
def test_full_fine_tune_twin_under_torchrun_multi_node_form(tmp_path):
    """The documented multi-node torchrun line, on one node (`--nnodes 1 --node_rank 0`), gloo on CPU."""
    out = tmp_path / "ddp"
    run = run_torchrun(
        "-m", "grpo_hf.cli", "train", "recipes/full_ft_tiny.yaml", "--use_cpu", "true", "--output_dir", str(out),
        torchrun_args=("--nnodes", "1", "--node_rank", "0"), cwd=ROOT, timeout=300,
    )  # fmt: skip
    row = _ddp_result(run, out)
    _assert_ddp_and_hooked(row, steps=6)
    assert row["trainable_params"] == row["total_params"]  # full fine-tuning, no LoRA
    assert "allgather, W=2" in row["comm_mode"]
    assert run.stdout.count("Saved the model") == 1  # rank 0 alone writes the report


@pytest.mark.slow  # launches worker processes: ~20-30 s on 2 cores
@pytest.mark.distributed
def test_full_fine_tune_twin_under_accelerate_launch(tmp_path):
    out = tmp_path / "accelerate"
    run = run_accelerate_launch(
        RECIPES / "accelerate" / "multi_gpu.yaml",
        "-m", "grpo_hf.cli", "train", "recipes/full_ft_tiny.yaml", "--use_cpu", "true", "--max_steps", "4",
        "--output_dir", str(out), cwd=ROOT, timeout=300,
    )  # fmt: skip
    _assert_ddp_and_hooked(_ddp_result(run, out), steps=4)


@pytest.mark.slow  # launches worker processes: ~20-30 s on 2 cores
@pytest.mark.distributed
def test_sync_twin_trains_locally_and_syncs_every_h_steps_under_torchrun(tmp_path):
    """The twin of the sync every H steps, launched as its header prints it: DDP, inner steps that send only the
    agreed group norms, 4-bit pseudo-gradients at the syncs of the schedule (the ramp 1, 3, then every 4, the last)."""
    out = tmp_path / "sync"
    run = run_torchrun(
        "-m", "grpo_hf.cli", "train", "recipes/full_ft_sync_tiny.yaml", "--use_cpu", "true", "--output_dir", str(out),
        torchrun_args=("--nnodes", "1", "--node_rank", "0"), cwd=ROOT, timeout=300,
    )  # fmt: skip
    row = _ddp_result(run, out)
    steps, syncs = 12, [1, 3, 7, 11, 12]
    assert _syncs(4, steps) == syncs
    assert row["world_size"] == 2 and row["ddp_wrapped"] is True  # the Trainer's model is a DDP wrapper
    assert row["trainable_params"] == row["total_params"]  # full fine-tuning, no LoRA
    assert f"quantize ({OUTER_MODE}, W=2, bits 4" in row["comm_mode"]  # "auto" and grpo_sync_bits: 4-bit codes
    assert row["hook_steps"] == row["steps"] == steps and row["hook_calls"] >= steps  # the local hook, every step
    totals = row["comm_totals"]
    assert totals["syncs"] == len(syncs) and totals["nonfinite_syncs"] == 0 and totals["steps"] == steps
    per_step = row["bytes_per_step"]
    inner = {per_step[step - 1] for step in range(1, steps + 1) if step not in syncs}
    assert inner == {8.0 * len(row["groups"])}  # between syncs: one float64 norm per group (ring all-reduce, W=2)
    at_sync = {per_step[step - 1] for step in syncs}
    dense = row["comm_bytes_dense_fp32"] / steps
    assert len(at_sync) == 1 and dense / 8 < at_sync.pop() < dense / 6  # the whole Δ, in 4-bit codes (+ block scales)
    assert row["comm_bytes"] == sum(per_step) == totals["bytes_sent"]
    assert row["comm_ratio_fp32"] > steps / len(syncs) * 6  # fewer bytes than DDP's all-reduce of every step
    assert row["perplexity_after"] < row["perplexity_before"]
    assert run.stdout.count("Saved the model") == 1  # rank 0 alone writes the report


# --- the real recipes, shortened (real models: slow) ---


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft_smollm2_lora", "classify_minilm_lora"])
def test_real_recipe_runs_from_one_command(tmp_path, name):
    out = tmp_path / name
    args = ["compare", str(RECIPES / f"{name}.yaml"), "--max_steps", "2", "--max_eval_samples", "8", *QUIET]
    assert main([*args, "--output_dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["steps"] for r in results["runs"]] == [2, 2]


@pytest.mark.slow
@pytest.mark.distributed
def test_full_fine_tune_recipe_under_torchrun(tmp_path):
    out = tmp_path / "full"
    run = run_torchrun(
        "-m", "grpo_hf.cli", "train", "recipes/full_ft_ddp.yaml", "--use_cpu", "true", "--max_steps", "3",
        "--max_eval_samples", "4", "--output_dir", str(out), cwd=ROOT, timeout=900,
    )  # fmt: skip
    row = _ddp_result(run, out)
    assert row["world_size"] == 2 and row["ddp_wrapped"] and row["hook_steps"] == 3
    assert row["trainable_params"] == row["total_params"] > 100_000_000
