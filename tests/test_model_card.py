"""The model card: rendered from the template `grpo_hf/templates/model_card.md` and a `ModelCardRecord`, with the
same content as the card written line by line before the template (`tests/data/model_card_sample.md`)."""

import ast
import json
import math
from pathlib import Path

from huggingface_hub import ModelCard

import grpo_hf
from grpo_hf.hub.card import build_model_card
from grpo_hf.model_card import TEMPLATE, ModelCardRecord, render_model_card


SAMPLE = Path(__file__).parent / "data" / "model_card_sample.md"


def sample_run(folder: Path):
    """A comparison's GRPOTrainer run of a LoRA on the offline SmolLM2, on the standard library corpus, with measured
    energy, a comparison table, the report's plots, a command and a missing part: every section of the card."""
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "base_model_name_or_path": "/cache/smollm2",
                "r": 8,
                "lora_alpha": 16,
                "task_type": "CAUSAL_LM",
                "target_modules": ["v_proj", "q_proj"],
            }
        )  # fmt: skip
    )
    row = {
        "name": "grpo", "label": "GRPOTrainer", "steps": 20, "perplexity_before": 12.29, "perplexity_after": 10.849,
        "mean_nll_after": math.log(10.849), "eval_tokens": 8192, "train_seconds": 61.25, "tokens": 40960,
        "tokens_per_second": 668.7, "peak_memory_gb": 1.25, "comm_bytes": 123456789, "energy_kwh": 0.002,
        "energy_source": "nvml", "energy_estimated": False, "total_usd": 0.05,
        "groups": {"attn_qk.lora_A": 100, "ffn.lora_B": 300},
        "cost_assumptions": {"cost_pue": 1.5, "cost_grid_gco2_per_kwh": 400.0, "device_name": "NVIDIA H200",
                             "billed_devices": 1, "cost_gpu_hour_usd": 2.0, "cost_energy_kwh_usd": 0.15},
    }  # fmt: skip
    results = {
        "runs": [{"name": "trainer", "label": "Trainer"}, row],
        "ratios": {"perplexity_after": 0.99},
        "recipe": {
            "model": {"model_name_or_path": "smollm2-135m", "lora_r": 8},
            "data": {"corpus": "source", "val_percent": 5, "seq_len": 128},
            "training": {"max_steps": 20, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                         "learning_rate": 0.0005, "lr_scheduler_type": "cosine", "seed": 0},
            "grpo": {"grpo_groups": "semantic", "grpo_bits": "8", "cost_pue": 1.4},
        },
        "data": {"kind": "source", "fingerprint": "0123abcd", "python_version": "3.11.7 (main)", "val_percent": 5,
                 "train_tokens": 200000, "eval_tokens": 8192, "seq_len": 128},
        "files": {"loss": "loss_curves.png", "ratios": "ratios.png"},
        "command": "grpo-hf compare recipes/sft_smollm2_lora.yaml",
        "missing": ["`trainer_state.json`: the log of the run"],
        "environment": {"grpo_hf": "0.1.0.dev0", "transformers": "5.24.0", "torch": "2.13.0", "python": "3.11.7"},
    }  # fmt: skip
    table = "| | Trainer | GRPOTrainer |\n|---|---:|---:|\n| Eval perplexity | 10.96 | 10.85 |"
    return results, row, {"comparison_table": table, "tags": ["mine"]}


def _sections(text: str) -> dict[str, str]:
    """The card's metadata and each `## ` section but the versions (the installed huggingface_hub's is in it)."""
    head, _, body = text.partition("\n## ")
    parts = {"head": head}
    for section in body.split("\n## "):
        title, _, content = section.partition("\n")
        parts[title] = content
    parts.pop("Framework versions")
    return parts


def test_the_template_renders_the_card_written_before_it(tmp_path):
    results, row, kwargs = sample_run(tmp_path)
    card = build_model_card(results, row, tmp_path, "me/smollm2-grpo", **kwargs)
    assert _sections(str(card)) == _sections(SAMPLE.read_text())
    assert list(_sections(str(card))) == ["head", "Base model", "Use it", "Not recorded", "Evaluation",
                                          "Training data", "Training", "Cost", "Environmental impact", "Reproduce"]  # fmt: skip
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.co2_eq_emissions


def test_a_record_alone_renders_a_card(tmp_path):
    record = ModelCardRecord(repo_id="me/tiny", perplexity_after=10.5, groups={"attn_qk": 4096}, energy_source="rapl")
    card = render_model_card(record, tmp_path)  # no saved model there: a config-built full model
    reparsed = ModelCard(str(card))
    assert reparsed.data.library_name == "transformers" and reparsed.data.eval_results[0].metric_value == 10.5
    assert "| attn_qk | 4,096 (100.0%) |" in card.text and "## Reproduce" not in card.text
    assert "Not recorded." in card.text  # no cost figures
    assert "gives no `co2_eq_emissions`" in card.text  # RAPL named, but the energy itself was not recorded


def test_the_template_is_in_the_package_and_the_card_code_is_short():
    assert TEMPLATE.is_file() and TEMPLATE.parent.parent == Path(grpo_hf.__file__).parent
    for module in ("model_card.py", "hub/card.py"):
        tree = ast.parse((Path(grpo_hf.__file__).parent / module).read_text())
        long = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno > 80]
        assert not long, f"{module}: {long} longer than 80 lines"
