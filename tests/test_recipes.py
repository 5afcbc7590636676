import dataclasses
import json
import math
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from grpo_hf import GRPOConfig
from grpo_hf.compression.traffic import dense_allreduce_bytes
from grpo_hf.errors import RecipeError
from grpo_hf.harness.arguments import DataArguments, ModelArguments, builtin_recipe, load_recipe
from grpo_hf.harness.compare import compare, evaluate_perplexity, plain_training_arguments
from grpo_hf.harness.data import build_datasets, build_tokenizer
from grpo_hf.harness.models import build_model
from grpo_hf.harness.recipe_files import builtin_recipe_names
from grpo_hf.harness.report import PLOT_FILES, write_report
from grpo_hf.harness.table import TABLE_ROWS, compute_ratios, markdown_table


RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# The table rows of a language model (the accuracy rows belong to classifiers and are left out of its table).
LM_ROWS = [row for row in TABLE_ROWS if not row[0].startswith(("accuracy_", "eval_loss_"))]
# The tiny recipe, smaller still: a whole comparison in a few seconds.
FAST = [
    "--max_steps", "6", "--max_train_tokens", "4096", "--max_eval_tokens", "512", "--tiny_tokenizer_chars", "100000",
    "--logging_steps", "1", "--grpo_lr_scale_warmup_steps", "2", "--disable_tqdm", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    model_args, data_args, args = builtin_recipe("tiny", [*FAST, "--output_dir", str(out)])
    results = compare(model_args, data_args, args, progress=None)
    paths = write_report(results, out, command="grpo-hf quickstart --tiny")
    return results, paths, out


# --- the pipeline end to end ---


def test_results_json_holds_both_runs_and_provenance(comparison):
    _, paths, out = comparison
    saved = json.loads((out / "results.json").read_text())
    for key in ("runs", "ratios", "recipe", "data", "environment", "wall_seconds", "eval_before", "command"):
        assert key in saved
    assert [r["name"] for r in saved["runs"]] == ["trainer", "grpo"]
    assert saved["data"]["fingerprint"] and saved["data"]["python_version"].startswith("3.")
    for run in saved["runs"]:
        for key, *_ in LM_ROWS:
            assert run[key] is not None, key
        assert "accuracy_after" not in run
        assert run["steps"] == 6
        assert len(run["bytes_per_step"]) == 6
        assert run["loss_curve"]
    assert saved["recipe"]["training"]["lr_scheduler_type"] == "cosine"  # enums are stored as their values


def test_both_trainers_start_equal_and_learn(comparison):
    results, *_ = comparison
    trainer, grpo = results["runs"]
    assert trainer["perplexity_before"] == grpo["perplexity_before"]
    assert trainer["trainable_params"] == grpo["trainable_params"]
    assert trainer["loss_curve"][0] == pytest.approx(grpo["loss_curve"][0], rel=1e-4)  # same data, seed, weights
    for run in (trainer, grpo):
        assert run["perplexity_after"] < run["perplexity_before"]
        assert run["cost_per_quality"] == pytest.approx(run["total_usd"] * run["perplexity_after"])


def test_bytes_baseline_is_dense_allreduce_and_grpo_sends_less(comparison):
    results, *_ = comparison
    trainer, grpo = results["runs"]
    per_step = 2 * (2 - 1) / 2 * 4 * trainer["trainable_params"]  # W = 2
    assert trainer["bytes_per_step"] == [per_step] * 6
    assert trainer["comm_bytes"] == pytest.approx(per_step * 6)
    assert grpo["comm_totals"]["bytes_dense_fp32"] == pytest.approx(per_step * 6)  # codec counts the same baseline
    assert grpo["comm_bytes"] == pytest.approx(grpo["comm_totals"]["bytes_sent"])
    assert grpo["bytes_per_step"][:2] == [per_step, per_step]  # dense warm-up steps
    assert (
        per_step / 4.2 < min(grpo["bytes_per_step"][2:]) <= max(grpo["bytes_per_step"][2:]) < per_step / 3.5
    )  # 8 bits
    assert set(grpo["learning_rates"]) == set(grpo["groups"])  # the rate each group was trained with
    assert not grpo["importance_applied"] and not grpo["lr_scales"]  # importance off: no multiplier applied or logged
    assert not trainer["learning_rates"] and not trainer["lr_scales"]


def test_ratios_are_grpo_over_trainer(comparison):
    from grpo_hf.harness.table import TIMED_KEYS

    results, *_ = comparison
    trainer, grpo = results["runs"]
    for key, *_ in LM_ROWS:
        assert results["ratios_full_runs"][key] == pytest.approx(grpo[key] / trainer[key]), key
        if key not in TIMED_KEYS:  # counted or evaluated: the full runs' ratio is the headline
            assert results["ratios"][key] == results["ratios_full_runs"][key], key
        else:  # timed: the interleaved windows' (the full runs always train the Trainer first)
            assert results["ratios"][key] == pytest.approx(results["ratio_noise"][key]["ratio_interleaved"]), key
    assert results["ratios"]["accuracy_after"] is None
    assert results["ratios"]["perplexity_before"] == 1.0


def test_report_md_has_the_table_and_the_plots(comparison):
    results, paths, out = comparison
    report = (out / "report.md").read_text()
    assert markdown_table(dict(results, ratios=results["ratios"])) in report
    assert "| Metric | Trainer | GRPOTrainer | GRPOTrainer / Trainer |" in report
    for _, label, _ in LM_ROWS:
        assert label.split(" (")[0] in report
    assert "Eval accuracy" not in report  # no empty accuracy rows in a language model's table
    assert results["data"]["fingerprint"] in report
    for name in PLOT_FILES.values():
        png = out / name
        assert png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in report


def test_compute_ratios_handles_missing_and_zero():
    ratios = compute_ratios(
        {"a": 2.0, "b": 0.0, "c": None, "d": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, ["a", "b", "c", "d"]
    )
    assert ratios == {"a": 0.5, "b": None, "c": None, "d": None}


# --- recipes: files, overrides, errors ---


@pytest.mark.parametrize("name", ["quickstart", "tiny"])  # the recipes on your data: tests/test_recipe_twins.py
def test_packaged_recipes_parse_and_document_themselves(name):
    packaged = resources.files("grpo_hf").joinpath("recipes").joinpath(f"{name}.yaml")
    path = RECIPES / f"{name}.yaml"
    assert path.samefile(packaged)  # recipes/ links to grpo_hf/recipes/: one copy of each recipe
    text = path.read_text()
    header = (
        text.split("\n\n")[0]
        if not text.startswith("#")
        else "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    )
    assert "grpo-hf" in header and "recipes/LOG.md" in header  # the command; measured runs live in the dated log
    model_args, data_args, args = builtin_recipe(name)
    assert isinstance(args, GRPOConfig) and args.grpo_compression == "quantize"
    assert model_args.model_name_or_path in ("smollm2-135m", "tiny-llama")
    assert (model_args, data_args) == load_recipe(path)[:2]


def test_builtin_recipes_are_the_packaged_files():
    assert builtin_recipe_names() == [
        "classify_minilm_lora", "classify_tiny", "full_ft_ddp", "full_ft_sync", "full_ft_sync_tiny", "full_ft_tiny",
        "quickstart", "sft_smollm2_lora", "sft_tiny", "tiny",
    ]  # fmt: skip
    assert (RECIPES / "quickstart.yaml").samefile(resources.files("grpo_hf") / "recipes" / "quickstart.yaml")
    with pytest.raises(RecipeError, match="unknown built-in recipe 'huge'"):
        builtin_recipe("huge")


def test_command_line_overrides_beat_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model_name_or_path: tiny-llama\nmax_steps: 5\nlearning_rate: 5e-4\nseq_len: 32\nmax_eval_tokens: 64\n"
        "grpo_importance: true\nlora_target_modules: [q_proj]\n"
    )
    model_args, data_args, args = load_recipe(path)
    assert args.max_steps == 5 and args.learning_rate == 5e-4  # "5e-4" is a YAML string: typed like argparse would
    assert data_args.seq_len == 32 and model_args.lora_target_modules == ["q_proj"]
    overrides = [
        "--max_steps", "7", "--learning_rate", "1e-3", "--seq_len", "16", "--max_eval_tokens", "None",
        "--grpo_importance", "false", "--lora_target_modules", "q_proj", "v_proj",
    ]  # fmt: skip
    model_args, data_args, args = load_recipe(path, overrides)
    assert args.max_steps == 7 and args.learning_rate == 1e-3
    assert data_args.seq_len == 16 and data_args.max_eval_tokens is None
    assert args.grpo_importance is False
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]


def test_unknown_field_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learnin_rate: 0.1\n")
    with pytest.raises(
        RecipeError, match=r"bad.yaml: unknown field\(s\) 'learnin_rate' \(did you mean 'learning_rate'"
    ):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"command line: unknown field\(s\) 'max_step' \(did you mean 'max_steps'"):
        load_recipe(RECIPES / "tiny.yaml", ["--max_step", "3"])
    path.write_text("grpo_density: 1.5\n")
    with pytest.raises(RecipeError, match="grpo_density=1.5"):
        load_recipe(path)
    path.write_text("- a list\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(path)
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")


def test_plain_training_arguments_keep_values_and_drop_grpo_fields(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=9, learning_rate=1e-3, lr_scheduler_type="cosine",
                      grpo_density=0.3, report_to="none")  # fmt: skip
    plain = plain_training_arguments(args)
    assert type(plain) is TrainingArguments
    assert not hasattr(plain, "grpo_density")
    for field in dataclasses.fields(TrainingArguments):
        assert getattr(plain, field.name) == getattr(args, field.name), field.name


def test_dense_allreduce_bytes():
    assert dense_allreduce_bytes(1000, 2) == 4000
    assert dense_allreduce_bytes(1000, 4) == 6000
    assert dense_allreduce_bytes(1000, 1) == 0


def test_evaluate_perplexity_matches_the_model_loss():
    model_args = ModelArguments(
        model_name_or_path="tiny-llama", lora_r=0, tiny_vocab_size=400, tiny_tokenizer_chars=50_000
    )
    data_args = DataArguments(seq_len=32, max_train_tokens=64, max_eval_tokens=320)
    tokenizer = build_tokenizer(model_args, data_args)
    model, _ = build_model(model_args, data_args, seed=0, tokenizer=tokenizer)
    _, eval_ds, _ = build_datasets(tokenizer, data_args)
    result = evaluate_perplexity(model, eval_ds, batch_size=4, show_progress=False)
    with torch.no_grad():
        ids = torch.tensor(eval_ds["input_ids"])
        loss = model(input_ids=ids, labels=ids).loss.item()  # mean over the same tokens (every block is full)
    assert result["num_tokens"] == len(eval_ds) * 31
    assert result["mean_nll"] == pytest.approx(loss, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
    assert model.training  # mode restored


def test_lora_models_are_identical_for_one_seed():
    model_args = ModelArguments(
        model_name_or_path="tiny-llama", lora_r=4, tiny_vocab_size=400, tiny_tokenizer_chars=50_000
    )
    data_args = DataArguments(seq_len=32)
    tokenizer = build_tokenizer(model_args, data_args)
    first, _ = build_model(model_args, data_args, seed=0, tokenizer=tokenizer)
    second, _ = build_model(model_args, data_args, seed=0, tokenizer=tokenizer)
    trainable = [n for n, p in first.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for (n1, p1), (_, p2) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(p1, p2), n1


@pytest.mark.slow
def test_smollm2_quickstart_pipeline_runs(tmp_path):
    overrides = ["--max_steps", "2", "--max_train_tokens", "2048", "--max_eval_tokens", "256", "--logging_steps", "1",
                 "--disable_tqdm", "true", "--output_dir", str(tmp_path)]  # fmt: skip
    model_args, data_args, args = builtin_recipe("quickstart", overrides)
    results = compare(model_args, data_args, args, progress=None)
    trainer, grpo = results["runs"]
    assert trainer["perplexity_before"] == grpo["perplexity_before"] < 30
    assert trainer["trainable_params"] == 2_442_240


# --- the noise of timed ratios, and the saved models (what grpo-hf publish uploads) ---


def test_comparison_measures_the_noise_of_timed_ratios(comparison):
    from grpo_hf.harness.table import TIMED_KEYS

    results, _, out = comparison
    saved = json.loads((out / "results.json").read_text())
    timing = saved["timing_noise"]
    assert timing["rounds"] == 2 and timing["window_steps"] == 4
    # interleaved: T G in the first round, G T in the second
    assert [(w["round"], w["name"]) for w in timing["windows"]] == [
        (0, "trainer"),
        (0, "grpo"),
        (1, "grpo"),
        (1, "trainer"),
    ]
    assert all(w["train_seconds"] > 0 and w["total_usd"] > 0 for w in timing["windows"])
    noise = saved["ratio_noise"]
    assert set(noise) == set(TIMED_KEYS)
    for key, entry in noise.items():
        assert entry["ratio"] == pytest.approx(results["ratios"][key])  # the headline: the interleaved windows'
        assert entry["ratio_full_runs"] == pytest.approx(results["ratios_full_runs"][key])
        assert len(entry["window_ratios"]) == 2 and entry["within_noise"] in (True, False)
        low, high = entry["band"]
        assert low <= entry["ratio"] <= high and sorted(entry["window_ratios"]) == pytest.approx([low, high])
    report = (out / "report.md").read_text()
    assert "**Timed ratios and their noise**: 2 rounds of 4-step windows" in report
    assert "Bytes, steps and perplexity are exact." in report


def test_comparison_saves_each_runs_model(comparison):
    _, _, out = comparison
    for kind in ("trainer", "grpo"):
        assert (out / kind / "model.safetensors").is_file() and (out / kind / "tokenizer.json").is_file()
