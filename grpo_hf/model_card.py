"""The model card of a trained adapter (or model): Hub metadata, figures, groups, settings, cost and versions.

A card is rendered from a [`ModelCardRecord`], a small record of what the card says, by [`render_model_card`] with the
template `grpo_hf/templates/model_card.md` (as TRL renders `trl/templates/lm_model_card.md`). It follows the
ecosystem's conventions, the way PEFT and TRL write theirs:

- metadata `library_name: peft` (`transformers` for a full model), `base_model: <Hub id>`, `pipeline_tag`, `license`
  of the base, and the tags `grpo_hf`, `peft`, `lora`, `base_model:adapter:<Hub id>`. Never `grpo`: TRL's Group
  Relative Policy Optimization trainer uses that tag, and this library is another method;
- a `model-index` entry with the eval perplexity (and accuracy for classification), which the Trainer never writes
  for perplexity;
- `co2_eq_emissions` in grams, only when the energy was *measured* (NVML, RAPL):
  `grams = energy_kwh · cost_pue · cost_grid_gco2_per_kwh` (the grid's intensity is the `cost_grid_gco2_per_kwh`
  setting); an estimated energy gives no figure, and the card says so;
- the data, the GRPO groups and settings, the cost figures (or a comparison the caller gives), the command that
  produced the run and library versions.

`GRPOTrainer.push_to_hub` writes the card of a live trainer: [`results_from_trainer`] summarizes it (the summary
`save_model` also writes beside the model, [`RUN_SUMMARY_FILE`]), [`record_from_summary`] turns the summary into a
record. An application that knows more about its runs (where its base models come from, what its data is) fills the
record's fields itself.

Example:

```python
>>> from grpo_hf.model_card import record_from_summary, render_model_card, results_from_trainer
>>> results = results_from_trainer(trainer)  # a GRPOTrainer after train() and evaluate()
>>> record = record_from_summary(results, results["runs"][0], "me/smollm2-grpo-lora")
>>> card = render_model_card(record, "out")
>>> card.data.base_model, [r.metric_type for r in card.data.eval_results]
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData


PIPELINE_TAGS = {"CAUSAL_LM": "text-generation", "SEQ_CLS": "text-classification"}
TEMPLATE = Path(__file__).resolve().parent / "templates" / "model_card.md"
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What `GRPOTrainer.save_model` writes beside the model: the summary its card is built from.
RUN_SUMMARY_FILE = "grpo_run.json"
# The figures of a run the cost table shows, in order: key, label, format.
COST_FIGURES = (
    ("steps", "Optimizer steps", lambda v: f"{v:,}"),
    ("train_seconds", "Training time (s)", lambda v: f"{v:,.1f}"),
    ("tokens", "Tokens trained on", lambda v: f"{v:,.0f}"),
    ("tokens_per_second", "Tokens/s", lambda v: f"{v:,.0f}"),
    ("peak_memory_gb", "Peak memory (GB)", lambda v: f"{v:.2f}"),
    ("comm_bytes", "Bytes sent per worker (total)", lambda v: format_bytes(v)),
    ("energy_kwh", "Energy (kWh, {energy_source})", lambda v: f"{v:.5f}"),
    ("total_usd", "Cost (USD)", lambda v: f"${v:.4f}"),
)


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The Hub repository a base model comes from, its license, and how the copy trained on differs from it."""

    hub_id: str
    license: str | None = None
    note: str = ""


@dataclasses.dataclass
class ModelCardRecord:
    r"""
    What a model card says: filled by [`record_from_summary`] from a run summary (or by an application that knows more
    about its runs), rendered by [`render_model_card`]. Every field but `repo_id` may stay unset; the card then says
    what was not recorded.

    Example:

    ```python
    >>> from grpo_hf.model_card import ModelCardRecord, render_model_card
    >>> record = ModelCardRecord(repo_id="me/tiny-grpo", perplexity_after=10.8, groups={"attn_qk": 4096})
    >>> card = render_model_card(record, "out/grpo")  # the folder of the saved adapter or model
    ```

    Args:
        repo_id (`str`):
            `USER/NAME` of the Hub repository (the card's title and `model-index` name).
        trainer (`str`, *optional*, defaults to `"GRPOTrainer"`):
            The trainer's class name; `"Trainer"` for the plain Trainer (the baseline of a comparison), `None` when
            unknown.
        base (`BaseModel`, *optional*):
            The Hub base model (its `note`, if any, becomes the card's "Base model" section).
        dataset_name (`str`, *optional*, defaults to `"training data"`), dataset_text (`str`, *optional*, defaults to
        `"- not recorded"`), dataset_type (`str`, *optional*, defaults to `"custom"`):
            The data: its name (in `model-index`), its description (markdown, the "Training data" section) and its
            `model-index` type (the dataset's id for a Hub dataset).
        datasets (`list[str]`, *optional*), dataset_config (`str`, *optional*), dataset_split (`str`, *optional*,
        defaults to `"validation"`):
            The Hub ids of the data (the card's `datasets` metadata, which links the model to them on the Hub); the
            configuration and split of the held-out rows, in `model-index`.
        perplexity_before (`float`, *optional*), perplexity_after (`float`, *optional*), mean_nll_after (`float`,
        *optional*), accuracy_after (`float`, *optional*), eval_tokens (`int`, *optional*):
            The evaluation: held-out perplexity before and after training, mean negative log-likelihood per token,
            accuracy, and the number of predicted tokens.
        training (`dict`, *optional*):
            `max_steps`, `per_device_train_batch_size`, `gradient_accumulation_steps`, `learning_rate`,
            `lr_scheduler_type` and `seed` of the run.
        groups (`dict[str, int]`, *optional*), settings (`dict`, *optional*):
            Trainable parameters per GRPO group; the `grpo_*` settings (other keys are not shown).
        figures (`dict`, *optional*):
            The run's cost figures, by the keys of [`COST_FIGURES`] (`steps`, `train_seconds`, `total_usd`, ...).
        energy_source (`str`, *optional*), energy_estimated (`bool`, *optional*, defaults to `True`),
        cost_assumptions (`dict`, *optional*):
            How the energy was measured, and the prices, PUE, grid intensity and device of [`~grpo_hf.CostCallback`].
        comparison (`str`, *optional*):
            Markdown shown in the cost section instead of the run's own figures (a side-by-side comparison).
        images (`list[str]`, *optional*):
            Image files uploaded with the card, shown in the cost section.
        missing (`list[str]`, *optional*):
            What the record lacks, listed in a "Not recorded" section.
        command (`str`, *optional*):
            The command that produced the run ("Reproduce").
        environment (`dict`, *optional*):
            Versions of the run (`grpo_hf`, `transformers`, `peft`, `torch`, `accelerate`, `evaluate`, `python`).
        tags (`list[str]`, *optional*), license (`str`, *optional*):
            More tags (e.g. a trainer's `model_tags`); the license of the weights (default: the base's).
    """

    repo_id: str
    trainer: str | None = "GRPOTrainer"
    base: BaseModel | None = None
    dataset_name: str = "training data"
    dataset_text: str = "- not recorded"
    dataset_type: str = "custom"
    datasets: list[str] = dataclasses.field(default_factory=list)
    dataset_config: str | None = None
    dataset_split: str = "validation"
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    mean_nll_after: float | None = None
    accuracy_after: float | None = None
    eval_tokens: int | None = None
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    groups: dict[str, int] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    energy_source: str | None = None
    energy_estimated: bool = True
    cost_assumptions: dict[str, Any] = dataclasses.field(default_factory=dict)
    comparison: str | None = None
    images: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    command: str | None = None
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    tags: list[str] = dataclasses.field(default_factory=list)
    license: str | None = None


def hub_base_model(name_or_path: str | None) -> BaseModel | None:
    """The Hub base of a model name: the name itself when it is shaped like a Hub id and is no local folder."""
    if not name_or_path or Path(str(name_or_path)).expanduser().is_dir():
        return None
    return BaseModel(str(name_or_path)) if HUB_ID_PATTERN.match(str(name_or_path)) else None


def base_model_of(
    model_name: str | None,
    model_folder: str | Path,
    resolve: Callable[[str | None], BaseModel | None] = hub_base_model,
) -> BaseModel | None:
    """The base of the model trained from `model_name`, else of the adapter saved in `model_folder` (its
    `base_model_name_or_path`), as `resolve` names it."""
    base = resolve(model_name)
    adapter = _read_json(Path(model_folder) / "adapter_config.json")
    if base is None and adapter:
        base = resolve(adapter.get("base_model_name_or_path"))
    return base


# --------------------------------------------------------------------------------------------------------------
# What a card describes
# --------------------------------------------------------------------------------------------------------------


def last_eval(log_history) -> dict[str, Any]:
    """The figures of the last `eval_loss` entry of a Trainer's `log_history`, as a run's row: `mean_nll_after`,
    `perplexity_after` and, for a classifier, `accuracy_after` (`{}` without an evaluation)."""
    evals = [
        entry
        for entry in (log_history if isinstance(log_history, list) else [])
        if isinstance(entry, dict) and isinstance(entry.get("eval_loss"), (int, float))
    ]
    if not evals:
        return {}
    loss = evals[-1]["eval_loss"]
    row = {"mean_nll_after": loss, "perplexity_after": math.exp(loss) if loss < 700 else math.inf}
    if "eval_accuracy" in evals[-1]:
        row["accuracy_after"] = evals[-1]["eval_accuracy"]
    return row


def results_from_trainer(trainer, dataset: str | None = None) -> dict[str, Any]:
    """
    A summary of a [`~grpo_hf.GRPOTrainer`] after training (the run summary [`write_run_summary`] saves): the last
    `eval_loss` logged (as perplexity), the cost figures of its [`~grpo_hf.CostCallback`], its groups and settings,
    and versions.
    """
    from .config import grpo_field_names
    from .provenance import SUMMARY_TRAINING_KEYS, capture_environment, jsonable

    args = trainer.args
    summary = trainer.cost_callback.summary()
    metrics = summary["metrics"]
    row: dict[str, Any] = {"name": "grpo", "label": type(trainer).__name__, "steps": trainer.state.global_step}
    row.update(last_eval(trainer.state.log_history))
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
    config = getattr(model, "config", None)  # a plain nn.Module has none
    base = peft_config.base_model_name_or_path if peft_config else getattr(config, "_name_or_path", None)
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


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def record_from_summary(
    results: dict, row: dict, repo_id: str, base: BaseModel | None = None, **fields
) -> ModelCardRecord:
    """
    The [`ModelCardRecord`] of one run of a summary ([`results_from_trainer`], or a file of the same shape): `row` is
    the run's entry of `results["runs"]`; `fields` set any other field of the record (they win).
    """
    data = results.get("data") or {}
    if data.get("description"):
        dataset_name, dataset_text = data["description"], f"- {data['description']}"
    else:
        dataset_name = "training data"
        dataset_text = "- " + (", ".join(f"{k}: {v}" for k, v in data.items()) or "not recorded")
    recipe = results.get("recipe") or {}
    accuracy = next(
        (row[key] for key in ("accuracy_after", "eval_accuracy", "accuracy") if _number(row.get(key)) is not None),
        None,
    )
    values = dict(
        repo_id=repo_id,
        trainer=row.get("label", "GRPOTrainer"),
        base=base,
        dataset_name=dataset_name,
        dataset_text=dataset_text,
        perplexity_before=_number(row.get("perplexity_before")),
        perplexity_after=_number(row.get("perplexity_after")),
        mean_nll_after=_number(row.get("mean_nll_after")),
        accuracy_after=accuracy,
        eval_tokens=row.get("eval_tokens"),
        training=recipe.get("training") or {},
        groups=row.get("groups") or {},
        settings=recipe.get("grpo") or {},
        figures={key: row.get(key) for key, _, _ in COST_FIGURES},
        energy_source=row.get("energy_source"),
        energy_estimated=row.get("energy_estimated", True),
        cost_assumptions=row.get("cost_assumptions") or {},
        missing=list(results.get("missing") or []),
        command=results.get("command"),
        environment=results.get("environment") or {},
    )
    values.update(fields)
    return ModelCardRecord(**values)


# --------------------------------------------------------------------------------------------------------------
# The card
# --------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _co2(record: ModelCardRecord) -> dict | None:
    """`co2_eq_emissions` in grams when the energy was measured, else `None`."""
    assumptions = record.cost_assumptions
    energy = record.figures.get("energy_kwh")
    if record.energy_estimated or record.energy_source not in ("nvml", "rapl") or energy is None:
        return None
    pue = assumptions.get("cost_pue", 1.0)
    intensity = assumptions.get("cost_grid_gco2_per_kwh", 475.0)
    hardware = assumptions.get("device_name")
    entry = {
        "emissions": round(energy * pue * intensity, 4),
        "source": f"grpo_hf CostCallback: {record.energy_source.upper()}-measured energy ({energy:.6f} kWh) x PUE "
        f"{pue:g} x {intensity:g} gCO2eq/kWh (cost_grid_gco2_per_kwh)",
        "training_type": "fine-tuning",
    }
    if hardware:
        entry["hardware_used"] = f"{assumptions.get('billed_devices', 1)} x {hardware}"
    return entry


def markdown_table_of(header, rows) -> str:
    """A GitHub markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def format_bytes(value: float) -> str:
    """`1234567` -> `"1.23 MB"` (decimal units, as link speeds are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _cost_rows(record: ModelCardRecord) -> list[tuple[str, str]]:
    rows = []
    for key, label, fmt in COST_FIGURES:
        value = _number(record.figures.get(key))
        if value is not None:
            rows.append((label.format(energy_source=record.energy_source or "?"), fmt(value)))
    return rows


def _versions(environment: dict) -> str:
    import platform

    from .provenance import package_version

    names = ("grpo_hf", "transformers", "peft", "torch", "accelerate", "evaluate")
    lines = [f"- {name}: {environment.get(name)}" for name in names if environment.get(name)]
    if package_version("huggingface_hub"):
        lines.append(f"- huggingface_hub: {package_version('huggingface_hub')} (card written)")
    lines.append(f"- Python: {str(environment.get('python') or platform.python_version()).split()[0]}")
    return "\n".join(lines)


def _metrics(record: ModelCardRecord) -> list[tuple[str, str, float]]:
    """`(metric type, label, value)` of the evaluation the card reports."""
    metrics = []
    if record.perplexity_after is not None and math.isfinite(record.perplexity_after):
        metrics.append(("perplexity", "Eval perplexity", record.perplexity_after))
    if record.mean_nll_after is not None:
        metrics.append(("loss", "Eval loss (mean NLL per token)", record.mean_nll_after))
    if record.accuracy_after is not None:
        metrics.append(("accuracy", "Eval accuracy", record.accuracy_after))
    return metrics


def _card_data(record: ModelCardRecord, adapter: dict, task: str) -> ModelCardData:
    """The card's YAML metadata: library, base model, pipeline, license, tags, `model-index`, `co2_eq_emissions`."""
    base = record.base
    pipeline_tag = PIPELINE_TAGS.get(task, "text-generation")
    tags = ["grpo_hf"] + (["peft", "lora", "transformers"] if adapter else ["transformers"])
    if base is not None:
        tags.append(f"base_model:{'adapter' if adapter else 'finetune'}:{base.hub_id}")
    tags += [t for t in record.tags if t not in tags]
    eval_results = [
        EvalResult(
            task_type=pipeline_tag,
            dataset_type=record.dataset_type,
            dataset_name=f"{record.dataset_name} (held out)",
            dataset_config=record.dataset_config,
            dataset_split=record.dataset_split,
            metric_type=kind,
            metric_name=name,
            metric_value=round(float(value), 6),
        )
        for kind, name, value in _metrics(record)
    ]
    return ModelCardData(
        library_name="peft" if adapter else "transformers",
        base_model=base.hub_id if base else None,
        pipeline_tag=pipeline_tag,
        license=record.license or (base.license if base else None),
        tags=tags,
        model_name=record.repo_id,
        datasets=list(record.datasets) or None,
        eval_results=eval_results or None,
        co2_eq_emissions=_co2(record),
    )


def _summary(record: ModelCardRecord, adapter: dict) -> str:
    """The card's first paragraph: what the weights are, and how they were trained."""
    link = "grpo_hf"  # not on PyPI: no package page to link to
    if record.trainer == "Trainer":
        origin = f"trained with the plain `transformers.Trainer` (the baseline of a comparison) from {link}"
    elif record.trainer:
        origin = f"trained with `{record.trainer}` from {link}"
    else:
        origin = f"published with {link} (its folder does not record the trainer)"
    base = record.base
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
    return (
        f"{what}, {origin}: grouped parameter resource optimization for the Hugging Face Trainer (semantic parameter "
        "groups, a learning rate per group, compressed gradient communication, cost reports). Not TRL's Group Relative "
        "Policy Optimization. grpo_hf is not on PyPI (it installs from a clone of its repository); loading these "
        f"weights needs only {'transformers and peft' if adapter else 'transformers'}."
    )


def _base_note(record: ModelCardRecord, adapter: dict) -> str | None:
    """The "Base model" section: the base's own note, or how to load an adapter of a local base."""
    if record.base and record.base.note:
        return record.base.note.replace("REPO", f'"{record.repo_id}"')
    if adapter and record.base is None:
        local = adapter.get("base_model_name_or_path")
        where = f"the local folder `{local}`, not a Hub repository" if local else "not named in the adapter"
        return (
            f"The base model is {where}: load the adapter onto your copy of it with "
            f'`PeftModel.from_pretrained(base, "{record.repo_id}")`.'
        )
    return None


def _impact(record: ModelCardRecord, co2: dict | None) -> str:
    if co2:
        return f"{co2['emissions']:.3f} g CO2eq: {co2['source']}."
    if record.energy_source:
        return (
            f"The energy was not measured ({record.energy_source}: no NVML or RAPL counter), so this card gives no "
            "`co2_eq_emissions`."
        )
    return "The energy was not recorded, so this card gives no `co2_eq_emissions`."


def _body_context(record: ModelCardRecord, adapter: dict, task: str, co2: dict | None) -> dict[str, Any]:
    """The values the template lays out, each formatted here."""
    auto = "AutoPeftModelForCausalLM" if task == "CAUSAL_LM" else "AutoPeftModelForSequenceClassification"
    loader = (
        f'from peft import {auto}\n\nmodel = {auto}.from_pretrained("{record.repo_id}")'
        if adapter
        else f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{record.repo_id}")'
    )
    metrics = _metrics(record)
    evaluation = [(name, f"{value:.4f}") for _, name, value in metrics]
    if metrics and record.perplexity_before is not None:
        evaluation.insert(0, ("Eval perplexity before training", f"{record.perplexity_before:.4f}"))
    training, total = record.training, sum(record.groups.values()) or 1
    assumptions = record.cost_assumptions
    settings = [(k, f"`{v}`") for k, v in record.settings.items() if k.startswith("grpo_")]
    return {
        "title": record.repo_id.split("/")[-1],
        "summary": _summary(record, adapter),
        "base_note": _base_note(record, adapter),
        "loader": loader,
        "missing": record.missing,
        "evaluation_table": markdown_table_of(("Metric", "Value"), evaluation) if metrics else None,
        "eval_tokens": f"{record.eval_tokens:,}" if isinstance(record.eval_tokens, int) else "all",
        "dataset_text": record.dataset_text,
        "training_text": training
        and (
            f"{training.get('max_steps')} optimizer steps, batch {training.get('per_device_train_batch_size')} x "
            f"{training.get('gradient_accumulation_steps') or 1} accumulation, learning rate "
            f"{training.get('learning_rate')} ({training.get('lr_scheduler_type')}), seed {training.get('seed')}."
        ),
        "groups_table": record.groups
        and markdown_table_of(
            ("Group", "Parameters"), [(g, f"{n:,} ({n / total:.1%})") for g, n in record.groups.items()]
        ),
        "settings_table": record.settings and markdown_table_of(("Setting", "Value"), settings),
        "comparison": record.comparison,
        "cost_table": _cost_rows(record) and markdown_table_of(("This run", "Value"), _cost_rows(record)),
        "prices": assumptions
        and (
            f"Prices: ${assumptions.get('cost_gpu_hour_usd')}/device-hour, ${assumptions.get('cost_energy_kwh_usd')}"
            f"/kWh, PUE {assumptions.get('cost_pue')}; device: {assumptions.get('device_name')}."
        ),
        "images": record.images,
        "impact": _impact(record, co2),
        "command": record.command,
        "versions": _versions(record.environment),
    }


def render_model_card(record: ModelCardRecord, model_folder: str | Path) -> ModelCard:
    """
    The model card of `record`: metadata (see the module docstring) and the body of `templates/model_card.md`
    (evaluation, data, groups, settings, cost, environmental impact, the command, library versions).

    Args:
        record ([`ModelCardRecord`]):
            What the card says.
        model_folder (`str` or `Path`):
            The saved adapter (`adapter_config.json`) or model (`config.json`): whether the card is an adapter's, its
            task and LoRA settings.
    """
    import jinja2

    folder = Path(model_folder)
    adapter = _read_json(folder / "adapter_config.json")
    config = _read_json(folder / "config.json")
    if adapter:
        task = adapter.get("task_type") or "CAUSAL_LM"
    else:
        classifier = any("SequenceClassification" in a for a in config.get("architectures", []))
        task = "SEQ_CLS" if classifier else "CAUSAL_LM"
    card_data = _card_data(record, adapter, task)
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    template = environment.from_string(TEMPLATE.read_text(encoding="utf-8"))
    body = template.render(**_body_context(record, adapter, task, card_data.co2_eq_emissions))
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + body)


def write_run_summary(trainer, folder: str | Path) -> Path:
    """
    Write [`results_from_trainer`]`(trainer)` into `folder/grpo_run.json` ([`RUN_SUMMARY_FILE`]), whole or not at
    all: what the model card of the model saved there needs (eval metrics, GRPO groups and settings, cost, versions),
    so that the card can be written later from the folder alone. `GRPOMixin.save_model` calls it.
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
    model_name = results["recipe"]["model"]["model_name_or_path"]
    base = BaseModel(finetuned_from) if finetuned_from else base_model_of(model_name, trainer.args.output_dir)
    extra = [tags] if isinstance(tags, str) else list(tags or [])
    record = record_from_summary(results, results["runs"][0], repo_id, base=base, tags=extra, license=license)
    path = Path(trainer.args.output_dir) / "README.md"
    render_model_card(record, trainer.args.output_dir).save(path)
    return path


__all__ = [
    "COST_FIGURES",
    "HUB_ID_PATTERN",
    "RUN_SUMMARY_FILE",
    "TEMPLATE",
    "BaseModel",
    "ModelCardRecord",
    "base_model_of",
    "format_bytes",
    "hub_base_model",
    "last_eval",
    "markdown_table_of",
    "record_from_summary",
    "render_model_card",
    "results_from_trainer",
    "write_run_summary",
    "write_trainer_model_card",
]
